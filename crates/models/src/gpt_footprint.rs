//! The GPT's memory footprint, for the estimator (`Model::footprint` of [`GptConfig`]).
//!
//! Arithmetic, for any size. With `d` the width, `h` the heads, `V_p = ⌈V/tp⌉` the
//! vocabulary rows of a rank, per token of a microbatch a block saves
//!
//! * `12·d/tp`: what the column-parallel halves produce (q, k, v, the attention's
//!   output, the MLP's hidden activation before and after the GELU);
//! * `6·d`: what every rank holds whole (the two LayerNorms' outputs, the two
//!   row-parallel outputs, the two residual sums); at bf16 `2·d + 2·d/2`: the block
//!   frees the four tensors but the residual sums in place once read, the pairs keeping
//!   their inputs (the LayerNorms' outputs) as bf16 themselves;
//! * `h/tp`: the attention's log-sum-exp per head (no `T × T` scores: the fused
//!   attention recomputes them);
//!
//! the embeddings save `2·d` (`3·d` when the table is split: the partial rows and
//! their sum), the head `d + V_p` (`2·d + V_p` when split). A block's weights are
//! packed for the fused kernels once per step (`12·d²/tp`). These are the fused ops'
//! figures. The composed ops keep every intermediate candle creates: per token a
//! block keeps `16·d + 56·d/tp + 6·T·h/tp` (the LayerNorms' five `d`-wide steps
//! each, the GELU's nine `4·d/tp`-wide ones, six `T × T` score tensors per head;
//! `4·d` more for the collectives' hooks when split) and one `T × T` mask per
//! microbatch; the head keeps the logits, shifted and exponentiated. With hidden
//! dropout the composed path keeps each site's mask and masked branch, `2·d` a site
//! (the fused op keeps nothing). Measured against
//! `switchyard-mem` in `switchyard-train`'s `tests/estimate.rs`.
//!
//! Under sequence parallelism (fused ops) what every rank held whole is this rank's
//! positions, `/tp`: a block saves `6·d/tp` (the LayerNorms' outputs, which the pairs
//! gather again in the backward, the biased sub-layer outputs and the residual sums; at
//! bf16 `4·d/tp`: the sub-layer outputs are freed, the LayerNorms' outputs stay f32), a stage
//! receives `d/tp`, the embeddings save `d/tp` more (the split) and the head keeps
//! the gathered `d` beside the LayerNorm's `d/tp`. The backward holds `5·d` more a
//! token of one microbatch: whole-sequence gradients and the input gathered again
//! (fitted), and the pairs' fused weights leave the row-parallel bias out (the step's
//! packed weights are `7·d²/tp`: `c_proj`'s are the weights themselves).

use switchyard_shard::OpsBackend;

use crate::gpt_model::WTE;
use crate::{Activations, Footprint, GptConfig, ModelError, StagePlan};

