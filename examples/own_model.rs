//! Chapter 5, "Bring your own model" (`docs/tutorial/05-bring-your-own-model.md`).
//!
//! A language model switchyard has never seen — residual MLP blocks over a token
//! embedding, no attention, no positions — written once as single-device code, declared
//! to the trainer through the [`Model`] trait, and trained on any `dp × pp × tp` layout:
//!
//! 1. 20 steps on one device (1 × 1 × 1) and on eight threads (2 × 2 × 2), with gradient
//!    clipping, warm-up then cosine decay of the learning rate, and a checkpoint every
//!    10 steps: the two loss curves agree, and the loss goes down;
//! 2. the 2 × 2 × 2 run's checkpoint of step 10 resumed on 1 × 2 × 2: the same curve.
//!
//! `tests/own_model.rs` includes this file and checks the model on every layout and
//! schedule against one device, and against a hand-written candle loop.
//!
//! ```text
//! cargo run --release --example own_model
//! ```

use candle_core::{Result, Tensor, Var};
use serde::{Deserialize, Serialize};
use switchyard::models::{Model, ModelError, ModelStage, StagePlan, Tied};
use switchyard::shard::{
    vocab_parallel_cross_entropy, Builder, ColumnParallelLinear, Init, LayerInit, ParallelMlp,
    ParamStore, ShardSpec, TpGroup, VocabParallelEmbedding,
};
use switchyard::train::{data::Corpus, train, Resume, StepRecord, TrainConfig, TrainOptions};

/// The model's shape. To the trainer the config *is* the model: it builds the stages, and
/// checkpoints record it. In a config file every field is optional.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OwnConfig {
    pub vocab_size: usize,
    pub d_model: usize,
    /// The width inside each block, split over the tensor-parallel ranks.
    pub hidden: usize,
    pub n_layer: usize,
}

impl Default for OwnConfig {
    fn default() -> Self {
        OwnConfig {
            vocab_size: 256, // bytes
            d_model: 32,
            hidden: 128,
            n_layer: 4,
        }
    }
}

/// LayerNorm over the last dimension: a gain and a bias, replicated on every rank.
pub struct LayerNorm(Var, Var);

impl LayerNorm {
    fn new(vb: &Builder, d: usize) -> Result<LayerNorm> {
        let param = |name, init| vb.param(name, &[d], ShardSpec::Replicated, init);
        let (weight, bias) = (param("weight", Init::Ones)?, param("bias", Init::Zeros)?);
        Ok(LayerNorm(weight, bias))
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        switchyard::ops::layer_norm(x, self.0.as_tensor(), self.1.as_tensor(), 1e-5)
    }
}

/// What one pipeline stage runs on one tensor-parallel rank. Input: token ids `[B, T]`
/// on the first stage, else activations `[B, T, d]`; output: activations, or on the last
/// stage this rank's slice of the logits, `[B·T, ⌈V/tp⌉]`.
pub struct OwnStage {
    /// The token embedding (first stage only), its rows split over the ranks.
    embed: Option<VocabParallelEmbedding>,
    /// Pre-LN residual blocks, `x + proj(gelu(fc(ln(x))))`: `fc` column-parallel,
    /// `proj` row-parallel, one all-reduce each way.
    blocks: Vec<(LayerNorm, ParallelMlp)>,
    /// The final LayerNorm and the LM head (last stage only).
    head: Option<(LayerNorm, ColumnParallelLinear)>,
    /// What the loss needs: the tensor-parallel group and the vocabulary size.
    loss: (TpGroup, usize),
    params: Vec<Var>,
}

impl Model for OwnConfig {
    /// Recorded in checkpoints: resuming a GPT's is refused, naming both kinds.
    const NAME: &'static str = "own-mlp-lm";
    type Stage = OwnStage;

    /// The blocks are what a pipeline split divides; the embedding and the head ride
    /// along with the first and the last stage.
    fn layers(&self) -> usize {
        self.n_layer
    }

    /// Builds stage `plan` of one rank. The names (`wte.weight`, `blocks.3.ln.bias`, …)
    /// do not depend on the layout, so a checkpoint loads on any other; the layers split
    /// themselves over `tp` (a group of one is a single device).
    fn stage(&self, plan: &StagePlan, store: &ParamStore, tp: TpGroup) -> Result<OwnStage> {
        let (vb, first, d, v) = (store.builder(), store.len(), self.d_model, self.vocab_size);
        let std = Init::Normal { std: 0.02 };
        let wte = |vb: &Builder| VocabParallelEmbedding::new(&vb.pp("wte"), tp.clone(), v, d, std);
        let embed = plan.embed.then(|| wte(&vb)).transpose()?;
        let mut blocks = Vec::new();
        for i in plan.blocks.clone() {
            let vb = vb.pp(format!("blocks.{i}"));
            let mlp = ParallelMlp::new(&vb, tp.clone(), d, self.hidden, LayerInit::default())?;
            blocks.push((LayerNorm::new(&vb.pp("ln"), d)?, mlp));
        }
        // The LM head multiplies by the token table. `shared` hands out the table this
        // rank already holds (this stage or another of the rank embeds); on any other
        // rank it creates a copy, with the same name and initial values, and `tied`
        // below tells the trainer to keep the copies equal.
        let head = |vb: &Builder| -> Result<_> {
            let ln_f = LayerNorm::new(&vb.pp("ln_f"), d)?;
            Ok((ln_f, wte(&vb.shared())?.tied_lm_head()?))
        };
        let head = plan.head.then(|| head(&vb)).transpose()?;
        Ok(OwnStage {
            embed,
            blocks,
            head,
            loss: (tp, v),
            params: store.vars()[first..].to_vec(),
        })
    }

