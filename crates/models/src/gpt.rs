//! The GPT (GPT-2 / nanoGPT architecture), one pipeline stage at a time.
//!
//! The code reads as single-device code: embeddings, pre-LayerNorm blocks of causal
//! self-attention and MLP, a final LayerNorm and the LM head. Its layers come from
//! `switchyard-shard`, which decides from the tensor-parallel group's size whether a
//! linear is a plain product (size 1) or a Megatron column- or row-parallel one; the
//! model never talks to a communicator itself. [`crate::plan::GPT_TP_PLAN`] states the
//! resulting layout declaratively.
//!
//! Parameters carry the PyTorch nanoGPT state-dict names and `[out, in]` layouts, so a
//! checkpoint exported from switchyard loads in PyTorch and the other way round.

use candle_core::{DType, Module, Result, Tensor, Var};
use switchyard_shard::{
    vocab_parallel_cross_entropy_with, ColumnParallelLinear, Init, LayerInit, MoeShared,
    OpsBackend, ParamStore, SequenceSplit, ShardSpec, TpGroup, VocabParallelEmbedding,
};

use crate::block::{Block, LayerNorm};
use crate::dropout::Dropouts;
use crate::{GptConfig, ModelError, ModelStage, StagePlan};

/// LayerNorm epsilon, as GPT-2.
pub const LN_EPS: f64 = 1e-5;
/// Standard deviation of the initial weights, as GPT-2.
pub const INIT_STD: f64 = 0.02;

struct Embeddings {
    wte: VocabParallelEmbedding,
    wpe: Var,
}

struct Head {
    ln_f: LayerNorm,
    lm_head: ColumnParallelLinear,
}

/// The part of a GPT that one pipeline stage runs, on one tensor-parallel rank.
///
/// * input: token ids `[B, T]` (u32) on the first stage, else activations `[B, T, d]`;
/// * output: activations `[B, T, d]`, or on the last stage this rank's slice of the
///   logits, `[B·T, ⌈V/tp⌉]`, for [`GptStage::loss`].
///
/// Any vocabulary works at any degree: the token embedding and the LM head pad it to
/// `V_p = ⌈V/tp⌉·tp` rows (Megatron-LM's padded vocabulary; the last rank or ranks hold
/// zero padding rows), the logits of rows `≥ V` count as `−∞` in the loss, so the
/// padding never changes the loss and gets no gradient, and outside the ranks (the
/// parameters' full shapes, their initial values, checkpoints, export) the tables are
/// `[V, d]`.
pub struct GptStage {
    plan: StagePlan,
    embed: Option<Embeddings>,
    blocks: Vec<Block>,
    head: Option<Head>,
    tp: TpGroup,
    /// Sequence parallelism: the embeddings' output is split along the sequence, and the
    /// blocks and the final LayerNorm run on this rank's positions.
    seq: SequenceSplit,
    vocab_size: usize,
    ops: OpsBackend,
    /// The loss scale the executor tells the stage (for the mixtures of experts'
    /// balancing loss), and what the mixtures count ([`ModelStage::take_metrics`]).
    moe: MoeShared,
    params: Vec<Var>,
    /// The parameters of each segment (`Stage::segment_params`): the embeddings with the
    /// first block, the head with the last.
    segments: Vec<Vec<Var>>,
    /// Hidden dropout's rate and the step and microbatch its masks are drawn for,
    /// shared with the blocks.
    dropouts: Dropouts,
}

