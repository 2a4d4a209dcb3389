//! Activation recomputation (issue 16 §1): the same kernels run again on the same inputs,
//! so a step with `--recompute selective` or `full` gives the loss and gradients of
//! `none`, and trains the same curve.

use crate::common::*;
use switchyard_train::data::Corpus;
use switchyard_train::testing::{schedules, LAYOUTS};
use switchyard_train::{train, Recompute, TrainOptions};

/// The most relative difference allowed (the bound; bit-identical is the aim).
const TOL: f64 = 1e-6;

fn assert_same_step(cfg: &switchyard_train::TrainConfig<switchyard_models::GptConfig>) {
    let (want_loss, want) = parallel_step(cfg, 0);
    for r in [Recompute::Selective, Recompute::Full] {
        let mut c = cfg.clone();
        c.recompute = r;
        let what = format!(
            "dp {} pp {} tp {} {} ops {} recompute {r}",
            c.dp, c.pp, c.tp, c.schedule, c.model.ops
        );
        let (loss, got) = parallel_step(&c, 0);
        let e = (loss - want_loss).abs() / want_loss.abs();
        assert!(e <= TOL, "{what}: loss {loss} vs {want_loss} ({e:.2e})");
        assert_eq!(got.len(), want.len(), "{what}");
        for (n, w) in &want {
            let e = rel_err(&got[n], w);
            assert!(e <= TOL, "{what}: gradient of {n} differs by {e:.2e}");
        }
    }
}

#[test]
fn every_layout_and_schedule_gives_the_gradients_of_no_recomputation() {
    for (dp, pp, tp) in LAYOUTS {
        for s in schedules(pp) {
            assert_same_step(&tiny(dp, pp, tp, s));
        }
    }
}

#[test]
fn the_composed_ops_and_tied_or_uneven_stages_give_the_same_gradients() {
    for (dp, pp, tp, s) in [(1, 2, 2, "1f1b"), (2, 2, 1, "interleaved")] {
        assert_same_step(&tiny_ops(dp, pp, tp, s, OpsBackend::Composed));
    }
    let mut c = tiny(1, 2, 1, "zb-h1");
    c.model.tied_embeddings = true;
    c.model.n_layer = 5;
    c.split = "1,4".parse().unwrap();
    assert_same_step(&c);
}

#[test]
fn twenty_steps_train_the_same_curve() {
    let cfg = tiny(2, 2, 2, "1f1b");
    let run = |r: Recompute| {
        let mut c = cfg.clone();
        c.recompute = r;
        let report = train(&c, &Corpus::bundled(), &TrainOptions::default()).unwrap();
        report.steps.iter().map(|s| s.loss).collect::<Vec<f64>>()
    };
    let want = run(Recompute::None);
    for r in [Recompute::Selective, Recompute::Full] {
        for (step, (g, w)) in run(r).iter().zip(&want).enumerate() {
            let e = (g - w).abs() / w.abs();
            assert!(e <= TOL, "{r}: step {step} loss {g} vs {w} ({e:.2e})");
        }
    }
}
