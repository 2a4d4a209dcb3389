//! Column- and row-parallel linear layers (Megatron-LM, Shoeybi et al. 2019).
//!
//! With weights stored `[out, in]` (PyTorch), a linear layer is `Y = X·Aᵀ + b`; write
//! `A` for `Aᵀ` (`[in, out]`) below so that `Y = XA + b` as in the paper.
//!
//! **Column-parallel**: `A = [A_1 … A_p]` split along its output dim. Rank `i` holds
//! `A_i` (stored rows `i` of `[out, in]`, [`ShardSpec::split`]`(0)`) and `b_i`, and
//! computes `Y_i = f(X)·A_i + b_i`, its slice of the output. `f` (identity forward,
//! all-reduce backward) makes the input gradient `Σ_i ∂L/∂Y_i · A_iᵀ` complete on every
//! rank. Optionally `Y = [Y_1 … Y_p]` is all-gathered.
//!
//! **Row-parallel**: `A = [A_1; …; A_p]` split along its input dim and `X = [X_1 … X_p]`
//! arrives split the same way (the output of a column-parallel layer). Rank `i` computes
//! `X_i·A_i`, and `g` (all-reduce forward, identity backward) forms
//! `Y = Σ_i X_i·A_i`; the replicated bias is added **after** the reduce, once.
//!
//! A column layer followed by a row layer (attention, MLP) therefore communicates once
//! forward (the `g`) and once backward (the `f`).

use std::sync::Arc;

use candle_core::{Module, Result, Tensor, Var};
use switchyard_comm::{Communicator, ReduceOp};
use switchyard_ops::{linear_with, LinearOptions, OpsBackend, Precision, Reduce};

use crate::collectives::{gather_from_region, scatter_to_region};
use crate::error::ShardError;
use crate::param::{Builder, Init};
use crate::sequence::SequenceSplit;
use crate::spec::ShardSpec;

/// An all-reduce (sum) over `comm`, as a hook for the fused ops of `switchyard-ops`.
pub(crate) fn all_reduce_hook(comm: &Arc<dyn Communicator>) -> Reduce {
    let comm = comm.clone();
    Arc::new(move |t: &Tensor| Ok(comm.all_reduce(t, ReduceOp::Sum)?))
}

/// Checks that `comm` is the tensor-parallel group the builder's store was made for.
pub(crate) fn check_group(layer: &str, vb: &Builder, comm: &dyn Communicator) -> Result<()> {
    if comm.world_size() != vb.tp_size() || comm.rank() != vb.tp_rank() {
        return Err(ShardError::GroupMismatch {
            layer: layer.to_string(),
            expected: vb.tp_size(),
            expected_rank: vb.tp_rank(),
            group: switchyard_comm::describe(comm),
            got: comm.world_size(),
            got_rank: comm.rank(),
        }
        .into());
    }
    Ok(())
}

/// Options of a [`ColumnParallelLinear`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ColumnConfig {
    /// Whether the layer has a bias (split like the output). Default `true`.
    pub bias: bool,
    /// All-gather the output so every rank gets all `out` features. Default `false`.
    pub gather_output: bool,
    /// The output dim is made of this many equal fused sub-blocks (3 for GPT's qkv),
    /// each split over the ranks. Default 1.
    pub blocks: usize,
    /// Initialisation of the full `[out, in]` weight. Default `Normal { std: 0.02 }`.
    pub weight_init: Init,
    /// Initialisation of the full `[out]` bias. Default `Zeros`.
    pub bias_init: Init,
}

impl Default for ColumnConfig {
    fn default() -> Self {
        ColumnConfig {
            bias: true,
            gather_output: false,
            blocks: 1,
            weight_init: Init::Normal { std: 0.02 },
            bias_init: Init::Zeros,
        }
    }
}

