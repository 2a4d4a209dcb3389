//! A transformer block of the GPT: pre-LayerNorm attention and MLP (dense, or a mixture
//! of experts), each with its residual sum.

use candle_core::{Result, Tensor, Var};
use switchyard_shard::{
    Builder, Init, LayerInit, MoeShared, OpsBackend, ParallelMlp, ParallelMoe,
    ParallelSelfAttention, Precision, SequenceSplit, ShardSpec, TpGroup,
};

use crate::dropout::{block_sites, Dropouts};
use crate::gpt::LN_EPS;
use crate::GptConfig;

pub(crate) struct LayerNorm {
    weight: Var,
    bias: Var,
    ops: OpsBackend,
    /// Under sequence parallelism the LayerNorm sees this rank's positions, and its
    /// parameters' gradients are summed over the group ([`SequenceSplit::param`]).
    seq: SequenceSplit,
}

impl LayerNorm {
    pub(crate) fn new(vb: &Builder, d: usize, seq: &SequenceSplit) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: vb.param("weight", &[d], ShardSpec::Replicated, Init::Ones)?,
            bias: vb.param("bias", &[d], ShardSpec::Replicated, Init::Zeros)?,
            ops: vb.ops(),
            seq: seq.clone(),
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.seq.param(self.weight.as_tensor())?;
        let b = self.seq.param(self.bias.as_tensor())?;
        self.ops.layer_norm(x, &w, &b, LN_EPS)
    }
}

pub(crate) struct Block {
    ln_1: LayerNorm,
    attn: ParallelSelfAttention,
    ln_2: LayerNorm,
    mlp: Ffn,
    /// Whether the fused sub-layers keep what their backward reads as bf16
    /// (`Precision::Bf16` on the fused backend), so that the block frees the tensors
    /// only they and the residual sums read (see [`Block::forward`]).
    frees: bool,
    /// Under sequence parallelism the sub-layers gather their input again in the
    /// backward from the LayerNorms' outputs (this rank's positions), which must stay;
    /// the sub-layers free the gathered copies themselves.
    sequence_parallel: bool,
    /// Hidden dropout on the two residual branches, at these sites.
    dropouts: Dropouts,
    sites: (u64, u64),
    seq: SequenceSplit,
    ops: OpsBackend,
}

impl Block {
    /// `x + attn(ln_1(x))`, then `+ mlp(ln_2(·))`; while training with hidden dropout,
    /// each branch is dropped out in its sum (`switchyard_ops::dropout_add`, which keeps
    /// what the plain sum keeps).
    ///
    /// At bf16 on the fused backend, the LayerNorms' outputs (which the attention and
    /// the dense MLP keep rounded to bf16 themselves; not before a mixture of experts,
    /// whose router keeps it) and the sub-layers' outputs (whose
    /// residual sums need no values backward) are freed in place once read: candle's
    /// graph keeps the tensors, not their f32 values, and what the block keeps for its
    /// backward is bf16 but for the two residual sums and the LayerNorms' statistics.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.ln_1.forward(x)?;
        let a = self.attn.forward(&h)?;
        self.free_input(&h)?;
        let x = self.residual(x, &a, self.sites.0)?;
        self.free(&a)?;
        let h = self.ln_2.forward(&x)?;
        let m = self.mlp.forward(&h)?;
        // A mixture of experts' router product reads `h` again in its backward.
        if let Ffn::Dense(_) = self.mlp {
            self.free_input(&h)?;
        }
        let y = self.residual(&x, &m, self.sites.1)?;
        self.free(&m)?;
        Ok(y)
    }

    /// `x + a`, with `a` dropped out at `site` while training with hidden dropout.
    fn residual(&self, x: &Tensor, a: &Tensor, site: u64) -> Result<Tensor> {
        let first = self.seq.first_position(a.dim(1)?);
        match self.dropouts.mask(site, a, first)? {
            Some(mask) => switchyard_ops::dropout_add(x, a, &mask, self.ops),
            None => x + a,
        }
    }

    /// Frees a sub-layer's input (a LayerNorm's output), unless the sub-layer gathers
    /// it again in the backward.
    fn free_input(&self, t: &Tensor) -> Result<()> {
        match self.sequence_parallel {
            true => Ok(()),
            false => self.free(t),
        }
    }

    fn free(&self, t: &Tensor) -> Result<()> {
        match self.frees {
            true => switchyard_shard::storage::free_in_place(t),
            false => Ok(()),
        }
    }
}

