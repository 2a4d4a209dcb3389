//! Shard specs (shard → merge, fused layout, errors, serde) and degree-independent
//! initialisation (shards at tp = 2, 4 are slices of the tp = 1 tensor), checkpoint
//! sources and the parameter registry.

mod common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor};
use common::*;
use switchyard_shard::{Init, Param, ParamSource, ParamStore, ShardSpec};

fn arange(shape: &[usize]) -> Tensor {
    let n: usize = shape.iter().product();
    Tensor::arange(0f32, n as f32, &Device::Cpu)
        .unwrap()
        .reshape(shape)
        .unwrap()
}

fn equal(a: &Tensor, b: &Tensor) -> bool {
    a.dims() == b.dims()
        && a.flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
            .to_vec1::<f64>()
            .unwrap()
            == b.flatten_all()
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
}

#[test]
fn shard_then_merge_round_trips() {
    let full = arange(&[24, 12]);
    let specs = [
        ShardSpec::Replicated,
        ShardSpec::split(0),
        ShardSpec::split(1),
        ShardSpec::fused(0, 3),
        ShardSpec::fused(1, 3),
        ShardSpec::fused(0, 2),
        ShardSpec::padded(0, 24),
        ShardSpec::padded(1, 12),
    ];
    for spec in specs {
        for n in [1, 2, 4] {
            let parts: Vec<Tensor> = (0..n).map(|r| spec.shard(&full, r, n).unwrap()).collect();
            let local = spec.local_shape(full.dims(), n).unwrap();
            assert!(
                parts.iter().all(|p| p.dims() == local.as_slice()),
                "{spec:?} n={n}"
            );
            assert!(equal(&spec.merge(&parts).unwrap(), &full), "{spec:?} n={n}");
        }
    }
}

/// `V_p = ⌈V/n⌉·n`: rank `r` holds rows `r·c .. min((r+1)·c, V)` then zeros up to
/// `c = ⌈V/n⌉` (a rank may hold padding only: `V = 5`, `n = 4`); the merge drops them.
#[test]
fn a_padded_split_pads_with_zeros_and_merges_back_to_the_logical_size() {
    for (v, ns) in [
        (13, &[1, 2, 3, 4, 5, 13, 14][..]),
        (5, &[4][..]),
        (1, &[3][..]),
    ] {
        let full = (arange(&[v, 3]) + 1.0).unwrap();
        let spec = ShardSpec::padded(0, v);
        for &n in ns {
            let c = v.div_ceil(n);
            assert_eq!(spec.local_shape(&[v, 3], n).unwrap(), vec![c, 3]);
            let parts: Vec<Tensor> = (0..n).map(|r| spec.shard(&full, r, n).unwrap()).collect();
            for (r, p) in parts.iter().enumerate() {
                let (per, real) = spec.padded_rows(r, n).unwrap();
                assert_eq!(
                    (per, real),
                    (c, v.saturating_sub(r * c).min(c)),
                    "V={v} n={n} r={r}"
                );
                let rows: Vec<Vec<f32>> = p.to_vec2().unwrap();
                for (i, row) in rows.iter().enumerate() {
                    let want: Vec<f32> = match i < real {
                        true => (0..3).map(|j| ((r * c + i) * 3 + j + 1) as f32).collect(),
                        false => vec![0.0; 3],
                    };
                    assert_eq!(row, &want, "V={v} n={n} rank {r} row {i}");
                }
            }
            assert!(equal(&spec.merge(&parts).unwrap(), &full), "V={v} n={n}");
        }
    }
    let err = ShardSpec::padded(0, 13)
        .local_shape_of("transformer.wte.weight", &[12, 3], 2)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains(
            "transformer.wte.weight: dim 0 has size 12, but the padded split is for size 13"
        ),
        "{err}"
    );
    let parts = vec![arange(&[6, 3]), arange(&[6, 3])];
    let err = ShardSpec::padded(0, 13)
        .merge(&parts)
        .unwrap_err()
        .to_string();
    assert!(err.contains("are not Padded"), "{err}");
}

#[test]
fn fused_split_gives_each_rank_its_piece_of_every_block() {
    // rows: q (0..8) | k (8..16) | v (16..24); 4 ranks → 2 rows of each per rank.
    let full = arange(&[24, 1]);
    let spec = ShardSpec::fused(0, 3);
    for r in 0..4 {
        let got: Vec<f32> = spec
            .shard(&full, r, 4)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want: Vec<f32> = [0, 8, 16]
            .iter()
            .flat_map(|&base| [base + 2 * r, base + 2 * r + 1])
            .map(|v| v as f32)
            .collect();
        assert_eq!(got, want, "rank {r}");
    }
}

