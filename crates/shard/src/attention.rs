//! Tensor-parallel causal self-attention over whole heads.
//!
//! The fused projection `c_attn` (`d → 3d`, rows `q | k | v`) is column-parallel with
//! `blocks = 3`: rank `i` computes `[q_i | k_i | v_i]`, the heads
//! `[i·H/p, (i+1)·H/p)` of q, k and v. Attention runs on those local heads with no
//! communication, and the output projection `c_proj` is row-parallel over the same head
//! slice, so `Y = Σ_i Attn_i(X) · P_i + b` is formed by one all-reduce:
//! **1 all-reduce forward (g in c_proj), 1 backward (f in c_attn)**.

use std::sync::Arc;

use candle_core::{Module, Result, Tensor, Var};
use switchyard_comm::Communicator;
use switchyard_ops::{attention_block_with, DeferredWeights, PairOptions};

use crate::error::ShardError;
use crate::linear::{check_group, ColumnParallelLinear, RowParallelLinear};
use crate::pair::{column_row_pair, pair_backward_weights, pair_options, StepCache};
use crate::param::{Builder, Init};
use crate::sequence::SequenceSplit;

/// Initialisation of a transformer sub-layer's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerInit {
    /// The input projections (`c_attn`, `c_fc`). Default `Normal { std: 0.02 }`.
    pub weight: Init,
    /// The output projections (`c_proj`); GPT-2 uses `0.02 / √(2·n_layer)`.
    /// Default `Normal { std: 0.02 }`.
    pub proj_weight: Init,
    /// Every bias. Default `Zeros`.
    pub bias: Init,
}

impl Default for LayerInit {
    fn default() -> Self {
        LayerInit {
            weight: Init::Normal { std: 0.02 },
            proj_weight: Init::Normal { std: 0.02 },
            bias: Init::Zeros,
        }
    }
}

/// Causal self-attention with heads split over the tensor-parallel group.
///
/// Given the *block's* builder (e.g. prefix `transformer.h.0`), it creates
/// `attn.c_attn.weight` `[3d, d]` (`Split { dim: 0, blocks: 3 }`), `attn.c_attn.bias`
/// `[3d]` (same), `attn.c_proj.weight` `[d, d]` (`Split { dim: 1 }`) and
/// `attn.c_proj.bias` `[d]` (replicated).
pub struct ParallelSelfAttention {
    c_attn: ColumnParallelLinear,
    c_proj: RowParallelLinear,
    n_head: usize,
    local_heads: usize,
    head_dim: usize,
    /// The weights fused with their biases between [`ParallelSelfAttention::begin_step`]
    /// and [`ParallelSelfAttention::end_step`].
    fused: StepCache,
    /// Where a split backward defers the weight products ([`Self::set_split_backward`]).
    split: DeferredWeights,
    /// [`Builder::sequence_parallel`]: the input and output are split along the sequence.
    seq: SequenceSplit,
}

impl ParallelSelfAttention {
    /// `n_head` must divide `d_model` and be divisible by the group size.
    pub fn new(
        vb: &Builder,
        comm: Arc<dyn Communicator>,
        d_model: usize,
        n_head: usize,
        init: LayerInit,
    ) -> Result<Self> {
        let vb = vb.pp("attn");
        let name = vb.prefix().to_string();
        check_group(&name, &vb, comm.as_ref())?;
        let n = comm.world_size();
        if n_head == 0 || !d_model.is_multiple_of(n_head) {
            return Err(ShardError::NotDivisible {
                layer: name,
                what: "d_model",
                count: d_model,
                by: n_head,
                why: "the number of heads".into(),
            }
            .into());
        }
        if !n_head.is_multiple_of(n) {
            return Err(ShardError::NotDivisible {
                layer: name,
                what: "the number of heads",
                count: n_head,
                by: n,
                why: "the tensor-parallel group size; each rank needs whole heads".into(),
            }
            .into());
        }
        let seq = SequenceSplit::new(&vb, comm.clone());
        let (c_attn, c_proj) = column_row_pair(
            &vb,
            comm,
            "c_attn",
            d_model,
            (3 * d_model, 3, d_model),
            init,
        )?;
        Ok(ParallelSelfAttention {
            c_attn,
            c_proj,
            n_head,
            local_heads: n_head / n,
            head_dim: d_model / n_head,
            fused: StepCache::new(&seq),
            split: DeferredWeights::new(),
            seq,
        })
    }

