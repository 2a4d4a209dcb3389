//! The [`Stage`] trait: what the executor needs from one pipeline stage.

use candle_core::{Module, Result, Tensor, Var};

/// One pipeline stage: a differentiable function of one microbatch, and its parameters.
///
/// The first stage receives the microbatch input (for a language model, token ids);
/// later stages receive the previous stage's output. The executor collects gradients
/// for exactly the parameters [`Stage::params`] lists, in that order.
pub trait Stage: Send + Sync {
    /// Runs the stage forward, with candle autograd.
    fn forward(&self, x: &Tensor) -> Result<Tensor>;
    /// The parameters to collect gradients for.
    fn params(&self) -> &[Var];
    /// How many segments [`Stage::forward_segment`] splits the forward into: the units
    /// of activation recomputation ([`crate::Executor::with_recompute`]), typically one
    /// per transformer block. 1 (the default): the whole stage is one segment.
    fn num_segments(&self) -> usize {
        1
    }
    /// Segment `i` of the forward, so that `forward(x)` equals
    /// `forward_segment(n − 1, … forward_segment(0, x))` with `n` = [`Stage::num_segments`],
    /// bit for bit. The default, for one segment, is [`Stage::forward`].
    fn forward_segment(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        match i {
            0 => self.forward(x),
            _ => candle_core::bail!("this stage has one segment, asked for segment {i}"),
        }
    }
    /// The parameters segment `i` uses (a subset of [`Stage::params`]; a parameter two
    /// segments use is in both), for hooks that gather a segment's parameters before it
    /// runs ([`crate::SegmentHooks`], ZeRO stage 3). Default: all of them.
    fn segment_params(&self, i: usize) -> Vec<Var> {
        let _ = i;
        self.params().to_vec()
    }
    /// Segment `i`'s parameters have just been (re)written in place, between
    /// [`Stage::begin_step`] and [`Stage::end_step`] when a caller runs without the
    /// step's derived tensors (ZeRO stage 3): derive what `begin_step` derives for this
    /// segment, or write it again in place into the tensors derived before, which saved
    /// graphs may still use. Default: nothing.
    fn begin_segment(&self, i: usize) -> Result<()> {
        let _ = i;
        Ok(())
    }
    /// Segment `i`'s parameters are about to be freed in place: free in place what
    /// [`Stage::begin_segment`] derived, keeping the tensors (a saved graph refers to
    /// them; the next `begin_segment` writes them again). Default: nothing.
    fn release_segment(&self, i: usize) -> Result<()> {
        let _ = i;
        Ok(())
    }
    /// Called before every forward and every backward the executor runs: `split` when
    /// that microbatch's backward is an `I` (the stage may compute only its input
    /// gradient and leave weight products for the `W` of the same microbatch), not when
    /// it is a `B` (everything at once). Default: nothing, `I` runs the whole backward.
    fn split_backward(&self, split: bool) {
        let _ = split;
    }
    /// Called before every forward the executor runs, with its microbatch (also before
    /// a backward, whose activation recomputation runs the forward again): a stage
    /// whose forward depends on which microbatch it computes (dropout masks drawn by
    /// each element's place in the batch) looks it up here. Default: nothing.
    fn microbatch(&self, microbatch: u32) {
        let _ = microbatch;
    }
    /// The weight-gradient half of a split backward: called when the executor runs `W`
    /// for `microbatch`. Returns the gradients it computed, each with its parameter (one
    /// of [`Stage::params`]); the executor adds them to those the `I` before it kept,
    /// and hands the sum over as that microbatch's. `W`s run in the order of their
    /// `I`s on each stage in every generated schedule, so a stage may compute the
    /// oldest deferred work (the sums of a step do not depend on which `W` computes
    /// which microbatch). The default computes nothing: `I` ran the whole backward
    /// ([`crate::SyntheticStage`] spends `W`'s cost here).
    fn backward_weights(&self, microbatch: u32) -> Result<Vec<(Var, Tensor)>> {
        let _ = microbatch;
        Ok(Vec::new())
    }
    /// Called by [`crate::Executor::run`] before a step's first action. A stage may
    /// derive tensors from its parameters here once for all of the step's microbatches
    /// (e.g. weights fused with their biases), instead of once per microbatch.
    fn begin_step(&self) -> Result<()> {
        Ok(())
    }
    /// Called by [`crate::Executor::run`] after a step's last action, also when the step
    /// fails: drop whatever `begin_step` derived, so that nothing stale outlives the
    /// parameters' next update.
    fn end_step(&self) {}
    /// What the executor multiplies each microbatch's loss by before its backward
    /// (`1 / (microbatches · dp)`), told before [`Stage::begin_step`]. A stage that adds
    /// a loss of its own from the middle of the model (a mixture of experts' balancing
    /// loss, `switchyard_ops::attach_loss`) scales its gradient the same way, so that it
    /// is a mean over the job's batch like the model's loss. Default: ignored.
    fn set_loss_scale(&self, scale: f64) {
        let _ = scale;
    }
    /// Whether the forwards from now on run again inside a backward (activation
    /// recomputation), so that a stage counting something per forward (a mixture of
    /// experts' routing) counts each microbatch once. Default: ignored.
    fn recomputing(&self, on: bool) {
        let _ = on;
    }
}

/// Any candle [`Module`] (or closure) with its parameters, as a [`Stage`].
pub struct ModuleStage<M> {
    module: M,
    params: Vec<Var>,
}

impl<M: Module + Send + Sync> ModuleStage<M> {
    pub fn new(module: M, params: Vec<Var>) -> Self {
        ModuleStage { module, params }
    }
}

/// A closure as a module.
pub struct FnModule<F>(F);

impl<F: Fn(&Tensor) -> Result<Tensor>> Module for FnModule<F> {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        (self.0)(xs)
    }
}

impl<F: Fn(&Tensor) -> Result<Tensor> + Send + Sync> ModuleStage<FnModule<F>> {
    /// A stage from a closure.
    pub fn from_fn(f: F, params: Vec<Var>) -> Self {
        ModuleStage {
            module: FnModule(f),
            params,
        }
    }
}

impl<M: Module + Send + Sync> Stage for ModuleStage<M> {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.module.forward(x)
    }

    fn params(&self) -> &[Var] {
        &self.params
    }
}
