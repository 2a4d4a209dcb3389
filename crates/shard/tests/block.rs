//! A full pre-LN transformer block, and a one-block GPT with a vocab-parallel LM head
//! (tied or not) and loss: parity with the single-device model at tp = 1, 2, 4, also
//! over a vocabulary the degree does not divide (padded), the exact collective count, and
//! a non-zero gradient for every parameter.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor, Var};
use common::*;
use switchyard_comm::{local, Communicator, Counting};
use switchyard_ops::layer_norm;
use switchyard_shard::{
    vocab_parallel_cross_entropy, Builder, ColumnParallelLinear, Init, LayerInit, OpsBackend,
    ParallelMlp, ParallelSelfAttention, ParamSource, ParamStore, Precision, SequenceSplit,
    ShardSpec, VocabParallelEmbedding,
};

const D: usize = 32;
const HEADS: usize = 4;
const B: usize = 2;
const T: usize = 8;
const VOCAB: usize = 32;
const LN_W: Init = Init::Normal { std: 1.0 };
const LN_B: Init = Init::Normal { std: 0.1 };

fn init() -> LayerInit {
    LayerInit {
        weight: Init::Normal { std: 0.3 },
        proj_weight: Init::Normal { std: 0.2 },
        bias: Init::Normal { std: 0.1 },
    }
}

struct Block {
    ln_1: (Var, Var),
    attn: ParallelSelfAttention,
    ln_2: (Var, Var),
    mlp: ParallelMlp,
    /// The builder's sequence split: the block takes the whole `[B, T, D]`, splits it
    /// and returns this rank's positions.
    seq: SequenceSplit,
}

fn ln_params(vb: &Builder) -> Result<(Var, Var)> {
    Ok((
        vb.param("weight", &[D], ShardSpec::Replicated, LN_W)?,
        vb.param("bias", &[D], ShardSpec::Replicated, LN_B)?,
    ))
}

