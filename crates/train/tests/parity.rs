//! Serial parity, the heart of switchyard: every layout and schedule trains the same
//! model as one device.
//!
//! For every (dp, pp, tp) layout of the list and every schedule that applies, the loss
//! and every gradient after one step equal the plain single-device reference
//! (`ReferenceGpt`, which shares no code with the parallel path) within 1e-5 relative in
//! f32 — relative meaning `max |a − b| ≤ 1e-5 · max |b|` per tensor — and the loss curves
//! of 20 training steps agree within 1e-4 relative at every step.
//!
//! The one-step checks run for both ops backends (the fused CPU kernels and their
//! composed twins, the path every non-CPU device takes); the composed path also matches
//! the fused one directly, and trains the same 20-step curve on a few layouts.

use crate::common::*;
use switchyard_models::GptConfig;
use switchyard_train::data::Corpus;
use switchyard_train::testing::{schedules, LAYOUTS};
use switchyard_train::{train, TrainConfig, TrainOptions};

#[test]
fn one_step_loss_and_gradients_match_the_reference() {
    for ops in OpsBackend::ALL {
        for (dp, pp, tp) in LAYOUTS {
            for s in schedules(pp) {
                assert_step_parity(&tiny_ops(dp, pp, tp, s, ops), 1e-5);
            }
        }
    }
}

#[test]
fn the_composed_ops_match_the_fused_ops_after_a_step() {
    for (dp, pp, tp) in LAYOUTS {
        for s in schedules(pp) {
            assert_composed_matches_fused(&tiny(dp, pp, tp, s), 1e-5);
        }
    }
}

#[test]
fn the_composed_ops_train_the_reference_curve() {
    let curves: Vec<Vec<f64>> = (1..=2)
        .map(|dp| reference_curve(&tiny(dp, 1, 1, "1f1b")))
        .collect();
    for (dp, pp, tp, s) in [
        (1, 1, 1, "1f1b"),
        (1, 2, 2, "interleaved"),
        (2, 2, 2, "zb-h1"),
    ] {
        let cfg = tiny_ops(dp, pp, tp, s, OpsBackend::Composed);
        let report = train(&cfg, &Corpus::bundled(), &TrainOptions::default()).unwrap();
        for (step, (r, w)) in report.steps.iter().zip(&curves[dp - 1]).enumerate() {
            let e = (r.loss - w).abs() / w.abs();
            assert!(
                e <= 1e-4,
                "composed dp {dp} pp {pp} tp {tp} {s}: step {step} loss {} vs reference {w} (rel {e:.2e})",
                r.loss
            );
        }
    }
}

#[test]
fn twenty_step_loss_curves_match_the_reference() {
    // The global batch grows with dp: one reference curve per batch size.
    let curves: Vec<Vec<f64>> = (1..=2)
        .map(|dp| reference_curve(&tiny(dp, 1, 1, "1f1b")))
        .collect();
    for want in &curves {
        assert!(
            want[19] < want[0] - 0.5,
            "the reference must actually learn: {want:?}"
        );
    }
    for (dp, pp, tp) in LAYOUTS {
        let want = &curves[dp - 1];
        for s in schedules(pp) {
            let cfg = tiny(dp, pp, tp, s);
            let report = train(&cfg, &Corpus::bundled(), &TrainOptions::default()).unwrap();
            assert_eq!(report.steps.len(), 20);
            for (step, (r, w)) in report.steps.iter().zip(want).enumerate() {
                let e = (r.loss - w).abs() / w.abs();
                assert!(
                    e <= 1e-4,
                    "dp {dp} pp {pp} tp {tp} {s}: step {step} loss {} vs reference {w} (rel {e:.2e})",
                    r.loss
                );
            }
        }
    }
}

#[test]
fn an_uneven_split_matches() {
    // 5 layers on 2 stages, 1 + 4 and 3 + 2.
    for (split, ops) in [("1,4", OpsBackend::Fused), ("3,2", OpsBackend::Composed)] {
        let mut cfg = tiny_ops(1, 2, 1, "1f1b", ops);
        cfg.model.n_layer = 5;
        cfg.split = split.parse().unwrap();
        assert_step_parity(&cfg, 1e-5);
    }
}

#[test]
fn tied_embeddings_across_stages_match() {
    for (dp, pp, tp, s) in [
        (1, 2, 1, "1f1b"),
        (1, 2, 2, "interleaved"),
        (2, 4, 1, "gpipe"),
        (1, 1, 2, "1f1b"),
        // Two stages on one rank: the head shares the table its own rank holds.
        (1, 1, 1, "interleaved"),
    ] {
        for ops in OpsBackend::ALL {
            let mut cfg = tiny_ops(dp, pp, tp, s, ops);
            cfg.model.tied_embeddings = true;
            assert_step_parity(&cfg, 1e-5);
        }
    }
}

/// [`tiny`] over a vocabulary of 257 ids, which neither tp = 2 nor tp = 3 divides (padded
/// to 258 and 258 rows), with 6 heads so that both degrees hold whole heads.
fn vocab_257(
    dp: usize,
    pp: usize,
    tp: usize,
    schedule: &str,
    tied: bool,
) -> TrainConfig<GptConfig> {
    let mut cfg = tiny(dp, pp, tp, schedule);
    cfg.model.vocab_size = 257;
    cfg.model.d_model = 24;
    cfg.model.n_head = 6;
    cfg.model.tied_embeddings = tied;
    cfg
}

#[test]
fn a_vocabulary_tp_does_not_divide_matches_the_reference() {
    for tied in [false, true] {
        for (dp, pp, tp, s) in [
            (1, 1, 2, "1f1b"),
            (1, 1, 3, "1f1b"),
            (1, 2, 2, "1f1b"),
            (1, 2, 3, "interleaved"),
            (2, 2, 2, "zb-h1"),
            (1, 4, 2, "gpipe"),
        ] {
            for ops in OpsBackend::ALL {
                let mut cfg = vocab_257(dp, pp, tp, s, tied);
                cfg.model.ops = ops;
                assert_step_parity(&cfg, 1e-5);
            }
        }
    }
}

#[test]
fn a_padded_vocabulary_trains_the_reference_curve_and_its_padding_stays_zero() {
    for tied in [false, true] {
        let want = reference_curve(&vocab_257(1, 1, 1, "1f1b", tied));
        for (pp, tp) in [(1, 3), (2, 2)] {
            let cfg = vocab_257(1, pp, tp, "1f1b", tied);
            let report = train(&cfg, &Corpus::bundled(), &TrainOptions::default()).unwrap();
            for (step, (r, w)) in report.steps.iter().zip(&want).enumerate() {
                let e = (r.loss - w).abs() / w.abs();
                assert!(
                    e <= 1e-4,
                    "V 257 pp {pp} tp {tp} tied {tied}: step {step} loss {} vs reference {w} (rel {e:.2e})",
                    r.loss
                );
            }
        }
    }
    // With weight decay, the padding rows stay exactly zero step after step.
    let mut cfg = vocab_257(1, 1, 2, "1f1b", false);
    cfg.weight_decay = 0.1;
    let padding = padding_after_steps(&cfg, 3);
    assert_eq!(padding.len(), 2, "one padding row each of wte and lm_head");
    for (name, rows) in padding {
        assert!(rows.iter().flatten().all(|&v| v == 0.0), "{name}: {rows:?}");
    }
}
