//! The tensor-parallel MLP of a transformer block.
//!
//! `Y = GeLU(X·A) · B` with `A = [A_1 … A_p]` column-parallel and `B = [B_1; …; B_p]`
//! row-parallel: GeLU is element-wise, so rank `i` computes `GeLU(X·A_i)·B_i` with no
//! communication in between (the reason for Megatron's column-then-row pairing), and `g`
//! sums the partial products: **1 all-reduce forward, 1 backward**.

use std::sync::Arc;

use candle_core::{Module, Result, Tensor, Var};
use switchyard_comm::Communicator;
use switchyard_ops::{mlp_with, DeferredWeights, PairOptions};

use crate::attention::LayerInit;
use crate::error::ShardError;
use crate::linear::{check_group, ColumnParallelLinear, RowParallelLinear};
use crate::pair::{column_row_pair, pair_backward_weights, pair_options, StepCache};
use crate::param::Builder;
use crate::sequence::SequenceSplit;

/// `c_fc` (column, `d → hidden`, bias), GELU (tanh approximation), `c_proj` (row,
/// `hidden → d`, bias).
///
/// Given the *block's* builder (e.g. prefix `transformer.h.0`), it creates
/// `mlp.c_fc.weight` `[hidden, d]` (`Split { dim: 0 }`), `mlp.c_fc.bias` `[hidden]`
/// (same), `mlp.c_proj.weight` `[d, hidden]` (`Split { dim: 1 }`) and `mlp.c_proj.bias`
/// `[d]` (replicated). GPT uses `hidden = 4·d`.
pub struct ParallelMlp {
    c_fc: ColumnParallelLinear,
    c_proj: RowParallelLinear,
    /// The weights fused with their biases between [`ParallelMlp::begin_step`] and
    /// [`ParallelMlp::end_step`].
    fused: StepCache,
    /// Where a split backward defers the weight products ([`Self::set_split_backward`]).
    split: DeferredWeights,
    /// [`Builder::selective_recompute`]: the GELU's output is computed again in the
    /// backward instead of kept.
    recompute_gelu: bool,
    /// [`Builder::sequence_parallel`]: the input and output are split along the sequence.
    seq: SequenceSplit,
}

impl ParallelMlp {
    /// `hidden` must be divisible by the group size.
    pub fn new(
        vb: &Builder,
        comm: Arc<dyn Communicator>,
        d_model: usize,
        hidden: usize,
        init: LayerInit,
    ) -> Result<Self> {
        ParallelMlp::at(&vb.pp("mlp"), comm, d_model, hidden, init)
    }

    /// [`ParallelMlp::new`] with `vb` the MLP's own prefix (`c_fc` and `c_proj` directly
    /// under it): a mixture of experts' `mlp.experts.{e}`.
    pub fn at(
        vb: &Builder,
        comm: Arc<dyn Communicator>,
        d_model: usize,
        hidden: usize,
        init: LayerInit,
    ) -> Result<Self> {
        let vb = vb.clone();
        let name = vb.prefix().to_string();
        check_group(&name, &vb, comm.as_ref())?;
        let n = comm.world_size();
        if !hidden.is_multiple_of(n) {
            return Err(ShardError::NotDivisible {
                layer: name,
                what: "the hidden size",
                count: hidden,
                by: n,
                why: "the tensor-parallel group size".into(),
            }
            .into());
        }
        let seq = SequenceSplit::new(&vb, comm.clone());
        let (c_fc, c_proj) =
            column_row_pair(&vb, comm, "c_fc", d_model, (hidden, 1, hidden), init)?;
        Ok(ParallelMlp {
            c_fc,
            c_proj,
            fused: StepCache::new(&seq),
            split: DeferredWeights::new(),
            recompute_gelu: vb.selective_recompute(),
            seq,
        })
    }

    /// `x` `[.., d]` (replicated) to `[.., d]` (replicated); under sequence parallelism
    /// `[B, T/p, d]` (this rank's positions) to `[B, T/p, d]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // One fused op: both products, GELU, both biases, `f` on the input gradient and
        // `g` on the output; the `[.., hidden/p]` activation never leaves it. Under
        // sequence parallelism the collectives and the second bias are around it.
        let opts = PairOptions {
            recompute_gelu: self.recompute_gelu,
            defer: Some(self.split.clone()),
            ..pair_options(&self.c_fc, &self.seq)
        };
        let w = self.fused.weights(&self.c_fc, &self.c_proj)?;
        self.seq
            .around_pair(x, self.c_proj.bias(), (&w, opts), mlp_with)
            .map_err(|e| e.context(format!("{} (tensor-parallel MLP)", self.c_fc.name())))
    }

    /// Fuses the weights with their biases once for every forward pass until
    /// [`ParallelMlp::end_step`] (a pipeline step's microbatches), instead of once per
    /// forward pass.
    pub fn begin_step(&self) -> Result<()> {
        self.fused.begin(&self.c_fc, &self.c_proj)
    }

    /// Drops what [`ParallelMlp::begin_step`] fused: call it before the parameters change.
    pub fn end_step(&self) {
        self.fused.end();
        self.split.clear();
    }

    /// Whether the backwards from now on compute only the input gradient (a split
    /// backward's `I`) and defer the weight products to
    /// [`ParallelMlp::backward_weights`], or compute everything (a `B`).
    pub fn set_split_backward(&self, on: bool) {
        self.split.set_split(on);
    }

    /// The weight gradients of the oldest backward whose weight products were deferred
    /// (a split backward's `W`): each parameter with its gradient, the same values a
    /// whole backward gives them; none when nothing is deferred.
    pub fn backward_weights(&self) -> Result<Vec<(Var, Tensor)>> {
        pair_backward_weights(&self.split, &self.c_fc, &self.c_proj)
    }

    /// Frees the values [`ParallelMlp::begin_step`] fused, in place: the tensors stay (a
    /// saved graph refers to them) until the next `begin_step` writes them again or
    /// `end_step` drops them. For parameters freed between uses (ZeRO stage 3).
    pub fn release_step(&self) -> Result<()> {
        self.fused.release()
    }

    /// The input projection.
    pub fn c_fc(&self) -> &ColumnParallelLinear {
        &self.c_fc
    }

    /// The output projection.
    pub fn c_proj(&self) -> &RowParallelLinear {
        &self.c_proj
    }
}

impl Module for ParallelMlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        ParallelMlp::forward(self, xs)
    }
}