#[test]
fn indivisible_shapes_are_clear_errors() {
    let spec = ShardSpec::fused(0, 3);
    let err = spec
        .local_shape_of("transformer.h.0.attn.c_attn.weight", &[96, 32], 5)
        .unwrap_err()
        .to_string();
    assert_eq!(
        err,
        "dim 0 of transformer.h.0.attn.c_attn.weight (size 96) does not split into 3 blocks × 5 ranks"
    );
    let err = ShardSpec::split(1)
        .local_shape(&[4, 6], 4)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("dim 1 of a tensor of shape [4, 6] (size 6) does not split into 4 ranks"),
        "{err}"
    );
    let err = ShardSpec::split(2)
        .local_shape(&[4, 6], 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("split dim 2 out of range"), "{err}");
    let err = ShardSpec::split(0)
        .shard(&arange(&[4, 2]), 2, 2)
        .unwrap_err()
        .to_string();
    assert!(err.contains("rank 2 out of range for 2 ranks"), "{err}");
    // Through the store, the error names the parameter.
    let store = ParamStore::new(DType::F32, 0, 5, ParamSource::Init { seed: 1 }).unwrap();
    let vb = store.builder().pp("transformer.h.0").pp("attn.c_attn");
    let err = vb
        .param("weight", &[96, 32], spec, Init::Zeros)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("dim 0 of transformer.h.0.attn.c_attn.weight (size 96) does not split into 3 blocks × 5 ranks"),
        "{err}"
    );
}

#[test]
fn shard_spec_serde_round_trips() {
    for spec in [
        ShardSpec::Replicated,
        ShardSpec::split(1),
        ShardSpec::fused(0, 3),
        ShardSpec::padded(0, 257),
    ] {
        let json = serde_json::to_string(&spec).unwrap();
        assert_eq!(
            serde_json::from_str::<ShardSpec>(&json).unwrap(),
            spec,
            "{json}"
        );
    }
    assert_eq!(
        serde_json::to_string(&ShardSpec::fused(0, 3)).unwrap(),
        r#"{"Split":{"dim":0,"blocks":3}}"#
    );
    assert_eq!(
        serde_json::to_string(&ShardSpec::padded(0, 257)).unwrap(),
        r#"{"Padded":{"dim":0,"size":257}}"#
    );
}

/// The parameters of a small layer set, declared the same way at every degree.
fn declare(store: &ParamStore) {
    let vb = store.builder().pp("transformer.h.0");
    let n = Init::Normal { std: 0.5 };
    vb.param("attn.c_attn.weight", &[48, 16], ShardSpec::fused(0, 3), n)
        .unwrap();
    vb.param("attn.c_attn.bias", &[48], ShardSpec::fused(0, 3), n)
        .unwrap();
    vb.param("attn.c_proj.weight", &[16, 16], ShardSpec::split(1), n)
        .unwrap();
    vb.param("ln_1.weight", &[16], ShardSpec::Replicated, Init::Ones)
        .unwrap();
    vb.param("ln_1.bias", &[16], ShardSpec::Replicated, Init::Zeros)
        .unwrap();
    vb.param("mlp.c_fc.weight", &[64, 16], ShardSpec::split(0), n)
        .unwrap();
    // A vocabulary no degree of 2 or 4 divides: padded.
    vb.param("wte.weight", &[13, 16], ShardSpec::padded(0, 13), n)
        .unwrap();
    vb.param("pad.ln_1.weight", &[7], ShardSpec::padded(0, 7), Init::Ones)
        .unwrap();
}

fn build(tp: usize, dtype: DType, source: ParamSource) -> Vec<Vec<Param>> {
    (0..tp)
        .map(|rank| {
            let store = ParamStore::new(dtype, rank, tp, source.clone()).unwrap();
            declare(&store);
            store.params()
        })
        .collect()
}

