//! # switchyard: pipeline, tensor and data parallelism on candle, with serial parity
//!
//! The facade crate: each switchyard crate under one name, plus the `switchyard`
//! command-line tool (`src/main.rs`). See `ARCHITECTURE.md` for how the crates fit and
//! the book in `docs/` for tutorials.
//!
//! | module | crate | what it holds |
//! |---|---|---|
//! | [`comm`] | switchyard-comm | the `Communicator` trait, the mesh, the in-process and MPI backends |
//! | [`schedule`] | switchyard-schedule | pipeline schedules as data: generate, validate, simulate, draw |
//! | [`ops`] | switchyard-ops | differentiable (and fused) building blocks |
//! | [`shard`] | switchyard-shard | shard specs, autograd-aware collectives, tensor-parallel layers |
//! | [`pipeline`] | switchyard-pipeline | the `Stage` trait and the executor |
//! | [`models`] | switchyard-models | the GPT and MLP, their plans, the plain reference GPT |
//! | [`train`] | switchyard-train | the trainer |

pub use switchyard_comm as comm;
pub use switchyard_models as models;
pub use switchyard_ops as ops;
pub use switchyard_pipeline as pipeline;
pub use switchyard_schedule as schedule;
pub use switchyard_shard as shard;
pub use switchyard_train as train;

/// A memory allocator that keeps freed memory for reuse instead of returning it to the
/// kernel at once, so the same large tensors allocated every step cost no page faults.
/// Binaries opt in with `#[global_allocator] static A: switchyard::Allocator = switchyard::Allocator;`.
pub use mimalloc::MiMalloc as Allocator;