    /// `x` `[B, T, d]` (replicated) to `[B, T, d]` (replicated).
    ///
    /// One fused op ([`switchyard_ops::attention_block`]): the qkv projection, causal
    /// attention straight on its packed output (no transposes, no `(B, H, T, T)`
    /// tensors), and the output projection with its bias, `f` on the input gradient and
    /// `g` on the output. Neither the qkv projection nor the attention output becomes a
    /// tensor of candle's graph. Under sequence parallelism `[B, T/p, d]` (this rank's
    /// positions) to `[B, T/p, d]`, the collectives and `c_proj`'s bias around the op
    /// ([`crate::SequenceSplit`]).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.dims3()?;
        let opts = PairOptions {
            defer: Some(self.split.clone()),
            ..pair_options(&self.c_attn, &self.seq)
        };
        let w = self.fused.weights(&self.c_attn, &self.c_proj)?;
        let heads = self.local_heads;
        let run = |x: &Tensor, w: &_, opts: &_| attention_block_with(x, w, heads, opts);
        self.seq
            .around_pair(x, self.c_proj.bias(), (&w, opts), run)
            .map_err(|e| {
                e.context(format!(
                    "{} (tensor-parallel attention)",
                    self.c_attn.name()
                ))
            })
    }

    /// Fuses the weights with their biases once for every forward pass until
    /// [`ParallelSelfAttention::end_step`] (a pipeline step's microbatches), instead of
    /// once per forward pass.
    pub fn begin_step(&self) -> Result<()> {
        self.fused.begin(&self.c_attn, &self.c_proj)
    }

    /// Drops what [`ParallelSelfAttention::begin_step`] fused: call it before the
    /// parameters change.
    pub fn end_step(&self) {
        self.fused.end();
        self.split.clear();
    }

    /// Whether the backwards from now on compute only the input gradient (a split
    /// backward's `I`) and defer the weight products to
    /// [`ParallelSelfAttention::backward_weights`], or compute everything (a `B`).
    pub fn set_split_backward(&self, on: bool) {
        self.split.set_split(on);
    }

    /// The weight gradients of the oldest backward whose weight products were deferred
    /// (a split backward's `W`): each parameter with its gradient, the same values a
    /// whole backward gives them; none when nothing is deferred.
    pub fn backward_weights(&self) -> Result<Vec<(Var, Tensor)>> {
        pair_backward_weights(&self.split, &self.c_attn, &self.c_proj)
    }

    /// Frees the values [`ParallelSelfAttention::begin_step`] fused, in place: the tensors stay (a
    /// saved graph refers to them) until the next `begin_step` writes them again or
    /// `end_step` drops them. For parameters freed between uses (ZeRO stage 3).
    pub fn release_step(&self) -> Result<()> {
        self.fused.release()
    }

    /// The fused qkv projection.
    pub fn c_attn(&self) -> &ColumnParallelLinear {
        &self.c_attn
    }

    /// The output projection.
    pub fn c_proj(&self) -> &RowParallelLinear {
        &self.c_proj
    }

    /// All heads (all ranks together).
    pub fn n_head(&self) -> usize {
        self.n_head
    }

    /// The width of one head.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The heads this rank computes.
    pub fn local_heads(&self) -> usize {
        self.local_heads
    }
}

impl Module for ParallelSelfAttention {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        ParallelSelfAttention::forward(self, xs)
    }
}