#[test]
fn shards_at_any_degree_are_slices_of_the_single_device_weights() {
    for dtype in DTYPES {
        let full = build(1, dtype, ParamSource::Init { seed: 7 }).remove(0);
        for p in &full {
            let want = match p.name.as_str() {
                n if n.ends_with("ln_1.weight") => Init::Ones,
                n if n.ends_with("ln_1.bias") => Init::Zeros,
                _ => Init::Normal { std: 0.5 },
            }
            .full_tensor(7, &p.name, &p.full_shape, dtype)
            .unwrap();
            assert!(equal(p.var.as_tensor(), &want), "{} at tp=1", p.name);
        }
        for tp in [2, 4] {
            let ranks = build(tp, dtype, ParamSource::Init { seed: 7 });
            for (i, p) in full.iter().enumerate() {
                for (rank, params) in ranks.iter().enumerate() {
                    let local = &params[i];
                    assert_eq!(local.name, p.name);
                    let want = p.spec.shard(p.var.as_tensor(), rank, tp).unwrap();
                    assert!(
                        equal(local.var.as_tensor(), &want),
                        "{} rank {rank} of {tp}",
                        p.name
                    );
                }
            }
        }
    }
}

#[test]
fn init_depends_on_seed_and_name_and_has_the_requested_std() {
    let a = Init::Normal { std: 2.0 }
        .full_tensor(1, "w", &[200, 100], DType::F64)
        .unwrap();
    let b = Init::Normal { std: 2.0 }
        .full_tensor(1, "w", &[200, 100], DType::F64)
        .unwrap();
    let c = Init::Normal { std: 2.0 }
        .full_tensor(2, "w", &[200, 100], DType::F64)
        .unwrap();
    let d = Init::Normal { std: 2.0 }
        .full_tensor(1, "v", &[200, 100], DType::F64)
        .unwrap();
    assert!(equal(&a, &b));
    assert!(!equal(&a, &c) && !equal(&a, &d));
    let v: Vec<f64> = a.flatten_all().unwrap().to_vec1().unwrap();
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let std = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
    assert!(
        mean.abs() < 0.05 && (std - 2.0).abs() < 0.05,
        "mean {mean}, std {std}"
    );
}

#[test]
fn full_source_slices_checkpoint_tensors() {
    let full = build(1, DType::F64, ParamSource::Init { seed: 3 }).remove(0);
    let mut map: HashMap<String, Tensor> = full
        .iter()
        .map(|p| (p.name.clone(), p.var.as_detached_tensor()))
        .collect();
    map.insert("unexpected.weight".into(), arange(&[2]));
    // Loaded at tp = 4 in f32: each shard is the f32 slice of the checkpoint.
    let loaded = build(4, DType::F32, ParamSource::Full(map.clone()));
    for (i, p) in full.iter().enumerate() {
        for (rank, params) in loaded.iter().enumerate() {
            let want = p
                .spec
                .shard(p.var.as_tensor(), rank, 4)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            assert!(
                equal(params[i].var.as_tensor(), &want),
                "{} rank {rank}",
                p.name
            );
        }
    }
    let store = ParamStore::new(DType::F32, 0, 2, ParamSource::Full(map.clone())).unwrap();
    declare(&store);
    assert_eq!(
        store.unused_sources(),
        vec!["unexpected.weight".to_string()]
    );
    // The Var is a copy: it never aliases the checkpoint tensor.
    let w = store.get("transformer.h.0.ln_1.weight").unwrap().var;
    w.set(&Tensor::zeros(16, DType::F32, &Device::Cpu).unwrap())
        .unwrap();
    assert!(equal(
        &map["transformer.h.0.ln_1.weight"],
        &Tensor::ones(16, DType::F64, &Device::Cpu).unwrap()
    ));

    // A missing name and a wrong full shape name the parameter.
    let store = ParamStore::new(DType::F32, 0, 2, ParamSource::Full(map)).unwrap();
    let vb = store.builder().pp("transformer.h.1");
    let err = vb
        .param(
            "mlp.c_fc.weight",
            &[64, 16],
            ShardSpec::split(0),
            Init::Zeros,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("parameter transformer.h.1.mlp.c_fc.weight: not found"),
        "{err}"
    );
    let vb = store.builder().pp("transformer.h.0");
    let err = vb
        .param(
            "mlp.c_fc.weight",
            &[32, 16],
            ShardSpec::split(0),
            Init::Zeros,
        )
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("parameter transformer.h.0.mlp.c_fc.weight")
            && err.contains("[64, 16]")
            && err.contains("[32, 16]"),
        "{err}"
    );
}