/// `Y = XA + b` with `A` split along its output dim: see the module docs.
///
/// Parameters under the builder's prefix: `weight` (full `[out, in]`,
/// `Split { dim: 0, blocks }`, local `[out/p, in]`) and `bias` (full `[out]`, same split).
/// Collectives: 0 forward (1 all-gather with `gather_output`), 1 all-reduce backward
/// (when the input requires a gradient).
pub struct ColumnParallelLinear {
    name: String,
    weight: Var,
    bias: Option<Var>,
    comm: Arc<dyn Communicator>,
    in_features: usize,
    out_features: usize,
    blocks: usize,
    gather_output: bool,
    ops: OpsBackend,
    precision: Precision,
    /// [`ColumnParallelLinear::with_sequence_split`].
    seq: SequenceSplit,
}

impl ColumnParallelLinear {
    /// Creates the layer's parameters through `vb` (e.g. `vb.pp("c_fc")`) for the
    /// tensor-parallel group `comm`.
    pub fn new(
        vb: &Builder,
        comm: Arc<dyn Communicator>,
        in_features: usize,
        out_features: usize,
        cfg: ColumnConfig,
    ) -> Result<Self> {
        let name = vb.prefix().to_string();
        check_group(&name, vb, comm.as_ref())?;
        let spec = ShardSpec::fused(0, cfg.blocks);
        let weight = vb.param(
            "weight",
            &[out_features, in_features],
            spec,
            cfg.weight_init,
        )?;
        let bias = match cfg.bias {
            true => Some(vb.param("bias", &[out_features], spec, cfg.bias_init)?),
            false => None,
        };
        Ok(ColumnParallelLinear {
            name,
            weight,
            bias,
            comm,
            in_features,
            out_features,
            blocks: cfg.blocks,
            gather_output: cfg.gather_output,
            ops: vb.ops(),
            precision: vb.precision(),
            seq: SequenceSplit::off(),
        })
    }

    /// An LM head over a vocabulary of `vocab_size` ids: `weight` (full
    /// `[vocab_size, in_features]`, [`ShardSpec::Padded`] so that any group size works,
    /// local `[⌈V/p⌉, in]` whose last rows may be zero padding), no bias, no gather. Its
    /// output is this rank's `[.., ⌈V/p⌉]` slice of the logits over the padded
    /// vocabulary, for [`crate::vocab_parallel_cross_entropy`], which leaves the padding
    /// columns out (see [`crate::VocabParallelEmbedding`] for why they stay inert).
    /// [`ColumnParallelLinear::out_features`] is the padded vocabulary `⌈V/p⌉·p`.
    pub fn vocab_head(
        vb: &Builder,
        comm: Arc<dyn Communicator>,
        in_features: usize,
        vocab_size: usize,
        weight_init: Init,
    ) -> Result<Self> {
        let name = vb.prefix().to_string();
        check_group(&name, vb, comm.as_ref())?;
        let weight = vb.param(
            "weight",
            &[vocab_size, in_features],
            ShardSpec::padded(0, vocab_size),
            weight_init,
        )?;
        let seq = SequenceSplit::new(vb, comm.clone());
        Ok(
            ColumnParallelLinear::from_weight(name, weight, comm, false)?
                .with_ops(vb.ops())
                .with_precision(vb.precision())
                .with_sequence_split(seq),
        )
    }

    /// A column-parallel layer without bias over an existing local weight of shape
    /// `[out/p, in]` (split along dim 0): for an LM head tied to a
    /// [`crate::VocabParallelEmbedding`], whose weight `[V/p, d]` has exactly this layout.
    /// No parameter is created; the gradient of `weight` accumulates both uses.
    pub fn from_weight(
        name: impl Into<String>,
        weight: Var,
        comm: Arc<dyn Communicator>,
        gather_output: bool,
    ) -> Result<Self> {
        let name = name.into();
        let (local_out, in_features) = weight.dims2()?;
        Ok(ColumnParallelLinear {
            name,
            weight,
            bias: None,
            out_features: local_out * comm.world_size(),
            comm,
            in_features,
            blocks: 1,
            gather_output,
            ops: OpsBackend::Fused,
            precision: Precision::F32,
            seq: SequenceSplit::off(),
        })
    }