/// What stage `plan` of `cfg` holds and saves on one rank of a tensor-parallel group of
/// `tp`, for sequences of `seq_len` tokens.
pub(crate) fn footprint(
    cfg: &GptConfig,
    plan: &StagePlan,
    tp: usize,
    seq_len: usize,
    sequence_parallel: bool,
) -> Result<Footprint, ModelError> {
    GptConfig::validate(cfg)?;
    let (d, layers) = (cfg.d_model, plan.blocks.len());
    let tp = tp.max(1);
    let rows = cfg.vocab_size.div_ceil(tp);
    let mut f = Footprint::default();
    if plan.embed {
        f.add_param(rows * d);
        f.add_param(cfg.block_size * d);
        if cfg.tied_embeddings && !plan.head {
            f.tied.push((WTE.into(), rows * d));
        }
    }
    let mut block = 0;
    let experts = cfg.moe.experts;
    let moe_layers = plan
        .blocks
        .clone()
        .filter(|&i| cfg.moe.is_moe_layer(i))
        .count();
    // The block with the most parameters without its experts (which `--ep` keeps
    // resident, out of the segments' buckets).
    let mut block_dense = 0;
    for i in plan.blocks.clone() {
        let mut this = 0;
        let attn = [d, d, 3 * d * d / tp, 3 * d / tp, d * d / tp, d, d, d];
        let mlp = [4 * d * d / tp, 4 * d / tp, 4 * d * d / tp, d];
        let hid = cfg.moe.hidden(d);
        let expert = [hid * d / tp, hid / tp, hid * d / tp, d];
        let mut add = |elems: usize| {
            f.add_param(elems);
            this += elems;
        };
        attn.into_iter().for_each(&mut add);
        match cfg.moe.is_moe_layer(i) {
            false => mlp.into_iter().for_each(&mut add),
            true => {
                add(experts * d);
                (0..experts).for_each(|_| expert.into_iter().for_each(&mut add));
                let n: usize = expert.iter().sum();
                f.experts += experts * n;
                f.expert_tensors += experts * expert.len();
                block_dense = block_dense.max(this - experts * n);
            }
        }
        if !cfg.moe.is_moe_layer(i) {
            block_dense = block_dense.max(this);
        }
        block = block.max(this);
    }
    // The segments: a block each, the embeddings with the first, the head with the
    // last; a table tied to a head on the same stage is used by both ends.
    let tied_here = cfg.tied_embeddings && plan.embed && plan.head;
    let table = |own: bool| {
        if own && !cfg.tied_embeddings {
            rows * d
        } else {
            0
        }
    };
    let embed_seg = match plan.embed {
        true => cfg.block_size * d + table(true),
        false => 0,
    };
    let head_seg = match plan.head {
        true => 2 * d + table(true),
        false => 0,
    };
    f.shared = if tied_here { rows * d } else { 0 };
    let segment = |block: usize| match layers {
        0 | 1 => block + embed_seg + head_seg,
        _ => block + embed_seg.max(head_seg),
    };
    f.largest_segment = segment(block);
    f.largest_segment_without_experts = segment(block_dense);
    if plan.head {
        f.add_param(d);
        f.add_param(d);
        if !cfg.tied_embeddings || !plan.embed {
            f.add_param(rows * d);
        }
        if cfg.tied_embeddings && !plan.embed {
            f.tied.push((WTE.into(), rows * d));
        }
    }
    // `[w | b]` copies; under sequence parallelism `c_proj` has no bias column and is
    // used as it is.
    let seq_fused = sequence_parallel && tp > 1 && cfg.ops == OpsBackend::Fused;
    // A mixture's experts pack theirs as the dense MLP does (`2·h·d/tp` each).
    f.expert_cache = moe_layers * experts * 2 * cfg.moe.hidden(d) * d / tp;
    f.step_cache = (layers - moe_layers) * if seq_fused { 7 } else { 12 } * d * d / tp
        + moe_layers * 4 * d * d / tp
        + f.expert_cache;
    let split = tp > 1;
    let rows = rows as f64;
    let (d, l, h) = (d as f64, layers as f64, (cfg.n_head / tp) as f64);
    let a = tp as f64;
    // What the fused pairs keep for their backward (q | k | v, the attention's output,
    // the MLP's pre-activation and GELU output, their inputs) is bf16 at bf16
    // precision: half an f32 element each. The residual sums stay f32.
    let kept = cfg.precision.saved_bytes() as f64 / 4.0;
    // Sequence parallelism divides the replicated parts (fused ops; the composed twin
    // keeps the gathered inputs).
    let seq = sequence_parallel && split && cfg.ops == OpsBackend::Fused;
    let (block, per_microbatch, block_tensors, ln_f) = match cfg.ops {
        // Sequence parallelism: the LayerNorms' outputs and the residual sums of this
        // rank's positions, and the biased sub-layer outputs but at bf16 (freed).
        OpsBackend::Fused if seq => {
            let whole = if kept < 1.0 { 4.0 } else { 6.0 };
            (12.0 * d / a * kept + whole * d / a + h, 0, 32, d / a + d)
        }
        // At bf16 the block frees the LayerNorms' outputs (the pairs keep them as bf16)
        // and the pairs' outputs (the residual adds need no values): the two residual
        // sums stay f32.
        OpsBackend::Fused if kept < 1.0 => {
            (12.0 * d / a * kept + 2.0 * d + 2.0 * d * kept + h, 0, 32, d)
        }
        OpsBackend::Fused => (12.0 * d / a * kept + 6.0 * d + h, 0, 32, d),
        // Candle keeps every intermediate of the composed ops (see the doc above).
        OpsBackend::Composed => {
            let t = seq_len as f64;
            let hooks = if split { 4.0 * d } else { 0.0 };
            let block = 16.0 * d + 56.0 * d / a + 6.0 * h * t + 2.0 * h + 10.0 + hooks;
            (block, seq_len * seq_len, 60, 5.0 * d + 5.0)
        }
    };
    // Hidden dropout: the fused op keeps nothing; the composed path multiplies a mask
    // tensor in, and candle keeps the mask and the masked branch, `2·d` a site (the
    // embeddings' output and a block's two branches).
    let dropout_site = match (cfg.ops, cfg.hidden_dropout > 0.0) {
        (OpsBackend::Composed, true) => 2.0 * if sequence_parallel && split { d / a } else { d },
        _ => 0.0,
    };
    let block = block + 2.0 * dropout_site;
    let embed = dropout_site * plan.embed as usize as f64
        + match (plan.embed, split) {
            (false, _) => 0.0,
            (true, false) => 2.0 * d,
            (true, true) => 3.0 * d + if seq { d / a } else { 0.0 },
        };
    let head = match plan.head {
        false => 0.0,
        true => {
            ln_f + if split { d } else { 0.0 }
                + match cfg.ops {
                    OpsBackend::Fused => rows,
                    // The logits, shifted and exponentiated, and a few values per row.
                    OpsBackend::Composed => 3.0 * rows + 8.0,
                }
        }
    };
    // A mixture of experts instead of the dense MLP, per token: each of its `k`
    // choices saves what the dense MLP saves for a token (the expert's hidden
    // activation before and after the GELU, `2·h/tp`), and `4·d` around it (the
    // gathered input, the expert's output, the gated output and their concatenation);
    // the scatter-add's zeros and result and the balancing loss's copy are `2·d` more
    // than the dense MLP's output, and the router `12` values per expert (its logits,
    // probabilities and the masks and gates derived from them). Within 4 % of the
    // measurement in `tests/estimate.rs`. Expert parallelism is the estimator's: it
    // divides `experts`, `expert_tensors` and `expert_cache` by `ep`.
    let (k, hid) = (cfg.moe.top_k as f64, cfg.moe.hidden(cfg.d_model) as f64);
    let moe_block =
        k * (2.0 * hid / a * kept + 4.0 * d) + 2.0 * d + 12.0 * experts as f64 - 8.0 * d / a * kept;
    let moe_all = moe_layers as f64 * moe_block;
    let moe_one = if moe_layers > 0 { moe_block } else { 0.0 };
    let mut tensors = block_tensors * layers + moe_layers * (12 * experts + 20);
    tensors += 4 * plan.embed as usize + 8 * plan.head as usize;
    // One segment per block, the embeddings in the first and the head in the last.
    let segment = match layers {
        0 | 1 => block * l + moe_all + embed + head,
        _ => block + moe_one + embed.max(head),
    };
    f.activations = Some(Activations {
        per_token: l * block + moe_all + embed + head,
        per_microbatch: layers * per_microbatch,
        tensors,
        backward_per_token: match cfg.ops {
            // At bf16 the attention's backward widens its kept q | k | v and output back
            // to f32 first (4·d/tp elements a token, freed with the op's backward); the
            // MLP's reads its kept bf16 values as they are.
            OpsBackend::Fused => {
                5.0 * d
                    + if plan.head { rows } else { 0.0 }
                    + if kept < 1.0 { 4.0 * d / a } else { 0.0 }
                    // Sequence parallelism: a sub-layer's gathered output gradient, its
                    // input gathered again and its whole input gradient before the
                    // reduce-scatter, the reduce-scatter input that waits to be freed
                    // (fitted to `tests/estimate.rs`: 5·d at tp 2 and at tp 4).
                    + if seq { 5.0 * d } else { 0.0 }
            }
            // Candle's backward holds each node's gradient until it is used, with
            // temporaries of the chain rule: fitted to measurements (`tests/estimate.rs`).
            OpsBackend::Composed => {
                let t = seq_len as f64;
                (32.0 * d + 4.0 * d * l) / a
                    + 2.0 * h * t
                    + if plan.head { 5.0 * rows } else { 0.0 }
            }
        },
        // The fused MLP's GELU output (the composed twin keeps everything).
        selective_per_token: match cfg.ops {
            OpsBackend::Fused => l * 4.0 * d / a * kept,
            OpsBackend::Composed => 0.0,
        },
        segments: layers.max(1),
        segment_input_per_token: if seq { d / a } else { d },
        segment_per_token: segment,
        // The MLP's first product, or the head's.
        largest_product: (4 * cfg.d_model / tp * cfg.d_model * (layers > 0) as usize)
            .max(cfg.d_model * cfg.vocab_size.div_ceil(tp) * plan.head as usize),
        fused_products: cfg.ops == OpsBackend::Fused,
        bf16_products: cfg.ops == OpsBackend::Fused && kept < 1.0,
        // The fused attention's backward: the scores and their gradients of one head
        // (`T × T` each), the row sums and `kᵀ`, `vᵀ` (`switchyard_ops::attention`).
        backward_scratch_per_thread: match (cfg.ops, layers) {
            (OpsBackend::Fused, 1..) => {
                let hd = cfg.d_model / cfg.n_head;
                2 * seq_len * seq_len + seq_len + 2 * hd * seq_len
            }
            _ => 0,
        },
        input_per_token: match (plan.embed, seq) {
            (true, _) => 0.0,
            (false, true) => d / a,
            (false, false) => d,
        },
        // A split backward's copies for `W`, per block: each pair's output gradient and
        // input (`d` each) and its middle's input gradient and output (`3·d/tp` and
        // `d/tp` for the attention, `4·d/tp` each for the MLP); bf16 at bf16.
        deferred_per_token: match cfg.ops {
            OpsBackend::Fused => l * (4.0 * d + 12.0 * d / a) * kept,
            OpsBackend::Composed => 0.0,
        },
    });
    Ok(f)
}
