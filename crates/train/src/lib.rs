//! # switchyard-train: 3D-parallel training of the GPT
//!
//! The trainer puts the other crates together. For a `dp × pp × tp` layout it starts one
//! worker per rank, derives the mesh's groups, builds each rank's pipeline stages from
//! `switchyard-models` with tensor-parallel layers from `switchyard-shard`, and runs each
//! step's schedule program from `switchyard-schedule` with the executor of
//! `switchyard-pipeline`. Then it sums tied-embedding gradients across the first and last
//! stage, averages gradients over data-parallel replicas in buckets, clips by the global
//! gradient norm, and takes an AdamW step with warm-up and cosine decay. Everything is
//! seeded, so every layout trains the same model as one device would — the parity tests
//! in `tests/parity.rs` hold it to that.
//!
//! * [`TrainConfig`]: the run, with [`TrainConfig::validate`] refusing every bad layout
//!   before any worker starts, saying what to change.
//! * [`train`]: the loop over all ranks on threads; rank 0 reports the job's loss.
//! * [`Worker`]: one rank's state and step, for tests and custom loops.
//! * [`data`]: byte-level text, deterministic batches, evaluation windows.
//!
//! ```no_run
//! use switchyard_train::{data::Corpus, train, TrainConfig, TrainOptions};
//!
//! let cfg = TrainConfig { steps: 50, ..TrainConfig::default() }; // pp 2 × tp 2
//! let report = train(&cfg, &Corpus::bundled(), &TrainOptions::default()).unwrap();
//! println!("{}", report.render(&cfg));
//! ```
//!
//! Tutorials: `docs/tutorial/01-quickstart.md` and `docs/tutorial/04-3d-parallelism.md`.

pub mod checkpoint;
mod config;
pub mod data;
pub mod optim;
mod report;
mod trainer;
pub mod weights;
mod worker;

pub use config::TrainConfig;
pub use report::{PipelineRankReport, StepRecord, TrainReport};
pub use trainer::{train, train_rank, Resume, TrainOptions};
pub use worker::{NonFinite, StepMetrics, Worker};
