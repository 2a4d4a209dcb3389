//! # switchyard: pipeline, tensor and data parallelism on candle, with serial parity
//!
//! The facade crate: each switchyard crate under one name, plus the `switchyard`
//! command-line tool (`src/main.rs`). See `ARCHITECTURE.md` for how the crates fit and
//! [the book](https://github.com/switchyard-rs/switchyard/blob/main/docs/SUMMARY.md) in
//! `docs/` for tutorials; each chapter has a runnable example in `examples/`
//! (`cargo run --release --example quickstart`, …; `scripts/run-examples.sh` runs them
//! all).
//!
//! ```
//! use switchyard::schedule::{generate, simulate, Costs, ScheduleKind};
//!
//! // The 1F1B schedule of 4 pipeline ranks and 8 microbatches, simulated.
//! let timeline = simulate(&generate(ScheduleKind::OneFOneB, 4, 8)?, &Costs::default())?;
//! assert!((timeline.bubble_fraction - 3.0 / 11.0).abs() < 1e-12); // (p − 1)/(m + p − 1)
//! assert_eq!(timeline.peak_activations(), vec![4, 3, 2, 1]);
//! # Ok::<(), switchyard::schedule::ScheduleError>(())
//! ```
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
//! | [`bench`](mod@bench) | (here) | the end-to-end table behind `switchyard bench`, on the GPT |

pub use switchyard_comm as comm;
pub use switchyard_models as models;
pub use switchyard_ops as ops;
pub use switchyard_pipeline as pipeline;
pub use switchyard_schedule as schedule;
pub use switchyard_shard as shard;
pub use switchyard_train as train;

pub mod bench;

/// A memory allocator that keeps freed memory for reuse instead of returning it to the
/// kernel at once, so the same large tensors allocated every step cost no page faults.
/// Binaries opt in with `#[global_allocator] static A: switchyard::Allocator = switchyard::ALLOCATOR;`.
pub type Allocator = switchyard_mem::Counting<mimalloc::MiMalloc>;

/// The allocator's value, for `#[global_allocator] static A: switchyard::Allocator =
/// switchyard::ALLOCATOR;`: mimalloc, counted per rank and category by `switchyard-mem`
/// (what the training report's measured memory reads).
pub const ALLOCATOR: Allocator = switchyard_mem::Counting(mimalloc::MiMalloc);

pub use switchyard_mem as mem;

/// The environment variable that makes [`Allocator`] keep freed memory in the process
/// (`-1`: never hand it back to the OS), so the large tensors every step allocates reuse
/// warm pages instead of faulting in fresh zeroed ones — about a fifth of a training step
/// otherwise. mimalloc reads it when the process starts.
pub const KEEP_FREED_MEMORY_ENV: &str = "MIMALLOC_PURGE_DELAY";

/// Re-executes this program with [`KEEP_FREED_MEMORY_ENV`]` = -1` unless it is already set
/// (on Unix; elsewhere it does nothing). Call it first thing in `main`, before any thread
/// starts. It returns only when the variable was already set or the re-exec failed.
pub fn keep_freed_memory() {
    if std::env::var_os(KEEP_FREED_MEMORY_ENV).is_some() {
        return;
    }
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        if let Ok(exe) = std::env::current_exe() {
            let err = std::process::Command::new(exe)
                .args(std::env::args_os().skip(1))
                .env(KEEP_FREED_MEMORY_ENV, "-1")
                .exec();
            eprintln!(
                "switchyard: could not re-run with {KEEP_FREED_MEMORY_ENV}=-1 ({err}); continuing"
            );
        }
    }
}
