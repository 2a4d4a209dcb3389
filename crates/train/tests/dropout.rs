//! Hidden dropout (`--hidden-dropout`): its masks depend on each element's place in the
//! step, not on the layout, so with dropout on every layout and schedule, both ops
//! backends, sequence parallelism, recomputation, ZeRO, the overlapped all-reduce, a
//! mixture of experts and a resumed run match the single-device reference (which drops
//! the same elements of its whole batch) as they do without it: 1e-5 after a step, 1e-4
//! over a 20-step curve. And it is on: the step differs from the step without dropout,
//! while evaluation drops nothing.

use std::path::PathBuf;

use crate::common::*;
use switchyard_comm::local::Launcher;
use switchyard_models::GptConfig;
use switchyard_shard::ParamSource;
use switchyard_train::data::{self, Corpus};
use switchyard_train::testing::{schedules, LAYOUTS};
use switchyard_train::{train, Recompute, Resume, TrainConfig, TrainOptions, Worker};

/// GPT-2's rate.
const P: f64 = 0.1;

fn dropped(mut c: TrainConfig<GptConfig>) -> TrainConfig<GptConfig> {
    c.model.hidden_dropout = P;
    c
}

#[test]
fn every_layout_and_schedule_matches_the_reference_with_dropout() {
    for ops in OpsBackend::ALL {
        for (dp, pp, tp) in LAYOUTS {
            for s in schedules(pp) {
                assert_step_parity(&dropped(tiny_ops(dp, pp, tp, s, ops)), 1e-5);
            }
        }
    }
}

#[test]
fn sequence_parallelism_recomputation_zero_experts_and_the_overlap_draw_the_same_masks() {
    let mut cases = Vec::new();
    // The sequence split: each rank draws its own positions' masks.
    for (dp, pp, tp, s) in [
        (1, 1, 2, "1f1b"),
        (1, 2, 2, "zb-h1"),
        (2, 2, 2, "interleaved"),
        (1, 1, 4, "1f1b"),
    ] {
        let mut c = dropped(tiny(dp, pp, tp, s));
        c.sequence_parallel = true;
        cases.push(c);
    }
    // Recomputation draws the masks of the forward it repeats.
    for (r, (dp, pp, tp, s)) in [
        (Recompute::Full, (1, 2, 2, "zb-h1")),
        (Recompute::Full, (2, 2, 1, "interleaved")),
        (Recompute::Selective, (1, 2, 1, "1f1b")),
    ] {
        let mut c = dropped(tiny(dp, pp, tp, s));
        c.recompute = r;
        cases.push(c);
    }
    for zero in [1, 2, 3] {
        let mut c = dropped(tiny(2, 1, 2, "1f1b"));
        c.zero = zero;
        cases.push(c);
    }
    let mut c = dropped(tiny(2, 2, 1, "1f1b"));
    c.overlap_grad_reduce = false;
    cases.push(c);
    let mut c = dropped(tiny(1, 2, 2, "zb-h2"));
    c.model.tied_embeddings = true;
    cases.push(c);
    // A mixture of experts in every second block, the experts over 2 replicas.
    let mut c = dropped(tiny_moe(2, 2, 1, "1f1b"));
    c.ep = 2;
    cases.push(c);
    // Two sequences a microbatch (the suites above have one): a microbatch's first row
    // is its index times its size.
    for (dp, pp, tp, s, sp) in [(2, 2, 2, "1f1b", true), (1, 2, 1, "zb-h1", false)] {
        let mut c = dropped(tiny(dp, pp, tp, s));
        c.batch = 8 * dp;
        c.sequence_parallel = sp;
        cases.push(c);
    }
    for c in &cases {
        assert_step_parity(c, 1e-5);
    }
}

#[test]
fn twenty_step_loss_curves_match_the_reference_with_dropout() {
    let curves: Vec<Vec<f64>> = (1..=2)
        .map(|dp| reference_curve(&dropped(tiny(dp, 1, 1, "1f1b"))))
        .collect();
    for want in &curves {
        assert!(
            want[19] < want[0] - 0.5,
            "the reference must learn: {want:?}"
        );
    }
    for (dp, pp, tp, s, sp) in [
        (1, 1, 1, "1f1b", false),
        (1, 2, 2, "zb-h1", false),
        (2, 2, 2, "interleaved", true),
        (1, 4, 1, "zb-h2", false),
    ] {
        let mut c = dropped(tiny(dp, pp, tp, s));
        c.sequence_parallel = sp;
        assert_curve(&c, &curves[dp - 1], 1e-4);
    }
}

