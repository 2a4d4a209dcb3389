//! Every tensor-parallel layer equals its single-device equivalent at tp = 1, 2, 4, in
//! output, input gradient and every parameter gradient (merged over ranks), f32 and f64.

mod common;

use candle_core::{DType, Device, Tensor};
use common::*;
use switchyard_shard::{
    ColumnConfig, ColumnParallelLinear, Init, LayerInit, ParallelMlp, ParallelSelfAttention,
    RowConfig, RowParallelLinear, ShardSpec, VocabParallelEmbedding,
};

const B: usize = 2;
const T: usize = 5;
const W_INIT: Init = Init::Normal { std: 0.3 };
const B_INIT: Init = Init::Normal { std: 0.1 };

fn init() -> LayerInit {
    LayerInit {
        weight: W_INIT,
        proj_weight: Init::Normal { std: 0.2 },
        bias: B_INIT,
    }
}

#[test]
fn column_parallel_linear_matches_single_device() {
    let (d_in, d_out) = (16, 24);
    for dtype in DTYPES {
        for (blocks, gather) in [(1, false), (3, false), (1, true), (3, true)] {
            let case = format!("column blocks={blocks} gather={gather}");
            let x_full = rand_tensor(1, &[B, T, d_in], 1.0, dtype);
            let r = rand_tensor(2, &[B, T, d_out], 1.0, dtype);

            let mut p = RefParams::new(dtype);
            let w = p.p("fc.weight", &[d_out, d_in], W_INIT);
            let b = p.p("fc.bias", &[d_out], B_INIT);
            let x = var(&x_full);
            let y = ref_linear(x.as_tensor(), &w, Some(&b));
            let reference = reference(&p, y, Some(&x), &r);

            let out_spec = match gather {
                true => ShardSpec::Replicated,
                false => ShardSpec::fused(2, blocks),
            };
            for tp in TPS {
                let ranks = run_parallel(tp, dtype, out_spec, &r, |comm, store| {
                    let cfg = ColumnConfig {
                        blocks,
                        gather_output: gather,
                        weight_init: W_INIT,
                        bias_init: B_INIT,
                        ..Default::default()
                    };
                    let layer = ColumnParallelLinear::new(
                        &store.builder().pp("fc"),
                        comm.clone(),
                        d_in,
                        d_out,
                        cfg,
                    )?;
                    let x = var(&x_full);
                    Ok((layer.forward(x.as_tensor())?, Some(x)))
                });
                check_parity(
                    &case,
                    dtype,
                    &ranks,
                    out_spec,
                    &reference,
                    ShardSpec::Replicated,
                );
            }
        }
    }
}

#[test]
fn row_parallel_linear_matches_single_device() {
    let (d_in, d_out) = (24, 16);
    for dtype in DTYPES {
        for input_is_parallel in [true, false] {
            let case = format!("row input_is_parallel={input_is_parallel}");
            let x_full = rand_tensor(3, &[B, T, d_in], 1.0, dtype);
            let r = rand_tensor(4, &[B, T, d_out], 1.0, dtype);

            let mut p = RefParams::new(dtype);
            let w = p.p("proj.weight", &[d_out, d_in], W_INIT);
            let b = p.p("proj.bias", &[d_out], B_INIT);
            let x = var(&x_full);
            let y = ref_linear(x.as_tensor(), &w, Some(&b));
            let reference = reference(&p, y, Some(&x), &r);

            // With a parallel input each rank holds (and gets the gradient of) its slice.
            let dx_spec = match input_is_parallel {
                true => ShardSpec::split(2),
                false => ShardSpec::Replicated,
            };
            for tp in TPS {
                let ranks = run_parallel(tp, dtype, ShardSpec::Replicated, &r, |comm, store| {
                    let cfg = RowConfig {
                        input_is_parallel,
                        weight_init: W_INIT,
                        bias_init: B_INIT,
                        ..Default::default()
                    };
                    let layer = RowParallelLinear::new(
                        &store.builder().pp("proj"),
                        comm.clone(),
                        d_in,
                        d_out,
                        cfg,
                    )?;
                    let x = var(&dx_spec.shard(&x_full, comm.rank(), tp)?);
                    Ok((layer.forward(x.as_tensor())?, Some(x)))
                });
                check_parity(
                    &case,
                    dtype,
                    &ranks,
                    ShardSpec::Replicated,
                    &reference,
                    dx_spec,
                );
            }
        }
    }
}

#[test]
fn vocab_parallel_embedding_matches_single_device() {
    // 32 splits evenly; 29 is padded to 30 and 32 at tp = 2 and 4.
    for vocab in [32, 29] {
        vocab_parallel_embedding_matches(vocab);
    }
}

