//! Predictions before a run: each rank's peak memory ([`memory`], and [`fits`] to
//! refuse what exceeds a budget) and the step time ([`time`]) of a [`crate::TrainConfig`], from the model's arithmetic (the
//! [`switchyard_models::Model`] trait) and the schedule's simulator, without building
//! the model or starting a worker.
//!
//! Invariant: nothing here allocates a tensor or starts a thread (calibration aside).

mod calibrate;
pub mod cluster;
pub mod fits;
pub mod memory;
pub mod plan;
pub mod time;