    /// Each tensor-parallel rank takes `hidden / tp` of every block's width. Any
    /// vocabulary works at any degree (the table is padded), and with no positions any
    /// sequence length does.
    fn check_layout(&self, tp: usize, _seq_len: usize) -> std::result::Result<(), ModelError> {
        let why =
            || ModelError::Layout(format!("--tp {tp} does not divide hidden {}", self.hidden));
        let fits = tp > 0 && self.hidden.is_multiple_of(tp);
        fits.then_some(()).ok_or_else(why)
    }

    /// The token table is used by the first and the last stage: the trainer sums the
    /// gradients of the two copies, and counts and saves the first stage's.
    fn tied(&self, num_stages: usize) -> Vec<Tied> {
        let (name, stages) = ("wte.weight".to_string(), vec![0, num_stages - 1]);
        Vec::from_iter((num_stages > 1).then_some(Tied { name, stages }))
    }

    /// Token ids must stay below the vocabulary: the trainer checks the data.
    fn vocab_size(&self) -> Option<usize> {
        Some(self.vocab_size)
    }
}

impl switchyard::pipeline::Stage for OwnStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = match &self.embed {
            Some(wte) => wte.forward(x)?,
            None => x.clone(),
        };
        for (ln, mlp) in &self.blocks {
            h = (&h + mlp.forward(&ln.forward(&h)?)?)?;
        }
        match &self.head {
            Some((ln_f, lm_head)) => lm_head.forward(&ln_f.forward(&h)?)?.flatten_to(1),
            None => Ok(h),
        }
    }

    /// The parameters this stage created (the trainer adds a tied one it shares).
    fn params(&self) -> &[Var] {
        &self.params
    }
}

impl ModelStage for OwnStage {
    /// Cross-entropy over the vocabulary slices, without gathering the logits.
    fn loss(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (tp, vocab_size) = &self.loss;
        vocab_parallel_cross_entropy(logits, &targets.flatten_all()?, *vocab_size, tp)
    }
}

/// The run `main` trains, on `dp × pp × tp` threads.
pub fn tiny(dp: usize, pp: usize, tp: usize) -> TrainConfig<OwnConfig> {
    TrainConfig::<OwnConfig> {
        dp,
        pp,
        tp,
        batch: 8, // sequences per step over all replicas: the same on every layout
        steps: 20,
        warmup: 4, // steps of linear warm-up to `lr`, then cosine decay to `min_lr`
        grad_clip: 1.0,
        ..TrainConfig::default()
    }
}

fn main() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join("switchyard-examples/own-model");
    let _ = std::fs::remove_dir_all(&dir);
    let (corpus, mut opts) = (Corpus::bundled(), TrainOptions::default());
    let one = train(&tiny(1, 1, 1), &corpus, &opts)?.steps;
    (opts.checkpoint_dir, opts.save_every) = (Some(dir), 10);
    let eight = train(&tiny(2, 2, 2), &corpus, &opts)?.steps;
    // The 2 × 2 × 2 run again from its checkpoint of step 10, on four threads.
    opts.resume = Some(Resume::Step(10));
    let resumed = train(&tiny(1, 2, 2), &corpus, &opts)?.steps;

    let close = |a: &StepRecord, b: &StepRecord| (a.loss - b.loss).abs() <= 1e-4 * b.loss;
    println!("step   1 × 1 × 1   2 × 2 × 2   resumed on 1 × 2 × 2");
    for (i, (a, b)) in one.iter().zip(&eight).enumerate() {
        let r = resumed.get(i.wrapping_sub(10));
        let shown = r.map(|r| format!("{:.6}", r.loss)).unwrap_or_default();
        println!("{i:>4}   {:>9.6}   {:>9.6}   {shown:>20}", a.loss, b.loss);
        let same = close(b, a) && r.is_none_or(|r| close(r, a));
        anyhow::ensure!(same, "the curves part at step {i}");
    }
    let down = one[19].loss < one[0].loss - 1.0;
    anyhow::ensure!(resumed.len() == 10 && down, "the loss did not go down");
    Ok(())
}