#[test]
fn gather_full_reassembles_the_single_device_tensors() {
    let full = build(1, DType::F32, ParamSource::Init { seed: 5 }).remove(0);
    for tp in [1, 2, 4] {
        let gathered = run_tp(tp, |comm| {
            let store =
                ParamStore::for_group(comm.as_ref(), DType::F32, ParamSource::Init { seed: 5 })?;
            declare(&store);
            store.gather_full(comm.as_ref())
        });
        for per_rank in gathered {
            assert_eq!(per_rank.len(), full.len());
            for ((name, t), p) in per_rank.iter().zip(&full) {
                assert_eq!(name, &p.name);
                assert!(equal(t, p.var.as_tensor()), "{name} at tp={tp}");
            }
        }
    }
}

#[test]
fn registry_rules() {
    fn assert_send_sync_clone<T: Send + Sync + Clone>() {}
    assert_send_sync_clone::<ParamStore>();

    let store = ParamStore::new(DType::F32, 1, 2, ParamSource::Init { seed: 0 }).unwrap();
    let vb = store.builder().pp("a").pp("b");
    assert_eq!(vb.path("c"), "a.b.c");
    vb.param("w", &[4, 2], ShardSpec::split(0), Init::Ones)
        .unwrap();
    vb.param("v", &[2], ShardSpec::Replicated, Init::Zeros)
        .unwrap();
    let names: Vec<String> = store.params().into_iter().map(|p| p.name).collect();
    assert_eq!(names, ["a.b.w", "a.b.v"], "creation order");
    assert_eq!(store.get("a.b.w").unwrap().var.dims(), &[2, 2]);
    assert_eq!(store.get("a.b.w").unwrap().full_shape, vec![4, 2]);
    let clone = store.clone();
    assert_eq!(clone.len(), 2, "clones share the registry");
    let err = vb
        .param("w", &[4, 2], ShardSpec::split(0), Init::Ones)
        .unwrap_err()
        .to_string();
    assert!(err.contains("parameter a.b.w: created twice"), "{err}");
    let err = ParamStore::new(DType::F32, 2, 2, ParamSource::Init { seed: 0 })
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("rank 2 out of range"), "{err}");
    let err = ParamStore::new(DType::U32, 0, 1, ParamSource::Init { seed: 0 })
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("floating point"), "{err}");
}

#[test]
fn a_shared_builder_returns_the_existing_variable() {
    let store = ParamStore::new(DType::F32, 1, 2, ParamSource::Init { seed: 0 }).unwrap();
    let vb = store.builder().pp("wte");
    let spec = ShardSpec::split(0);
    let a = vb
        .param("weight", &[8, 4], spec, Init::Normal { std: 0.02 })
        .unwrap();
    // The same name, full shape and spec: the same Var, not a second parameter.
    let b = vb
        .shared()
        .param("weight", &[8, 4], spec, Init::Normal { std: 0.02 })
        .unwrap();
    assert_eq!(a.id(), b.id());
    assert!(equal(a.as_tensor(), b.as_tensor()));
    assert_eq!(store.len(), 1);
    // `pp` keeps the sharing; a path from the root reaches the same parameter.
    let c = store
        .builder()
        .shared()
        .pp("wte")
        .param("weight", &[8, 4], spec, Init::Ones)
        .unwrap();
    assert_eq!(a.id(), c.id());
    // A name not yet in the store is created as usual.
    vb.shared()
        .param("bias", &[8], ShardSpec::Replicated, Init::Zeros)
        .unwrap();
    assert_eq!(store.len(), 2);
    // Another full shape or another spec is refused, naming the parameter.
    let err = vb
        .shared()
        .param("weight", &[8, 2], spec, Init::Ones)
        .unwrap_err()
        .to_string();
    assert!(err.contains("parameter wte.weight: created twice"), "{err}");
    assert!(err.contains("[8, 2]") && err.contains("[8, 4]"), "{err}");
    let err = vb
        .shared()
        .param("weight", &[8, 4], ShardSpec::split(1), Init::Ones)
        .unwrap_err()
        .to_string();
    assert!(err.contains("parameter wte.weight: created twice"), "{err}");
    assert_eq!(store.len(), 2);
    // A plain builder still refuses the duplicate.
    let err = vb
        .param("weight", &[8, 4], spec, Init::Ones)
        .unwrap_err()
        .to_string();
    assert!(err.contains("parameter wte.weight: created twice"), "{err}");
}
