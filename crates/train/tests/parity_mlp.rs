//! Serial parity for a model that is not a GPT: the residual MLP of `switchyard-models`
//! (no vocabulary, no tied parameters, a mean-squared-error loss) goes through the same
//! generic trainer. Its `1 × 1 × 1` step matches a plain candle loop written out here, and
//! every layout and schedule matches the `1 × 1 × 1` step within 1e-5 relative.

use std::collections::BTreeMap;

use candle_core::{Tensor, Var};
use switchyard_models::MlpConfig;
use switchyard_shard::OpsBackend;
use switchyard_train::data::{Corpus, Dataset, Sampler};
use switchyard_train::testing::{
    check_step_parity, compare_steps, initial_weights, parallel_step, schedules, StepOutcome,
    LAYOUTS,
};
use switchyard_train::TrainConfig;

fn tiny(dp: usize, pp: usize, tp: usize, schedule: &str) -> TrainConfig<MlpConfig> {
    TrainConfig {
        model: MlpConfig {
            d_model: 8,
            hidden: 16,
            n_layer: 8,
            ..MlpConfig::default()
        },
        seq_len: 8,
        dp,
        pp,
        tp,
        schedule: schedule.parse().unwrap(),
        virtual_stages: if schedule == "interleaved" { 2 } else { 1 },
        microbatches: 4,
        batch: 4 * dp,
        threads_per_worker: 1,
        ..TrainConfig::default()
    }
}

/// The MLP's step written with candle's own ops: `x ← x + W₂·gelu(W₁·x + b₁) + b₂` per
/// layer on token ids read as `id/128 − 1`, mean squared error against the targets read
/// the same way.
fn plain_step(cfg: &TrainConfig<MlpConfig>) -> StepOutcome {
    let weights: BTreeMap<String, Var> = initial_weights(cfg)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Var::from_tensor(&t).unwrap()))
        .collect();
    let (x, y) = Corpus::bundled()
        .batch(&Sampler::of(cfg), 0, 0..cfg.batch)
        .unwrap();
    let values = |t: &Tensor| {
        t.to_dtype(candle_core::DType::F32)?
            .affine(1.0 / 128.0, -1.0)
    };
    let w = |n: String| weights[&n].as_tensor().clone();
    let mut h = values(&x).unwrap();
    for i in 0..cfg.model.n_layer {
        let p = |s: &str| w(format!("layers.{i}.mlp.{s}"));
        let a = h
            .matmul(&p("c_fc.weight").t().unwrap())
            .unwrap()
            .broadcast_add(&p("c_fc.bias"))
            .unwrap()
            .gelu()
            .unwrap();
        let out = a
            .matmul(&p("c_proj.weight").t().unwrap())
            .unwrap()
            .broadcast_add(&p("c_proj.bias"))
            .unwrap();
        h = (h + out).unwrap();
    }
    let loss = (h - values(&y).unwrap())
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap();
    let g = loss.backward().unwrap();
    let grads = weights
        .iter()
        .map(|(n, v)| (n.clone(), g.get(v.as_tensor()).unwrap().clone()))
        .collect();
    StepOutcome {
        loss: loss.to_scalar::<f32>().unwrap() as f64,
        grads,
    }
}

#[test]
fn the_serial_step_is_the_plain_candle_step() {
    for dp in [1, 2] {
        let cfg = tiny(dp, 1, 1, "1f1b");
        let got = parallel_step(&cfg, &Corpus::bundled(), 0).unwrap();
        assert_eq!(got.grads.len(), 4 * cfg.model.n_layer);
        compare_steps(&got, &plain_step(&tiny(dp, 1, 1, "1f1b")), 1e-5)
            .unwrap_or_else(|e| panic!("batch {}: {e}", cfg.batch));
    }
}

#[test]
fn every_layout_and_schedule_matches_the_serial_step() {
    for (dp, pp, tp) in LAYOUTS {
        for s in schedules(pp) {
            let cfg = tiny(dp, pp, tp, s);
            check_step_parity(&cfg, &tiny(dp, 1, 1, "1f1b"), &Corpus::bundled(), 1e-5)
                .unwrap_or_else(|e| panic!("{e}"));
        }
    }
}

/// The composed twins (`ops = "composed"`, which run on every candle device) go through
/// the same trainer: every layout with them matches the fused serial step.
#[test]
fn the_composed_ops_match_the_fused_serial_step_on_every_layout() {
    for (dp, pp, tp) in LAYOUTS {
        let mut cfg = tiny(dp, pp, tp, "1f1b");
        cfg.model.ops = OpsBackend::Composed;
        check_step_parity(&cfg, &tiny(dp, 1, 1, "1f1b"), &Corpus::bundled(), 1e-5)
            .unwrap_or_else(|e| panic!("composed: {e}"));
    }
}

#[test]
fn the_mlp_refuses_layouts_it_cannot_run() {
    let mut cfg = tiny(1, 1, 1, "1f1b");
    cfg.seq_len = 9;
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("use --seq-len 8"), "{e}");
    let e = tiny(1, 1, 3, "1f1b").validate().unwrap_err().to_string();
    assert!(
        e.contains("--tp 3 does not divide the MLP's hidden width 16"),
        "{e}"
    );
}