    /// The layer taking sequence-split input ([`SequenceSplit`]): `[B, T/p, in]`, this
    /// rank's positions, which it all-gathers before the product (whose input gradient
    /// the all-gather's backward reduce-scatters, in place of `f`'s all-reduce). For an
    /// LM head after a sequence-parallel model; [`ColumnParallelLinear::vocab_head`]
    /// takes its builder's.
    pub fn with_sequence_split(mut self, seq: SequenceSplit) -> Self {
        self.seq = seq;
        self
    }

    /// The layer computing with `ops` ([`OpsBackend`]; a layer made by
    /// [`ColumnParallelLinear::new`] takes its builder's).
    pub fn with_ops(mut self, ops: OpsBackend) -> Self {
        self.ops = ops;
        self
    }

    /// The ops backend this layer computes with.
    pub fn ops(&self) -> OpsBackend {
        self.ops
    }

    /// The layer multiplying at `precision` ([`Precision`]; a layer made by
    /// [`ColumnParallelLinear::new`] takes its builder's).
    pub fn with_precision(mut self, precision: Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The precision this layer multiplies at.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// `x` `[.., in]` (replicated) to `[.., out/p]` (this rank's slice), or `[.., out]`
    /// with `gather_output`.
    ///
    /// One fused op: the product, the bias and, over a group of several ranks, `f` (the
    /// all-reduce of the input gradient) in its backward pass. With a sequence split
    /// ([`ColumnParallelLinear::with_sequence_split`]) `x` is `[B, T/p, in]`, this rank's
    /// positions, all-gathered first (its backward reduce-scatters, in place of `f`).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_opts(x, false)
    }

    /// `gelu(forward(x))` (tanh approximation) as one fused op: the first layer of a
    /// tensor-parallel MLP. GELU is element-wise, so it applies to each rank's slice (and
    /// commutes with `gather_output`).
    pub fn forward_gelu(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_opts(x, true)
    }

    fn forward_opts(&self, x: &Tensor, gelu: bool) -> Result<Tensor> {
        let f = self.comm.world_size() > 1 && !self.seq.is_on();
        let opts = LinearOptions {
            gelu,
            reduce_output: None,
            reduce_input_grad: f.then(|| all_reduce_hook(&self.comm)),
            backend: self.ops,
            precision: self.precision,
        };
        let x = self.seq.gather(x)?;
        let y = linear_with(
            &x,
            self.weight.as_tensor(),
            self.bias.as_ref().map(|b| b.as_tensor()),
            &opts,
        )
        .map_err(|e| e.context(format!("{} (column-parallel linear)", self.name)))?;
        if !self.gather_output {
            return Ok(y);
        }
        let n = self.comm.world_size();
        let last = y.rank() - 1;
        let y = gather_from_region(&y, last, &self.comm)?;
        if self.blocks == 1 || n == 1 {
            return Ok(y);
        }
        // Gathered order is (rank, block, piece); the full output is (block, rank, piece).
        let mut dims = y.dims().to_vec();
        let piece = self.out_features / (self.blocks * n);
        dims.truncate(last);
        let lead = dims.clone();
        dims.extend([n, self.blocks, piece]);
        let y = y.reshape(dims)?.transpose(last, last + 1)?;
        let mut out = lead;
        out.push(self.out_features);
        y.reshape(out)
    }

    /// This rank's weight shard `[out/p, in]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// This rank's bias shard `[out/p]`, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The layer's name (its builder prefix).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Full input features.
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Full output features (all ranks together).
    pub fn out_features(&self) -> usize {
        self.out_features
    }

    /// The tensor-parallel group.
    pub fn comm(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }
}

impl Module for ColumnParallelLinear {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        ColumnParallelLinear::forward(self, xs)
    }
}

