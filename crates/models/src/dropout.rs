//! Hidden dropout (Megatron-LM's `--hidden-dropout`; GPT-2's `resid_pdrop` and
//! `embd_pdrop`): on the embeddings' output and on each residual branch before its sum.
//!
//! The masks are [`switchyard_ops::DropoutMask`]s: a hash of each element's place in the
//! step's whole batch and sequence. A stage says where its tensors sit from two things it
//! is told: the step and its replica's first row, by the trainer before the step
//! ([`crate::ModelStage::set_dropout_step`]), and the microbatch, by the executor before
//! each forward and each recomputation (`Stage::microbatch`). So every layout, schedule
//! and recomputation draws the masks one device draws, and parity holds with dropout on.
//! Outside a training step (evaluation, sampling, timing the stage) there is no step and
//! nothing is dropped.

use std::sync::{Arc, Mutex};

use candle_core::{Result, Tensor};
use switchyard_ops::DropoutMask;

/// Which training step a stage's forwards belong to: what its dropouts' masks depend on
/// besides where each tensor sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DropoutStep {
    /// The run's seed.
    pub seed: u64,
    /// The step (so that a resumed run draws what the uninterrupted one drew).
    pub step: u64,
    /// The row, in the step's whole batch, of this replica's first sequence.
    pub first_row: usize,
}

/// What a stage and its blocks share: the rate, the step the trainer set and the
/// microbatch the executor set.
#[derive(Clone)]
pub(crate) struct Dropouts {
    p: f64,
    now: Arc<Mutex<Now>>,
}

#[derive(Default)]
struct Now {
    step: Option<DropoutStep>,
    microbatch: u32,
}

impl Dropouts {
    pub(crate) fn new(p: f64) -> Dropouts {
        Dropouts {
            p,
            now: Arc::default(),
        }
    }

    fn now(&self) -> std::sync::MutexGuard<'_, Now> {
        self.now.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn set_step(&self, step: Option<DropoutStep>) {
        let mut now = self.now();
        now.step = step;
        now.microbatch = 0;
    }

    pub(crate) fn set_microbatch(&self, microbatch: u32) {
        self.now().microbatch = microbatch;
    }

    /// The mask of dropout `site` for `x` (`[b, t, d]`, a microbatch of `b` sequences
    /// whose first position is `first_position` of the whole sequence); `None` when
    /// nothing is dropped (a rate of 0, or no training step).
    pub(crate) fn mask(
        &self,
        site: u64,
        x: &Tensor,
        first_position: usize,
    ) -> Result<Option<DropoutMask>> {
        if self.p == 0.0 {
            return Ok(None);
        }
        let now = self.now();
        let Some(step) = now.step else {
            return Ok(None);
        };
        let b = x.dim(0)?;
        Ok(Some(DropoutMask {
            p: self.p,
            key: DropoutMask::step_key(step.seed, step.step),
            site,
            first_row: (step.first_row + now.microbatch as usize * b) as u64,
            first_position: first_position as u64,
        }))
    }
}

/// The dropout sites of a GPT: 0 after the embeddings; block `l`'s attention branch
/// `2l + 1`, its MLP branch `2l + 2`.
pub(crate) fn block_sites(layer: usize) -> (u64, u64) {
    let l = layer as u64;
    (2 * l + 1, 2 * l + 2)
}
