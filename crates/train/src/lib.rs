//! # switchyard-train: 3D-parallel training of any model
//!
//! The trainer puts the other crates together. For a `dp × pp × tp` layout it starts one
//! worker per rank, derives the mesh's groups, builds each rank's pipeline stages through
//! the [`switchyard_models::Model`] trait (the model's config builds a stage from
//! tensor-parallel layers of `switchyard-shard`), and runs each step's schedule program
//! from `switchyard-schedule` with the executor of `switchyard-pipeline`. Then it sums the
//! gradients of parameters the model ties across stages (a token table shared with the
//! LM head), averages gradients over data-parallel replicas in buckets, clips by the global
//! gradient norm, and takes an AdamW step with warm-up and cosine decay. Everything is
//! seeded, so every layout trains the same model as one device would — the parity tests
//! in `tests/parity.rs` (the GPT) and `tests/parity_mlp.rs` (an MLP) hold it to that.
//!
//! * [`TrainConfig`]: the run, with [`TrainConfig::validate`] refusing every bad layout
//!   before any worker starts, saying what to change.
//! * [`train`]: the loop over all ranks on threads; rank 0 reports the job's loss.
//! * [`Worker`]: one rank's state and step, for tests and custom loops.
//! * [`testing`]: one step of any layout, its loss and every gradient by name, compared
//!   with another layout or a hand-written loop (parity tests for a model of your own).
//! * [`data`]: the [`data::Dataset`] trait and its sampler (deterministic batches, the
//!   same on every layout), byte-level text, nanoGPT token files, tokenizer text, the
//!   validation split and evaluation windows.
//!
//! ```
//! use switchyard_models::GptConfig;
//! use switchyard_train::{data::Corpus, train, TrainConfig, TrainOptions};
//!
//! // The default layout (pp 2 × tp 2, 1F1B, 4 microbatches) with a tiny model.
//! let cfg = TrainConfig {
//!     model: GptConfig::tiny(2),
//!     seq_len: 16,
//!     batch: 8,
//!     steps: 5,
//!     warmup: 2,
//!     threads_per_worker: 1,
//!     ..TrainConfig::default()
//! };
//! let report = train(&cfg, &Corpus::bundled(), &TrainOptions::default()).unwrap();
//! println!("{}", report.render(&cfg));
//! assert_eq!(report.steps.len(), 5);
//! assert!(report.final_loss() < report.steps[0].loss);
//! ```
//!
//! ## Tutorials
//!
//! * [Chapter 1, "Quickstart"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/01-quickstart.md): `switchyard train`,
//!   the report, metrics and traces (example `quickstart`).
//! * [Chapter 4, "Putting it together: dp × pp × tp"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/04-3d-parallelism.md):
//!   what a step does on the mesh (example `layout_3d`).
//! * [Chapter 7, "Checkpoints"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/07-checkpoints.md): resume, reshard,
//!   export (example `checkpoints`).

pub mod checkpoint;
mod comm_thread;
mod config;
pub mod data;
mod device;
pub mod error;
pub mod estimate;
pub mod export;
pub mod optim;
mod report;
pub mod run_dir;
pub mod testing;
mod trainer;
pub mod weights;
mod worker;
pub mod zero;

pub use config::{
    memory_info, thread_limit, Bytes, MemoryInfo, Recompute, TrainConfig, BYTES_PER_PARAM,
    MAX_SCHEDULE_PAIRS, MAX_TIMEOUT_SECS,
};
pub use device::DeviceSpec;
pub use error::TrainError;
pub use report::{peak_rss, Coords, PipelineRankReport, RankMemory, StepRecord, TrainReport};
pub use trainer::{train, train_rank, Resume, TrainOptions};
pub use worker::{
    CommSpan, GradReduceStats, GradReducer, NonFinite, ReduceSpan, StepMetrics, Worker,
};
pub use zero::Optimizer;
