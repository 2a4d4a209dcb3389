//! Sequence parallelism (issue 17 §4): with `--sequence-parallel` every layout with
//! tensor parallelism, under every schedule and both ops backends, matches the
//! single-device reference as plain tensor parallelism does (1e-5 after a step, 1e-4
//! over a 20-step curve), composes with recomputation, ZeRO, the overlapped all-reduce,
//! a tied table and bf16, and refuses what it cannot run before any worker starts.
//! That the split is on (plain tensor parallelism passes these too): `tests/estimate.rs`
//! measures the activations it divides, and switchyard-shard's `tests/block.rs` counts a
//! block's all-gathers and reduce-scatters.

use crate::common::*;
use switchyard_models::GptConfig;
use switchyard_train::data::Corpus;
use switchyard_train::testing::{schedules, LAYOUTS};
use switchyard_train::{train, Recompute, TrainConfig, TrainOptions};

fn sp(mut c: TrainConfig<GptConfig>) -> TrainConfig<GptConfig> {
    c.sequence_parallel = true;
    c
}

/// The parity suite's layouts with tensor parallelism, and 4 × 2 on 8 workers.
fn tp_layouts() -> impl Iterator<Item = (usize, usize, usize)> {
    LAYOUTS.into_iter().filter(|l| l.2 > 1).chain([(1, 2, 4)])
}

#[test]
fn every_tensor_parallel_layout_and_schedule_matches_the_reference() {
    for ops in OpsBackend::ALL {
        for (dp, pp, tp) in tp_layouts() {
            for s in schedules(pp) {
                assert_step_parity(&sp(tiny_ops(dp, pp, tp, s, ops)), 1e-5);
            }
        }
    }
}

#[test]
fn it_composes_with_recomputation_zero_overlap_and_a_tied_table() {
    let mut cases = Vec::new();
    for r in [Recompute::Selective, Recompute::Full] {
        let mut c = sp(tiny(1, 2, 2, "zb-h1"));
        c.recompute = r;
        cases.push(c);
    }
    for zero in [1, 2, 3] {
        let mut c = sp(tiny(2, 1, 2, "1f1b"));
        c.zero = zero;
        cases.push(c);
    }
    // dp 2 all-reduces its buckets during the backward (the default), or after it.
    for overlap in [true, false] {
        let mut c = sp(tiny(2, 2, 2, "1f1b"));
        c.overlap_grad_reduce = overlap;
        cases.push(c);
    }
    for (pp, s) in [(1, "1f1b"), (2, "interleaved")] {
        let mut c = sp(tiny(1, pp, 2, s));
        c.model.tied_embeddings = true;
        cases.push(c);
    }
    for c in &cases {
        assert_step_parity(c, 1e-5);
    }
}

#[test]
fn twenty_step_loss_curves_match_the_reference() {
    let curves: Vec<Vec<f64>> = (1..=2)
        .map(|dp| reference_curve(&tiny(dp, 1, 1, "1f1b")))
        .collect();
    for (dp, pp, tp, s) in [
        (1, 1, 2, "1f1b"),
        (1, 2, 2, "zb-h1"),
        (2, 2, 2, "interleaved"),
        (1, 1, 4, "1f1b"),
    ] {
        assert_curve(&sp(tiny(dp, pp, tp, s)), &curves[dp - 1], 1e-4);
    }
}

/// bf16 with the sequence split trains the curve of bf16 without it (the same products
/// on the same rounded values, summed in another order).
#[test]
fn bf16_trains_the_curve_of_plain_tensor_parallelism() {
    let bf16 = |c: TrainConfig<GptConfig>| {
        let mut c = c;
        c.model.precision = switchyard_models::Precision::Bf16;
        c.steps = 10;
        c
    };
    let curve = |c: &TrainConfig<GptConfig>| -> Vec<f64> {
        let r = train(c, &Corpus::bundled(), &TrainOptions::default()).unwrap();
        r.steps.iter().map(|s| s.loss).collect()
    };
    for (dp, pp, tp, s) in [(1, 1, 2, "1f1b"), (1, 2, 2, "zb-h1")] {
        let want = curve(&bf16(tiny(dp, pp, tp, s)));
        let got = curve(&bf16(sp(tiny(dp, pp, tp, s))));
        for (step, (g, w)) in got.iter().zip(&want).enumerate() {
            let e = (g - w).abs() / w.abs();
            assert!(
                e <= 1e-3,
                "bf16 dp {dp} pp {pp} tp {tp} {s}: step {step} loss {g} vs {w} (rel {e:.2e})"
            );
        }
    }
}

#[test]
fn a_sequence_the_tensor_parallel_ranks_cannot_split_is_refused_before_any_work() {
    let mut c = sp(tiny(1, 1, 4, "1f1b"));
    c.seq_len = 6;
    let e = train(&c, &Corpus::bundled(), &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--sequence-parallel") && e.contains("--seq-len 6") && e.contains("--tp 4"),
        "{e}"
    );
    // Over one tensor-parallel rank there is nothing to split: the flag changes nothing.
    let mut c = sp(tiny(1, 2, 1, "1f1b"));
    c.seq_len = 7;
    c.validate().unwrap();
}

/// No hangs: a tensor-parallel rank that fails makes the other's next step fail at its
/// first collective, with an error naming it and both ranks.
#[test]
fn a_rank_that_fails_fails_the_other_cleanly() {
    assert_a_failed_rank_fails_the_other(
        &sp(tiny(1, 1, 2, "1f1b")),
        &["all_reduce", "rank 0", "tp[0,1]", "rank 1"],
    );
}