/// It is on: the gradients of a step move away from those without dropout (by far more
/// than the parity tolerance; at the initial weights the loss moves less, 2e-5); and on
/// step 1 the trainer draws the masks the reference draws for step 1 (that each step
/// draws others is `switchyard_ops`' `other_coordinates_draw_other_masks`).
#[test]
fn dropout_changes_the_gradients_and_step_1_draws_the_references_masks() {
    let c = tiny(1, 2, 2, "1f1b");
    let (plain_loss, plain) = parallel_step(&c, 0);
    let (loss, grads) = parallel_step(&dropped(c.clone()), 0);
    assert_ne!(loss, plain_loss);
    for name in [
        "transformer.wte.weight",
        "transformer.h.0.attn.c_attn.weight",
    ] {
        let e = rel_err(&grads[name], &plain[name]);
        assert!(
            e > 1e-2,
            "gradient of {name}: {e:.2e} from the one without dropout"
        );
    }
    // Step 1 of a run without dropout against step 1 with it: its own masks, which the
    // reference (told the step) draws too.
    assert_ne!(
        parallel_step(&dropped(c.clone()), 1).0,
        parallel_step(&c, 1).0
    );
    let mut r = dropped(c);
    r.pp = 1;
    r.tp = 1;
    let (want, _) = reference_step(&r, &initial_weights(&r), 1);
    let (got, _) = parallel_step(&r, 1);
    assert!((got - want).abs() <= 1e-5 * want, "step 1: {got} vs {want}");
}

/// Evaluation drops nothing: the validation loss with dropout configured equals the
/// one without. (That a training step's end unsets the step is
/// `worker::pass::tests`; that a stage drops nothing once it is unset, a unit test of
/// switchyard-models' `dropout`.)
#[test]
fn evaluation_drops_nothing() {
    let val = |c: &TrainConfig<GptConfig>| -> f64 {
        let corpus = Corpus::text("bundled", data::BUNDLED.to_vec(), 0.1);
        let out = Launcher::new(c.world_size())
            .threads_per_worker(1)
            .run(|world| {
                let w = Worker::new(world, c, &corpus, ParamSource::Init { seed: c.seed })?;
                Ok::<_, anyhow::Error>(w.validation_loss(2)?.expect("a validation split"))
            })
            .unwrap_or_else(|e| panic!("{e}"));
        out[0]
    };
    let c = tiny(1, 2, 2, "zb-h1");
    assert_eq!(val(&dropped(c.clone())), val(&c));
}

/// A run resumed from a checkpoint draws the masks the uninterrupted run drew: its
/// losses are identical, on the same layout and on another.
#[test]
fn a_resumed_run_draws_the_masks_of_the_uninterrupted_one() {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("switchyard-dropout-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = |c: &TrainConfig<GptConfig>, save_every, resume| {
        let opts = TrainOptions {
            checkpoint_dir: Some(dir.clone()),
            save_every,
            keep: 0,
            resume,
            ..TrainOptions::default()
        };
        let r = train(c, &Corpus::bundled(), &opts).unwrap_or_else(|e| panic!("{e:#}"));
        r.steps.iter().map(|s| s.loss).collect::<Vec<f64>>()
    };
    let mut c = dropped(tiny(1, 2, 2, "1f1b"));
    (c.batch, c.steps) = (8, 6);
    let full = run(&c, 3, None);
    let resumed = run(&c, 0, Some(Resume::Step(3)));
    assert_eq!(resumed, full[3..], "resumed on the same layout");
    let mut other = c.clone();
    (other.dp, other.pp, other.tp) = (2, 1, 1);
    let moved = run(&other, 0, Some(Resume::Step(3)));
    for (step, (g, w)) in moved.iter().zip(&full[3..]).enumerate() {
        assert!((g - w).abs() <= 1e-4 * w, "step {}: {g} vs {w}", step + 3);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rate_outside_zero_to_one_is_refused_before_any_work() {
    for p in [1.0, -0.1, f64::NAN] {
        let mut c = tiny(1, 1, 1, "1f1b");
        c.model.hidden_dropout = p;
        let e = train(&c, &Corpus::bundled(), &TrainOptions::default()).unwrap_err();
        assert!(format!("{e:#}").contains("hidden_dropout"), "{p}: {e:#}");
    }
}