fn vocab_parallel_embedding_matches(vocab: usize) {
    let d = 16;
    let last = vocab as u32 - 1;
    let ids: Vec<u32> = vec![0, last, 7, 8, 15, 16, 23, 24, 3, 3];
    let ids = Tensor::from_vec(ids, (B, T), &Device::Cpu).unwrap();
    for dtype in DTYPES {
        let r = rand_tensor(5, &[B, T, d], 1.0, dtype);
        let mut p = RefParams::new(dtype);
        let w = p.p("wte.weight", &[vocab, d], W_INIT);
        let y = w
            .embedding(&ids.flatten_all().unwrap())
            .unwrap()
            .reshape((B, T, d))
            .unwrap();
        let reference = reference(&p, y, None, &r);
        for tp in TPS {
            let ranks = run_parallel(tp, dtype, ShardSpec::Replicated, &r, |comm, store| {
                let emb = VocabParallelEmbedding::new(
                    &store.builder().pp("wte"),
                    comm.clone(),
                    vocab,
                    d,
                    W_INIT,
                )?;
                let per = vocab.div_ceil(tp);
                let start = comm.rank() * per;
                assert_eq!(emb.vocab_range(), start..vocab.min(start + per));
                assert_eq!(emb.weight().dims(), [per, d]);
                Ok((emb.forward(&ids)?, None))
            });
            check_parity(
                &format!("embedding V={vocab}"),
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
fn parallel_attention_matches_single_device() {
    let (d, n_head) = (32, 4);
    for dtype in DTYPES {
        let x_full = rand_tensor(6, &[B, 8, d], 1.0, dtype);
        let r = rand_tensor(7, &[B, 8, d], 1.0, dtype);
        let mut p = RefParams::new(dtype);
        let wa = p.p("h.attn.c_attn.weight", &[3 * d, d], W_INIT);
        let ba = p.p("h.attn.c_attn.bias", &[3 * d], B_INIT);
        let wp = p.p("h.attn.c_proj.weight", &[d, d], Init::Normal { std: 0.2 });
        let bp = p.p("h.attn.c_proj.bias", &[d], B_INIT);
        let x = var(&x_full);
        let y = ref_attention(x.as_tensor(), &wa, &ba, &wp, &bp, n_head);
        let reference = reference(&p, y, Some(&x), &r);
        for tp in TPS {
            let ranks = run_parallel(tp, dtype, ShardSpec::Replicated, &r, |comm, store| {
                let attn = ParallelSelfAttention::new(
                    &store.builder().pp("h"),
                    comm.clone(),
                    d,
                    n_head,
                    init(),
                )?;
                assert_eq!(attn.local_heads(), n_head / tp);
                let x = var(&x_full);
                Ok((attn.forward(x.as_tensor())?, Some(x)))
            });
            check_parity(
                "attention",
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
fn parallel_mlp_matches_single_device() {
    let d = 16;
    for dtype in DTYPES {
        let x_full = rand_tensor(8, &[B, T, d], 1.0, dtype);
        let r = rand_tensor(9, &[B, T, d], 1.0, dtype);
        let mut p = RefParams::new(dtype);
        let w1 = p.p("h.mlp.c_fc.weight", &[4 * d, d], W_INIT);
        let b1 = p.p("h.mlp.c_fc.bias", &[4 * d], B_INIT);
        let w2 = p.p(
            "h.mlp.c_proj.weight",
            &[d, 4 * d],
            Init::Normal { std: 0.2 },
        );
        let b2 = p.p("h.mlp.c_proj.bias", &[d], B_INIT);
        let x = var(&x_full);
        let hidden = ref_gelu(&ref_linear(x.as_tensor(), &w1, Some(&b1)));
        let y = ref_linear(&hidden, &w2, Some(&b2));
        let reference = reference(&p, y, Some(&x), &r);
        for tp in TPS {
            let ranks = run_parallel(tp, dtype, ShardSpec::Replicated, &r, |comm, store| {
                let mlp =
                    ParallelMlp::new(&store.builder().pp("h"), comm.clone(), d, 4 * d, init())?;
                let x = var(&x_full);
                Ok((mlp.forward(x.as_tensor())?, Some(x)))
            });
            check_parity(
                "mlp",
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
fn layers_work_without_gradients() {
    // Inference: an input that tracks nothing and a detached forward still agree.
    let d = 16;
    let x = rand_tensor(10, &[B, T, d], 1.0, DType::F32);
    let outs = run_tp(2, |comm| {
        let store = store(&comm, DType::F32);
        let mlp = ParallelMlp::new(&store.builder(), comm.clone(), d, 4 * d, init())?;
        mlp.forward(&x)
    });
    let mut p = RefParams::new(DType::F32);
    let w1 = p.p("mlp.c_fc.weight", &[4 * d, d], W_INIT);
    let b1 = p.p("mlp.c_fc.bias", &[4 * d], B_INIT);
    let w2 = p.p("mlp.c_proj.weight", &[d, 4 * d], Init::Normal { std: 0.2 });
    let b2 = p.p("mlp.c_proj.bias", &[d], B_INIT);
    let want = ref_linear(&ref_gelu(&ref_linear(&x, &w1, Some(&b1))), &w2, Some(&b2));
    for y in &outs {
        assert_close("inference mlp", y, &want, DType::F32);
    }
}