/// Options of a [`RowParallelLinear`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RowConfig {
    /// Whether the layer has a (replicated) bias. Default `true`.
    pub bias: bool,
    /// The input already arrives split along its last dim (from a column-parallel
    /// layer). When `false`, the full input is scattered first. Default `true`.
    pub input_is_parallel: bool,
    /// Initialisation of the full `[out, in]` weight. Default `Normal { std: 0.02 }`.
    pub weight_init: Init,
    /// Initialisation of the `[out]` bias. Default `Zeros`.
    pub bias_init: Init,
}

impl Default for RowConfig {
    fn default() -> Self {
        RowConfig {
            bias: true,
            input_is_parallel: true,
            weight_init: Init::Normal { std: 0.02 },
            bias_init: Init::Zeros,
        }
    }
}

/// `Y = Σ_i X_i·A_i + b` with `A` split along its input dim: see the module docs.
///
/// Parameters under the builder's prefix: `weight` (full `[out, in]`, `Split { dim: 1 }`,
/// local `[out, in/p]`) and `bias` (`[out]`, replicated, added after the all-reduce).
/// Collectives: 1 all-reduce forward, 0 backward (1 all-gather backward when the input is
/// scattered, `input_is_parallel = false`).
pub struct RowParallelLinear {
    name: String,
    weight: Var,
    bias: Option<Var>,
    comm: Arc<dyn Communicator>,
    in_features: usize,
    out_features: usize,
    input_is_parallel: bool,
    ops: OpsBackend,
    precision: Precision,
}

impl RowParallelLinear {
    /// Creates the layer's parameters through `vb` (e.g. `vb.pp("c_proj")`) for the
    /// tensor-parallel group `comm`.
    pub fn new(
        vb: &Builder,
        comm: Arc<dyn Communicator>,
        in_features: usize,
        out_features: usize,
        cfg: RowConfig,
    ) -> Result<Self> {
        let name = vb.prefix().to_string();
        check_group(&name, vb, comm.as_ref())?;
        let weight = vb.param(
            "weight",
            &[out_features, in_features],
            ShardSpec::split(1),
            cfg.weight_init,
        )?;
        let bias = match cfg.bias {
            true => Some(vb.param(
                "bias",
                &[out_features],
                ShardSpec::Replicated,
                cfg.bias_init,
            )?),
            false => None,
        };
        Ok(RowParallelLinear {
            name,
            weight,
            bias,
            comm,
            in_features,
            out_features,
            input_is_parallel: cfg.input_is_parallel,
            ops: vb.ops(),
            precision: vb.precision(),
        })
    }

    /// `x` `[.., in/p]` (or `[.., in]` when not `input_is_parallel`) to the full,
    /// replicated `[.., out]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = match self.input_is_parallel {
            true => x.clone(),
            false => scatter_to_region(x, x.rank().saturating_sub(1), &self.comm)?,
        };
        let opts = LinearOptions {
            gelu: false,
            reduce_output: (self.comm.world_size() > 1).then(|| all_reduce_hook(&self.comm)),
            reduce_input_grad: None,
            backend: self.ops,
            precision: self.precision,
        };
        // One fused op: the partial product, `g` (all-reduce forward, identity backward)
        // and the bias, added once after the reduction.
        linear_with(
            &x,
            self.weight.as_tensor(),
            self.bias.as_ref().map(|b| b.as_tensor()),
            &opts,
        )
        .map_err(|e| e.context(format!("{} (row-parallel linear)", self.name)))
    }

    /// This rank's weight shard `[out, in/p]`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The replicated bias `[out]`, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The layer's name (its builder prefix).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Full input features (all ranks together).
    pub fn in_features(&self) -> usize {
        self.in_features
    }

    /// Output features.
    pub fn out_features(&self) -> usize {
        self.out_features
    }
}

impl Module for RowParallelLinear {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        RowParallelLinear::forward(self, xs)
    }
}