impl Block {
    fn new(vb: &Builder, comm: &Arc<dyn Communicator>) -> Result<Self> {
        Ok(Block {
            ln_1: ln_params(&vb.pp("ln_1"))?,
            attn: ParallelSelfAttention::new(vb, comm.clone(), D, HEADS, init())?,
            ln_2: ln_params(&vb.pp("ln_2"))?,
            mlp: ParallelMlp::new(vb, comm.clone(), D, 4 * D, init())?,
            seq: SequenceSplit::new(vb, comm.clone()),
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let seq = &self.seq;
        let ln = |x: &Tensor, p: &(Var, Var)| {
            layer_norm(
                x,
                &seq.param(p.0.as_tensor())?,
                &seq.param(p.1.as_tensor())?,
                1e-5,
            )
        };
        let x = seq.split(x)?;
        let h = (&x + self.attn.forward(&ln(&x, &self.ln_1)?)?)?;
        &h + self.mlp.forward(&ln(&h, &self.ln_2)?)?
    }
}

/// The same block on full weights, in plain candle ops.
fn ref_block(p: &mut RefParams, prefix: &str, x: &Tensor) -> Tensor {
    let mut w = |n: &str, shape: &[usize], init: Init| p.p(&format!("{prefix}.{n}"), shape, init);
    let (l1w, l1b) = (w("ln_1.weight", &[D], LN_W), w("ln_1.bias", &[D], LN_B));
    let i = init();
    let wa = w("attn.c_attn.weight", &[3 * D, D], i.weight);
    let ba = w("attn.c_attn.bias", &[3 * D], i.bias);
    let wp = w("attn.c_proj.weight", &[D, D], i.proj_weight);
    let bp = w("attn.c_proj.bias", &[D], i.bias);
    let (l2w, l2b) = (w("ln_2.weight", &[D], LN_W), w("ln_2.bias", &[D], LN_B));
    let w1 = w("mlp.c_fc.weight", &[4 * D, D], i.weight);
    let b1 = w("mlp.c_fc.bias", &[4 * D], i.bias);
    let w2 = w("mlp.c_proj.weight", &[D, 4 * D], i.proj_weight);
    let b2 = w("mlp.c_proj.bias", &[D], i.bias);
    let a = ref_attention(&ref_layer_norm(x, &l1w, &l1b), &wa, &ba, &wp, &bp, HEADS);
    let h = (x + a).unwrap();
    let m = ref_linear(
        &ref_gelu(&ref_linear(&ref_layer_norm(&h, &l2w, &l2b), &w1, Some(&b1))),
        &w2,
        Some(&b2),
    );
    (h + m).unwrap()
}

#[test]
fn transformer_block_matches_single_device() {
    for dtype in DTYPES {
        let x_full = rand_tensor(1, &[B, T, D], 1.0, dtype);
        let r = rand_tensor(2, &[B, T, D], 1.0, dtype);
        let mut p = RefParams::new(dtype);
        let x = var(&x_full);
        let y = ref_block(&mut p, "transformer.h.0", x.as_tensor());
        let reference = reference(&p, y, Some(&x), &r);
        for tp in TPS {
            let ranks = run_parallel(tp, dtype, ShardSpec::Replicated, &r, |comm, store| {
                let block = Block::new(&store.builder().pp("transformer.h.0"), comm)?;
                let x = var(&x_full);
                Ok((block.forward(x.as_tensor())?, Some(x)))
            });
            check_parity(
                "block",
                dtype,
                &ranks,
                ShardSpec::Replicated,
                &reference,
                ShardSpec::Replicated,
            );
        }
    }
}

#[test]
fn a_block_costs_two_all_reduces_forward_and_two_backward() {
    for tp in TPS {
        let x_full = rand_tensor(3, &[B, T, D], 1.0, DType::F32);
        let counts = run_tp(tp, |comm| {
            let (comm, counts) = Counting::wrap(comm);
            let store = store(&comm, DType::F32);
            let block = Block::new(&store.builder().pp("transformer.h.0"), &comm)?;
            counts.reset();
            let y = block.forward(&x_full)?; // the input needs no gradient: the LN params do
            let fwd = counts.snapshot();
            counts.reset();
            let loss = y.sqr()?.sum_all()?;
            loss.backward()?;
            Ok((fwd, counts.snapshot()))
        });
        for (rank, (fwd, bwd)) in counts.iter().enumerate() {
            let want: Vec<(&str, usize)> = if tp == 1 {
                vec![]
            } else {
                vec![("all_reduce", 2)]
            };
            assert_eq!(
                fwd.clone().into_iter().collect::<Vec<_>>(),
                want,
                "forward tp={tp} rank={rank}"
            );
            assert_eq!(
                bwd.clone().into_iter().collect::<Vec<_>>(),
                want,
                "backward tp={tp} rank={rank}"
            );
        }
    }
}

/// Sequence parallelism: the block on this rank's positions (its output split along the
/// sequence) gives the single-device output, input gradient and parameter gradients (the
/// replicated ones complete and equal on every rank), with the fused ops (which gather
/// their freed input again in the backward) and the composed ones.
#[test]
fn a_sequence_parallel_block_matches_single_device() {
    for dtype in DTYPES {
        let x_full = rand_tensor(6, &[B, T, D], 1.0, dtype);
        let r = rand_tensor(7, &[B, T, D], 1.0, dtype);
        let mut p = RefParams::new(dtype);
        let x = var(&x_full);
        let y = ref_block(&mut p, "transformer.h.0", x.as_tensor());
        let reference = reference(&p, y, Some(&x), &r);
        for ops in OpsBackend::ALL {
            for tp in TPS {
                let out = ShardSpec::split(1);
                let ranks = run_parallel(tp, dtype, out, &r, |comm, store| {
                    store.set_sequence_parallel(true);
                    let vb = store.builder().with_ops(ops).pp("transformer.h.0");
                    let block = Block::new(&vb, comm)?;
                    assert_eq!(block.seq.is_on(), tp > 1);
                    let x = var(&x_full);
                    Ok((block.forward(x.as_tensor())?, Some(x)))
                });
                let case = format!("sequence-parallel block, {ops}");
                check_parity(&case, dtype, &ranks, out, &reference, ShardSpec::Replicated);
            }
        }
    }
}

/// Under sequence parallelism a block's collectives: forward 2 all-gathers and 2
/// reduce-scatters; backward their conjugates, the 2 inputs gathered again, and one
/// all-reduce per replicated parameter (4 LayerNorm, 2 bias).
#[test]
fn a_sequence_parallel_block_costs_its_all_gathers_and_reduce_scatters() {
    let x_full = rand_tensor(8, &[B, T, D], 1.0, DType::F32);
    let counts = run_tp(2, |comm| {
        let (comm, counts) = Counting::wrap(comm);
        let store = store(&comm, DType::F32);
        store.set_sequence_parallel(true);
        let block = Block::new(&store.builder().pp("transformer.h.0"), &comm)?;
        let x = var(&x_full);
        counts.reset();
        let y = block.forward(x.as_tensor())?;
        let fwd = counts.snapshot();
        counts.reset();
        y.sqr()?.sum_all()?.backward()?;
        Ok((fwd, counts.snapshot()))
    });
    for (rank, (fwd, bwd)) in counts.iter().enumerate() {
        let fwd: Vec<_> = fwd.clone().into_iter().collect();
        let bwd: Vec<_> = bwd.clone().into_iter().collect();
        let want_fwd = vec![("all_gather", 2), ("reduce_scatter", 2)];
        let want_bwd = vec![("all_gather", 5), ("all_reduce", 6), ("reduce_scatter", 2)];
        assert_eq!(fwd, want_fwd, "forward rank {rank}");
        // The split's backward (an all-gather of the input gradient) comes on top.
        assert_eq!(bwd, want_bwd, "backward rank {rank}");
    }
}

/// An input that tracks no gradient (inference), and bf16 activations at bf16
/// precision, run under sequence parallelism and give this rank's positions of the
/// output without it.
#[test]
fn a_sequence_parallel_block_takes_untracked_and_bf16_inputs() {
    for (dtype, precision, tol) in [
        (DType::F32, Precision::F32, 1e-5),
        (DType::BF16, Precision::Bf16, 2e-2),
    ] {
        let x_full = rand_tensor(9, &[B, T, D], 1.0, DType::F32)
            .to_dtype(dtype)
            .unwrap();
        let outs = run_tp(2, |comm| {
            let mut ys = Vec::new();
            for sp in [false, true] {
                let store = store(&comm, DType::F32);
                store.set_sequence_parallel(sp);
                let vb = store
                    .builder()
                    .with_precision(precision)
                    .pp("transformer.h.0");
                let block = Block::new(&vb, &comm)?;
                ys.push(block.forward(&x_full)?.to_dtype(DType::F32)?);
            }
            Ok(ys)
        });
        for (rank, ys) in outs.iter().enumerate() {
            let whole = ys[0].narrow(1, rank * T / 2, T / 2).unwrap();
            let e = (&ys[1] - &whole).unwrap().abs().unwrap().max_all().unwrap();
            let m = whole.abs().unwrap().max_all().unwrap();
            let e = e.to_scalar::<f32>().unwrap() / m.to_scalar::<f32>().unwrap();
            assert!(e <= tol, "{dtype:?} rank {rank}: relative error {e:.2e}");
        }
    }
}

#[test]
fn every_parameter_of_a_block_gets_a_nonzero_gradient() {
    let x_full = rand_tensor(4, &[B, T, D], 1.0, DType::F32);
    let r = rand_tensor(5, &[B, T, D], 1.0, DType::F32);
    let ranks = run_parallel(2, DType::F32, ShardSpec::Replicated, &r, |comm, store| {
        let block = Block::new(&store.builder().pp("transformer.h.0"), comm)?;
        let x = var(&x_full);
        Ok((block.forward(x.as_tensor())?, Some(x)))
    });
    for (rank, out) in ranks.iter().enumerate() {
        assert_eq!(out.grads.len(), 12, "a block has 12 parameters");
        for (name, (_, g)) in &out.grads {
            let m = g
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(m > 0.0, "rank {rank}: zero gradient for {name}");
        }
        let dx = out.dx.as_ref().unwrap().abs().unwrap().max_all().unwrap();
        assert!(
            dx.to_scalar::<f32>().unwrap() > 0.0,
            "rank {rank}: zero input gradient"
        );
    }
}

/// A one-block GPT: token (vocab-parallel) + position (replicated) embeddings, a block,
/// the final LayerNorm, an LM head (tied to the token embedding, or its own padded
/// `lm_head.weight`), and the vocab-parallel loss. Returns the loss.
fn tiny_gpt(
    comm: &Arc<dyn Communicator>,
    vb: &Builder,
    vocab: usize,
    tied: bool,
    ids: &Tensor,
    targets: &Tensor,
) -> Result<Tensor> {
    let wte = VocabParallelEmbedding::new(
        &vb.pp("transformer.wte"),
        comm.clone(),
        vocab,
        D,
        Init::Normal { std: 0.5 },
    )?;
    let wpe = vb.param(
        "transformer.wpe.weight",
        &[T, D],
        ShardSpec::Replicated,
        Init::Normal { std: 0.5 },
    )?;
    let block = Block::new(&vb.pp("transformer.h.0"), comm)?;
    let ln_f = ln_params(&vb.pp("transformer.ln_f"))?;
    let head = match tied {
        true => wte.tied_lm_head()?,
        false => ColumnParallelLinear::vocab_head(
            &vb.pp("lm_head"),
            comm.clone(),
            D,
            vocab,
            Init::Normal { std: 0.5 },
        )?,
    };
    let x = wte.forward(ids)?.broadcast_add(wpe.as_tensor())?;
    let h = block.forward(&x)?;
    let h = layer_norm(&h, ln_f.0.as_tensor(), ln_f.1.as_tensor(), 1e-5)?;
    let logits = head.forward(&h)?; // [B, T, ⌈V/p⌉]
    let n = logits.dim(2)?;
    vocab_parallel_cross_entropy(&logits.reshape((B * T, n))?, targets, vocab, comm)
}

#[test]
fn tiny_gpt_with_tied_head_matches_single_device() {
    tiny_gpt_matches_single_device(VOCAB, true);
}

/// 29 ids: padded to 30 rows at tp = 2 and to 32 at tp = 4.
#[test]
fn tiny_gpt_over_a_vocabulary_the_degree_does_not_divide_matches_single_device() {
    tiny_gpt_matches_single_device(29, true);
    tiny_gpt_matches_single_device(29, false);
}

fn tiny_gpt_matches_single_device(vocab: usize, tied: bool) {
    let dev = Device::Cpu;
    let ids: Vec<u32> = (0..(B * T) as u32)
        .map(|i| (i * 7 + 3) % vocab as u32)
        .collect();
    let tg: Vec<u32> = (0..(B * T) as u32)
        .map(|i| (i * 5 + 1) % vocab as u32)
        .collect();
    let ids = Tensor::from_vec(ids, (B, T), &dev).unwrap();
    let targets = Tensor::from_vec(tg, B * T, &dev).unwrap();
    for dtype in DTYPES {
        // Reference: plain candle, full weights, candle-nn's cross-entropy.
        let mut p = RefParams::new(dtype);
        let wte = p.p(
            "transformer.wte.weight",
            &[vocab, D],
            Init::Normal { std: 0.5 },
        );
        let wpe = p.p("transformer.wpe.weight", &[T, D], Init::Normal { std: 0.5 });
        let x = wte
            .embedding(&ids.flatten_all().unwrap())
            .unwrap()
            .reshape((B, T, D))
            .unwrap();
        let h = ref_block(&mut p, "transformer.h.0", &x.broadcast_add(&wpe).unwrap());
        let lw = p.p("transformer.ln_f.weight", &[D], LN_W);
        let lb = p.p("transformer.ln_f.bias", &[D], LN_B);
        let head = match tied {
            true => wte.clone(),
            false => p.p("lm_head.weight", &[vocab, D], Init::Normal { std: 0.5 }),
        };
        let logits = ref_linear(&ref_layer_norm(&h, &lw, &lb), &head, None);
        let loss =
            candle_nn::loss::cross_entropy(&logits.reshape((B * T, vocab)).unwrap(), &targets)
                .unwrap();
        let grads = loss.backward().unwrap();

        for tp in TPS {
            let out = run_tp(tp, |comm| {
                let (comm, counts) = Counting::wrap(comm);
                let store = store(&comm, dtype);
                let loss = tiny_gpt(&comm, &store.builder(), vocab, tied, &ids, &targets)?;
                let fwd = counts.get("all_reduce");
                counts.reset();
                let g = loss.backward()?;
                assert_eq!(
                    counts.snapshot().len(),
                    usize::from(tp > 1),
                    "only all-reduces"
                );
                Ok((loss, param_grads(&store, &g), fwd, counts.get("all_reduce")))
            });
            let case = format!("tiny GPT V={vocab} tied={tied} tp={tp}");
            for (rank, (l, _, fwd, bwd)) in out.iter().enumerate() {
                assert_close(&format!("{case} loss rank {rank}"), l, &loss, dtype);
                // embedding 1 + block 2 + loss 2 forward; block 2 + the head's f 1 backward.
                let (f, b) = if tp == 1 { (0, 0) } else { (5, 3) };
                assert_eq!(
                    (*fwd, *bwd),
                    (f, b),
                    "{case} rank {rank}: all-reduces (fwd, bwd)"
                );
            }
            assert_eq!(
                out[0].1.len(),
                p.vars.len(),
                "{case}: parameter count (a tied head adds none)"
            );
            for (name, (spec, _)) in &out[0].1 {
                let parts: Vec<Tensor> = out.iter().map(|o| o.1[name].1.clone()).collect();
                let g = merge(&format!("{case} {name}"), *spec, &parts, dtype);
                let want = grads.get(p.vars[name].as_tensor()).unwrap();
                assert_close(&format!("{case} grad of {name}"), &g, want, dtype);
                // The padding rows of a vocabulary table get no gradient.
                for (rank, part) in parts.iter().enumerate() {
                    let Some((c, real)) = spec.padded_rows(rank, tp) else {
                        continue;
                    };
                    if real < c {
                        let pad = part.narrow(0, real, c - real).unwrap();
                        let m = pad.abs().unwrap().sum_all().unwrap();
                        let m = m.to_dtype(DType::F64).unwrap().to_scalar::<f64>().unwrap();
                        assert_eq!(m, 0.0, "{case}: padding gradient of {name} on rank {rank}");
                    }
                }
            }
        }
    }
}

/// `begin_step` fuses the weights once: forward passes until `end_step` use them; after
/// `end_step`, a forward pass sees the parameters as they are now (an optimizer's
/// in-place update), and so does the next step's `begin_step`.
#[test]
fn fused_weights_live_for_one_step_only() {
    local::launch(1, |tp| -> Result<()> {
        let store = ParamStore::for_group(tp.as_ref(), DType::F32, ParamSource::Init { seed: 3 })?;
        let vb = store.builder().pp("h.0");
        let mlp = ParallelMlp::new(&vb, tp.clone(), D, 4 * D, init())?;
        let attn = ParallelSelfAttention::new(&vb, tp.clone(), D, HEADS, init())?;
        let x = Tensor::randn(0f32, 1.0, (B, T, D), &Device::Cpu)?;
        let sum = |t: Tensor| t.sum_all()?.to_scalar::<f32>();
        let before = (sum(mlp.forward(&x)?)?, sum(attn.forward(&x)?)?);
        mlp.begin_step()?;
        attn.begin_step()?;
        assert_eq!((sum(mlp.forward(&x)?)?, sum(attn.forward(&x)?)?), before);
        // Update every bias in place, as an optimizer does, inside the step: the cached
        // weights still hold the old ones.
        for name in ["h.0.mlp.c_proj.bias", "h.0.attn.c_proj.bias"] {
            let v = &store.get(name).unwrap().var;
            v.set(&(v.as_tensor() + 1.0)?)?;
        }
        assert_eq!((sum(mlp.forward(&x)?)?, sum(attn.forward(&x)?)?), before);
        mlp.end_step();
        attn.end_step();
        let after = (sum(mlp.forward(&x)?)?, sum(attn.forward(&x)?)?);
        // Each output element grew by 1: B·T·D more in the sum.
        let grown = (B * T * D) as f32;
        assert!(
            (after.0 - before.0 - grown).abs() < 1e-2,
            "{after:?} vs {before:?}"
        );
        assert!(
            (after.1 - before.1 - grown).abs() < 1e-2,
            "{after:?} vs {before:?}"
        );
        mlp.begin_step()?;
        assert_eq!(sum(mlp.forward(&x)?)?, after.0);
        mlp.end_step();
        Ok(())
    })
    .unwrap();
}

/// At bf16 the fused attention and MLP keep their input rounded to bf16 and never read
/// the input tensor again: freeing it in place after the forward (what the GPT's
/// blocks do with the LayerNorms' outputs) changes no output or gradient, on one rank
/// and on two.
#[test]
fn at_bf16_the_pairs_never_read_a_freed_input() {
    use switchyard_shard::storage::{free_in_place, is_freed};
    use switchyard_shard::Precision;
    let x_full = rand_tensor(6, &[B, T, D], 1.0, DType::F32);
    let r = rand_tensor(7, &[B, T, D], 1.0, DType::F32);
    for tp in [1, 2] {
        let run = |free: bool| {
            run_parallel(tp, DType::F32, ShardSpec::Replicated, &r, |comm, store| {
                let vb = store
                    .builder()
                    .with_precision(Precision::Bf16)
                    .pp("transformer.h.0");
                let (attn, mlp) = (
                    ParallelSelfAttention::new(&vb, comm.clone(), D, HEADS, init())?,
                    ParallelMlp::new(&vb, comm.clone(), D, 4 * D, init())?,
                );
                let x = var(&x_full);
                let h = (x.as_tensor() * 0.5)?;
                let a = attn.forward(&h)?;
                let m = mlp.forward(&h)?;
                if free {
                    free_in_place(&h)?;
                    assert!(is_freed(&h));
                }
                Ok(((a + m)?, Some(x)))
            })
        };
        let (kept, freed) = (run(false), run(true));
        for (rank, (k, f)) in kept.iter().zip(&freed).enumerate() {
            let same = |a: &Tensor, b: &Tensor| {
                let v = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                v(a) == v(b)
            };
            assert!(same(&k.y, &f.y), "tp {tp} rank {rank}: output");
            let (dk, df) = (k.dx.as_ref().unwrap(), f.dx.as_ref().unwrap());
            assert!(same(dk, df), "tp {tp} rank {rank}: input gradient");
            assert_eq!(k.grads.len(), f.grads.len());
            for ((name, (_, a)), (_, (_, b))) in k.grads.iter().zip(&f.grads) {
                assert!(same(a, b), "tp {tp} rank {rank}: gradient of {name}");
            }
        }
    }
}