impl GptStage {
    /// Builds the stage's layers, creating their parameters in `store` (whose source
    /// decides their values: a seed, or full tensors from a checkpoint).
    ///
    /// With tied embeddings, a last stage that does not also hold the embeddings gets
    /// its own copy of `transformer.wte.weight` (same name, same initial values); the
    /// trainer sums the gradients of the two copies so they stay equal. When `store`
    /// already holds the table (another stage of this rank has the embeddings), the
    /// head uses that variable ([`switchyard_shard::Builder::shared`]).
    pub fn new(
        cfg: &GptConfig,
        plan: &StagePlan,
        store: &ParamStore,
        tp: TpGroup,
    ) -> Result<GptStage> {
        cfg.validate()?;
        let vb = store
            .builder()
            .with_ops(cfg.ops)
            .with_precision(cfg.precision);
        let first_param = store.len();
        let seq = SequenceSplit::new(&vb, tp.clone());
        let moe = MoeShared::default();
        let dropouts = Dropouts::new(cfg.hidden_dropout);
        let d = cfg.d_model;
        let init = LayerInit {
            weight: Init::Normal { std: INIT_STD },
            proj_weight: Init::Normal {
                std: INIT_STD / (2.0 * cfg.n_layer as f64).sqrt(),
            },
            bias: Init::Zeros,
        };
        let normal = Init::Normal { std: INIT_STD };
        let wte = |vb: &switchyard_shard::Builder| {
            VocabParallelEmbedding::new(
                &vb.pp("transformer.wte"),
                tp.clone(),
                cfg.vocab_size,
                d,
                normal,
            )
        };
        let embed_from = store.len();
        let embed = match plan.embed {
            true => Some(Embeddings {
                wte: wte(&vb)?,
                wpe: vb.pp("transformer.wpe").param(
                    "weight",
                    &[cfg.block_size, d],
                    ShardSpec::Replicated,
                    normal,
                )?,
            }),
            false => None,
        };
        let embed_vars = store.vars()[embed_from..].to_vec();
        let mut block_vars = Vec::new();
        let shared = || crate::block::Shared {
            moe: &moe,
            dropouts: &dropouts,
        };
        let blocks = plan
            .blocks
            .clone()
            .map(|i| {
                let vb = vb.pp(format!("transformer.h.{i}"));
                let from = store.len();
                let block = Block::new(cfg, i, &vb, &tp, &seq, init, shared())?;
                block_vars.push(store.vars()[from..].to_vec());
                Ok(block)
            })
            .collect::<Result<Vec<_>>>()?;
        let head_from = store.len();
        let head = match plan.head {
            false => None,
            true => {
                let ln_f = LayerNorm::new(&vb.pp("transformer.ln_f"), d, &seq)?;
                let lm_head = match (cfg.tied_embeddings, &embed) {
                    (true, Some(e)) => e
                        .wte
                        .tied_lm_head()?
                        .with_ops(cfg.ops)
                        .with_precision(cfg.precision),
                    // The table lives on this rank under another stage (shared), or
                    // this stage gets its own copy.
                    (true, None) => wte(&vb.shared())?
                        .tied_lm_head()?
                        .with_ops(cfg.ops)
                        .with_precision(cfg.precision),
                    (false, _) => ColumnParallelLinear::vocab_head(
                        &vb.pp("lm_head"),
                        tp.clone(),
                        d,
                        cfg.vocab_size,
                        normal,
                    )?,
                };
                Some(Head { ln_f, lm_head })
            }
        };
        let params = store.vars()[first_param..].to_vec();
        let mut head_vars = store.vars()[head_from..].to_vec();
        if let Some(h) = &head {
            // A tied head uses the table, created with the embeddings or by another stage.
            let w = h.lm_head.weight();
            if !head_vars.iter().any(|v| v.id() == w.id()) {
                head_vars.push(w.clone());
            }
        }
        let n = blocks.len().max(1);
        let mut segments: Vec<Vec<Var>> = (0..n)
            .map(|i| block_vars.get(i).cloned().unwrap_or_default())
            .collect();
        segments[0].splice(0..0, embed_vars);
        segments[n - 1].extend(head_vars);
        Ok(GptStage {
            plan: plan.clone(),
            embed,
            blocks,
            head,
            tp,
            seq,
            vocab_size: cfg.vocab_size,
            ops: cfg.ops,
            moe,
            params,
            segments,
            dropouts,
        })
    }

    pub fn plan(&self) -> &StagePlan {
        &self.plan
    }

    /// The parameters this stage created, in creation order.
    pub fn params(&self) -> &[Var] {
        &self.params
    }

    /// Fuses each block's weights with their biases once for the step's microbatches
    /// (see `ParallelMlp::begin_step`); [`GptStage::end_step`] drops them.
    pub fn begin_step(&self) -> Result<()> {
        self.blocks.iter().try_for_each(|b| b.begin_step())
    }

    /// Drops what [`GptStage::begin_step`] fused: call it before the parameters change.
    pub fn end_step(&self) {
        self.seq.end_step();
        self.blocks.iter().for_each(|b| b.end_step());
    }

    /// The mean cross-entropy of this stage's logits slice against `targets` (`[B, T]`
    /// u32), computed without gathering the vocabulary on one rank.
    pub fn loss(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        vocab_parallel_cross_entropy_with(
            logits,
            &targets.flatten_all()?,
            self.vocab_size,
            &self.tp,
            self.ops,
        )
    }
}