/// What a stage's blocks share with it: the mixtures of experts' loss scale and counts,
/// and hidden dropout's step.
pub(crate) struct Shared<'a> {
    pub(crate) moe: &'a MoeShared,
    pub(crate) dropouts: &'a Dropouts,
}

/// A block's MLP: the dense one, or a mixture of experts of its shape.
pub(crate) enum Ffn {
    Dense(ParallelMlp),
    Moe(ParallelMoe),
}

impl Ffn {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Ffn::Dense(m) => m.forward(x),
            Ffn::Moe(m) => m.forward(x),
        }
    }
}

impl Block {
    /// Block `i` of `cfg` under the block's builder `vb` (`transformer.h.{i}`).
    pub(crate) fn new(
        cfg: &GptConfig,
        i: usize,
        vb: &Builder,
        tp: &TpGroup,
        seq: &SequenceSplit,
        init: LayerInit,
        shared: Shared,
    ) -> Result<Block> {
        let Shared { moe, dropouts } = shared;
        let d = cfg.d_model;
        // Created in the order of `GptConfig::param_shapes`.
        let ln_1 = LayerNorm::new(&vb.pp("ln_1"), d, seq)?;
        let attn = ParallelSelfAttention::new(vb, tp.clone(), d, cfg.n_head, init)?;
        let ln_2 = LayerNorm::new(&vb.pp("ln_2"), d, seq)?;
        let mlp = match cfg.moe.is_moe_layer(i) {
            false => Ffn::Dense(ParallelMlp::new(vb, tp.clone(), d, 4 * d, init)?),
            true => Ffn::Moe(ParallelMoe::new(
                vb,
                tp.clone(),
                d,
                cfg.moe.hidden(d),
                init,
                cfg.moe.options(),
                moe.clone(),
            )?),
        };
        Ok(Block {
            ln_1,
            attn,
            ln_2,
            mlp,
            frees: cfg.precision == Precision::Bf16 && cfg.ops == OpsBackend::Fused,
            sequence_parallel: seq.is_on(),
            dropouts: dropouts.clone(),
            sites: block_sites(i),
            seq: seq.clone(),
            ops: cfg.ops,
        })
    }

    /// Fuses the sub-layers' weights with their biases for the step.
    pub(crate) fn begin_step(&self) -> Result<()> {
        self.attn.begin_step()?;
        match &self.mlp {
            Ffn::Dense(m) => m.begin_step(),
            Ffn::Moe(m) => m.begin_step(),
        }
    }

    pub(crate) fn end_step(&self) {
        self.attn.end_step();
        match &self.mlp {
            Ffn::Dense(m) => m.end_step(),
            Ffn::Moe(m) => m.end_step(),
        }
    }

    pub(crate) fn release_step(&self) -> Result<()> {
        self.attn.release_step()?;
        match &self.mlp {
            Ffn::Dense(m) => m.release_step(),
            Ffn::Moe(m) => m.release_step(),
        }
    }

    /// A split backward defers the attention's and a dense MLP's weight products; a
    /// mixture of experts computes its whole backward at the `I`.
    pub(crate) fn set_split_backward(&self, split: bool) {
        self.attn.set_split_backward(split);
        if let Ffn::Dense(m) = &self.mlp {
            m.set_split_backward(split);
        }
    }

    pub(crate) fn backward_weights(&self) -> Result<Vec<(Var, Tensor)>> {
        let mut grads = self.attn.backward_weights()?;
        if let Ffn::Dense(m) = &self.mlp {
            grads.extend(m.backward_weights()?);
        }
        Ok(grads)
    }
}
