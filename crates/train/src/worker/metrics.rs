//! What a step reports: its measurements, the collectives it traced, and the error of a
//! step that found a non-finite value.

use switchyard_pipeline::StepStats;

use super::GradReduceStats;

/// What one step measured.
#[derive(Debug, Clone)]
pub struct StepMetrics {
    pub step: usize,
    /// The mean loss over the whole global batch.
    pub loss: f64,
    /// The global gradient norm before clipping.
    pub grad_norm: f64,
    pub lr: f64,
    /// Wall time of the step on this rank, in seconds.
    pub seconds: f64,
    /// What the pipeline executor measured on this rank.
    pub exec: StepStats,
    /// The validation loss after this step, when it was measured.
    pub val_loss: Option<f64>,
    /// The data-parallel gradient all-reduce of this step (`None` without replicas, or
    /// under ZeRO).
    pub grad_reduce: Option<GradReduceStats>,
    /// What the model counted ([`switchyard_models::Model::step_metrics`]), summed over
    /// the job (one rank of each tensor-parallel group), by name.
    pub model: Vec<(String, f64)>,
    /// The collectives the layers made on the expert group (`--ep`: a mixture's
    /// all-to-alls, forward and backward), in call order.
    pub expert_comm: Vec<CommSpan>,
}

/// One collective of a step, for the trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CommSpan {
    /// The operation (`"all_to_all"`, …).
    pub op: &'static str,
    /// Start, in microseconds since the worker's epoch.
    pub start_us: f64,
    /// Duration, the wait for the peers included.
    pub dur_us: f64,
    /// The bytes it concerned (as `switchyard_comm::Traffic` counts them).
    pub bytes: usize,
}

/// The error of a step that found a non-finite loss or gradient.
#[derive(Debug, Clone)]
pub struct NonFinite {
    pub step: usize,
    /// The lowest rank on which it appeared.
    pub rank: usize,
    /// This rank's own finding, when it is that rank.
    pub detail: Option<String>,
}