impl switchyard_pipeline::Stage for GptStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Module::forward(self, x)
    }
    /// One segment per block (the embeddings go with the first, the head with the last).
    fn num_segments(&self) -> usize {
        self.blocks.len().max(1)
    }
    fn forward_segment(&self, i: usize, x: &Tensor) -> Result<Tensor> {
        let n = self.blocks.len().max(1);
        if i >= n {
            candle_core::bail!("a GPT stage of {n} segments has no segment {i}");
        }
        let mut h = match i {
            0 => self.embed(x)?,
            _ => x.clone(),
        };
        if let Some(b) = self.blocks.get(i) {
            h = b.forward(&h)?;
        }
        match i + 1 == n {
            true => self.head(h),
            false => Ok(h),
        }
    }
    fn params(&self) -> &[Var] {
        &self.params
    }
    fn begin_step(&self) -> Result<()> {
        GptStage::begin_step(self)
    }
    fn end_step(&self) {
        GptStage::end_step(self)
    }
    /// The mixtures of experts scale their balancing loss's gradient by it.
    fn set_loss_scale(&self, scale: f64) {
        self.moe.loss_scale.set(scale)
    }
    fn recomputing(&self, on: bool) {
        self.moe.stats.set_recomputing(on)
    }
    fn segment_params(&self, i: usize) -> Vec<Var> {
        self.segments.get(i).cloned().unwrap_or_default()
    }
    /// Fuses segment `i`'s block weights (in place, after the first time in a step).
    fn begin_segment(&self, i: usize) -> Result<()> {
        match self.blocks.get(i) {
            Some(b) => b.begin_step(),
            None => Ok(()),
        }
    }
    fn release_segment(&self, i: usize) -> Result<()> {
        match self.blocks.get(i) {
            Some(b) => b.release_step(),
            None => Ok(()),
        }
    }
    /// A split backward defers the blocks' weight products (the attention's and the
    /// MLP's four each) to [`GptStage`]'s `backward_weights`; the embeddings' and the
    /// head's weight gradients come with the input gradients.
    fn split_backward(&self, split: bool) {
        self.blocks.iter().for_each(|b| b.set_split_backward(split));
    }
    /// Hidden dropout's masks depend on the microbatch's rows in the batch.
    fn microbatch(&self, microbatch: u32) {
        self.dropouts.set_microbatch(microbatch)
    }
    fn backward_weights(&self, _microbatch: u32) -> Result<Vec<(Var, Tensor)>> {
        let mut grads = Vec::new();
        for b in &self.blocks {
            grads.extend(b.backward_weights()?);
        }
        Ok(grads)
    }
}

impl ModelStage for GptStage {
    fn loss(&self, out: &Tensor, target: &Tensor) -> Result<Tensor> {
        GptStage::loss(self, out, target)
    }
    /// The mixtures of experts' routing ([`switchyard_shard::MoeStats`]).
    fn take_metrics(&self) -> Vec<(String, f64)> {
        self.moe.stats.take()
    }
    fn set_dropout_step(&self, step: Option<crate::DropoutStep>) {
        self.dropouts.set_step(step)
    }
}

impl GptStage {
    /// The embeddings of token ids on the first stage; the identity elsewhere.
    fn embed(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match &self.embed {
            Some(e) => {
                if x.dtype() != DType::U32 || x.rank() != 2 {
                    return Err(ModelError::Input(format!(
                        "the first GPT stage takes token ids [B, T] as u32, got {:?} {:?}",
                        x.dims(),
                        x.dtype()
                    ))
                    .into());
                }
                let t = x.dim(1)?;
                let tok = e.wte.forward(x)?;
                let pos = e.wpe.as_tensor().narrow(0, 0, t)?;
                // Sequence parallelism: this rank's positions from here to the LM head.
                let h = self.seq.split(&tok.broadcast_add(&pos)?)?;
                self.embedding_dropout(h)?
            }
            None => x.clone(),
        })
    }

    /// Hidden dropout on the embeddings' output `h` (site 0). Where the fused op runs,
    /// its backward reads no values (nor do those of the sum and the split that made
    /// `h`), so `h` is freed in place: dropout keeps no more than the embeddings alone.
    fn embedding_dropout(&self, h: Tensor) -> Result<Tensor> {
        let Some(mask) = self
            .dropouts
            .mask(0, &h, self.seq.first_position(h.dim(1)?))?
        else {
            return Ok(h);
        };
        let y = switchyard_ops::dropout(&h, &mask, self.ops)?;
        if self.ops.fuses(&h) && switchyard_shard::storage::can_free_in_place(&h) {
            switchyard_shard::storage::free_in_place(&h)?;
        }
        Ok(y)
    }

    /// The logits slice on the last stage; the identity elsewhere.
    fn head(&self, h: Tensor) -> Result<Tensor> {
        match &self.head {
            Some(head) => {
                let h = head.ln_f.forward(&h)?;
                let logits = head.lm_head.forward(&h)?;
                let v = logits.dim(candle_core::D::Minus1)?;
                logits.reshape(((), v))
            }
            None => Ok(h),
        }
    }
}

impl Module for GptStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.embed(x)?;
        for b in &self.blocks {
            h = b.forward(&h)?;
        }
        self.head(h)
    }
}
