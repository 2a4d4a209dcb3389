//! `--precision bf16` (issue 18) on every layout and schedule: bf16 products are not
//! bit-identical to f32, so each layout's bf16 run is held to the single-worker bf16
//! run of the same global batch, 1e-3 relative on the loss of each of 10 steps, and the
//! bf16 run to the f32 run within what bf16 rounding explains.

use crate::common::*;
use switchyard_models::Precision;
use switchyard_train::data::Corpus;
use switchyard_train::testing::{schedules, LAYOUTS};
use switchyard_train::{train, TrainOptions};

/// The bound on a layout's bf16 loss against the single worker's.
const TOL: f64 = 1e-3;
const STEPS: usize = 10;

fn bf16(
    mut c: switchyard_train::TrainConfig<switchyard_models::GptConfig>,
) -> switchyard_train::TrainConfig<switchyard_models::GptConfig> {
    c.model.precision = Precision::Bf16;
    c.steps = STEPS;
    c
}

fn curve(c: &switchyard_train::TrainConfig<switchyard_models::GptConfig>) -> Vec<f64> {
    let report =
        train(c, &Corpus::bundled(), &TrainOptions::default()).unwrap_or_else(|e| panic!("{e:#}"));
    report.steps.iter().map(|s| s.loss).collect()
}

/// The single worker with the global batch of `dp` replicas.
fn single(dp: usize) -> switchyard_train::TrainConfig<switchyard_models::GptConfig> {
    let mut c = bf16(tiny(1, 1, 1, "1f1b"));
    c.batch = tiny(dp, 1, 1, "1f1b").batch;
    c
}

/// The largest relative difference between two loss curves.
fn distance(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| ((x - y) / y).abs())
        .fold(0.0, f64::max)
}

#[test]
fn every_layout_and_schedule_trains_the_single_worker_bf16_curve() {
    let want: Vec<Vec<f64>> = (1..=2).map(|dp| curve(&single(dp))).collect();
    // bf16 is not f32: the single worker's bf16 curve differs from its f32 curve, by
    // what bf16 rounding explains; `gap` is how far (1.8e-4 at this size).
    let gap: Vec<f64> = (1..=2)
        .map(|dp| {
            let mut f = single(dp);
            f.model.precision = Precision::F32;
            distance(&want[dp - 1], &curve(&f))
        })
        .collect();
    for (dp, &g) in gap.iter().enumerate() {
        assert!(g > 1e-5 && g <= 2e-2, "dp {}: bf16 vs f32 {g:.2e}", dp + 1);
    }
    assert!(
        want[0][STEPS - 1] < want[0][0] - 0.3,
        "bf16 must learn: {:?}",
        want[0]
    );
    for (dp, pp, tp) in LAYOUTS {
        for s in schedules(pp) {
            let got = curve(&bf16(tiny(dp, pp, tp, s)));
            assert_eq!(got.len(), STEPS);
            let what = format!("bf16 dp {dp} pp {pp} tp {tp} {s}");
            for (step, (g, w)) in got.iter().zip(&want[dp - 1]).enumerate() {
                let e = (g - w).abs() / w.abs();
                assert!(
                    e <= TOL,
                    "{what}: step {step} loss {g} vs one worker {w} ({e:.2e})"
                );
            }
            // Closer to the bf16 curve than a quarter of f32's distance from it: this
            // layout multiplies in bf16 (one that ignored the precision would sit at
            // the f32 curve, `gap` away).
            let d = distance(&got, &want[dp - 1]);
            assert!(
                d < gap[dp - 1] / 4.0,
                "{what}: {d:.2e} from the bf16 curve, f32 is {:.2e} from it",
                gap[dp - 1]
            );
        }
    }
}

#[test]
fn bf16_with_composed_ops_zero_and_recomputation_trains_the_same_curve() {
    let want = curve(&single(2));
    let mut f = single(2);
    f.model.precision = Precision::F32;
    let gap = distance(&want, &curve(&f));
    for (ops, zero, recompute) in [
        (OpsBackend::Composed, 0, "none"),
        (OpsBackend::Fused, 3, "selective"),
        (OpsBackend::Fused, 1, "full"),
    ] {
        let mut c = bf16(tiny_ops(2, 2, 1, "1f1b", ops));
        c.zero = zero;
        c.recompute = recompute.parse().unwrap();
        let what = format!("bf16 ops {ops} zero {zero} recompute {recompute}");
        let got = curve(&c);
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let e = (g - w).abs() / w.abs();
            assert!(
                e <= TOL,
                "{what}: step {step} loss {g} vs one worker {w} ({e:.2e})"
            );
        }
        // It multiplies in bf16: as far from its own f32 run as bf16 is from f32 (at
        // least half as far: the composed twin's f32 sums differ from the fused op's).
        let mut f = c.clone();
        f.model.precision = Precision::F32;
        let own = distance(&got, &curve(&f));
        assert!(
            own > gap / 2.0,
            "{what}: {own:.2e} from its f32 run, bf16 is {gap:.2e} from f32"
        );
        if ops == OpsBackend::Fused {
            let d = distance(&got, &want);
            assert!(
                d < gap / 4.0,
                "{what}: {d:.2e} from the bf16 curve, f32 {gap:.2e}"
            );
        }
    }
}
