//! Shared by the parity tests: a tiny configuration, the single-device reference run, and
//! a parallel run that gathers every gradient by name.

#![allow(dead_code)]

use std::collections::HashMap;

use candle_core::Tensor;
use switchyard_comm::local::Launcher;
use switchyard_models::GptConfig;
use switchyard_models::ReferenceGpt;
pub use switchyard_shard::OpsBackend;
use switchyard_shard::ParamSource;
use switchyard_train::data::{Corpus, Dataset, Sampler};
use switchyard_train::optim::{sum_sq, AdamW, LrSchedule};
use switchyard_train::{testing, TrainConfig, Worker};

/// A model small enough for 8 layers on 8 threads to train in milliseconds.
pub fn tiny(dp: usize, pp: usize, tp: usize, schedule: &str) -> TrainConfig<GptConfig> {
    let mut c = TrainConfig::<GptConfig>::default();
    c.model.n_layer = 8;
    c.model.d_model = 16;
    c.model.n_head = 4;
    c.model.block_size = 8;
    c.seq_len = 8;
    c.dp = dp;
    c.pp = pp;
    c.tp = tp;
    c.schedule = schedule.parse().expect("a schedule");
    c.virtual_stages = if schedule == "interleaved" { 2 } else { 1 };
    c.microbatches = 4;
    c.batch = 4 * dp;
    c.steps = 20;
    c.warmup = 3;
    c.lr = 1e-2;
    c.min_lr = 1e-3;
    c.threads_per_worker = 1;
    c
}

/// [`tiny`] with 4 experts (top 2) in blocks 1, 3, 5 and 7, and two sequences a
/// microbatch (the balancing loss is a mean over sequences).
pub fn tiny_moe(dp: usize, pp: usize, tp: usize, schedule: &str) -> TrainConfig<GptConfig> {
    let mut c = tiny(dp, pp, tp, schedule);
    c.batch = 8 * dp;
    c.model.moe = switchyard_models::MoeConfig {
        experts: 4,
        top_k: 2,
        every: 2,
        capacity_factor: 0.0,
        aux_loss_coef: 0.01,
        z_loss_coef: 0.0,
        ffn_hidden: 0,
    };
    c
}

/// [`tiny`] computing with `ops`.
pub fn tiny_ops(
    dp: usize,
    pp: usize,
    tp: usize,
    schedule: &str,
    ops: OpsBackend,
) -> TrainConfig<GptConfig> {
    let mut c = tiny(dp, pp, tp, schedule);
    c.model.ops = ops;
    c
}

/// Checks one step of `cfg` with the composed ops against the same step with the fused
/// ops: the loss and every gradient within `tol`.
pub fn assert_composed_matches_fused(cfg: &TrainConfig<GptConfig>, tol: f64) {
    let mut fused = cfg.clone();
    fused.model.ops = OpsBackend::Fused;
    let mut composed = cfg.clone();
    composed.model.ops = OpsBackend::Composed;
    let (want_loss, want) = parallel_step(&fused, 0);
    let (loss, got) = parallel_step(&composed, 0);
    let what = format!("dp {} pp {} tp {} {}", cfg.dp, cfg.pp, cfg.tp, cfg.schedule);
    let lerr = (loss - want_loss).abs() / want_loss.abs();
    assert!(
        lerr <= tol,
        "{what}: composed loss {loss} vs fused {want_loss} (rel {lerr:.2e})"
    );
    assert_eq!(got.len(), want.len(), "{what}: other parameters");
    for (n, w) in &want {
        let e = rel_err(&got[n], w);
        assert!(
            e <= tol,
            "{what}: composed gradient of {n} differs from the fused one by {e:.2e} (relative)"
        );
    }
}

/// The initial full weights of `cfg` by name, as one device holds them.
pub fn initial_weights(cfg: &TrainConfig<GptConfig>) -> HashMap<String, Tensor> {
    testing::initial_weights(cfg).unwrap().into_iter().collect()
}

/// The reference's loss and gradients on step `step`'s global batch.
pub fn reference_step(
    cfg: &TrainConfig<GptConfig>,
    weights: &HashMap<String, Tensor>,
    step: usize,
) -> (f64, HashMap<String, Tensor>) {
    let mut model = ReferenceGpt::new(&cfg.model, weights).unwrap();
    model.set_dropout_step(cfg.seed, step as u64);
    let (x, y) = Corpus::bundled()
        .batch(&Sampler::of(cfg), step, 0..cfg.batch)
        .unwrap();
    model.loss_and_grads(&x, &y).unwrap()
}

/// The reference trained for `cfg.steps` steps with the trainer's optimizer rules.
pub fn reference_curve(cfg: &TrainConfig<GptConfig>) -> Vec<f64> {
    let mut model = ReferenceGpt::new(&cfg.model, &initial_weights(cfg)).unwrap();
    let mut names: Vec<&String> = model.params().keys().collect();
    names.sort();
    let vars: Vec<_> = names.iter().map(|n| model.params()[*n].clone()).collect();
    let mut opt = AdamW::new(vars.clone(), cfg.adamw());
    let sched = LrSchedule {
        max_lr: cfg.lr,
        min_lr: cfg.min_lr,
        warmup: cfg.warmup,
        total: cfg.steps,
    };
    let corpus = Corpus::bundled();
    let mut losses = Vec::new();
    for step in 0..cfg.steps {
        model.set_dropout_step(cfg.seed, step as u64);
        let (x, y) = corpus.batch(&Sampler::of(cfg), step, 0..cfg.batch).unwrap();
        let (loss, objective) = model.objective(&x, &y).unwrap();
        let g = objective.backward().unwrap();
        let mut grads: Vec<Option<Tensor>> =
            vars.iter().map(|v| g.get(v.as_tensor()).cloned()).collect();
        let norm = grads
            .iter()
            .flatten()
            .map(|t| sum_sq(t).unwrap())
            .sum::<f64>()
            .sqrt();
        if cfg.grad_clip > 0.0 && norm > cfg.grad_clip {
            let s = cfg.grad_clip / (norm + 1e-6);
            for t in grads.iter_mut().flatten() {
                *t = t.affine(s, 0.0).unwrap();
            }
        }
        opt.step(&grads, sched.at(step)).unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap() as f64);
    }
    losses
}

/// Trains `cfg` and checks its loss at every step against `want` (a reference curve)
/// within `tol`, relative.
pub fn assert_curve(cfg: &TrainConfig<GptConfig>, want: &[f64], tol: f64) {
    let report = switchyard_train::train(
        cfg,
        &Corpus::bundled(),
        &switchyard_train::TrainOptions::default(),
    )
    .unwrap();
    assert_eq!(report.steps.len(), want.len());
    for (step, (r, w)) in report.steps.iter().zip(want).enumerate() {
        let e = (r.loss - w).abs() / w.abs();
        assert!(
            e <= tol,
            "dp {} pp {} tp {} ep {} {}: step {step} loss {} vs reference {w} (rel {e:.2e})",
            cfg.dp,
            cfg.pp,
            cfg.tp,
            cfg.ep,
            cfg.schedule,
            r.loss
        );
    }
}

/// One parallel step of `cfg`: the job's mean loss and every full gradient by name
/// (after the tied and data-parallel sums, before clipping).
pub fn parallel_step(cfg: &TrainConfig<GptConfig>, step: usize) -> (f64, HashMap<String, Tensor>) {
    let out =
        testing::parallel_step(cfg, &Corpus::bundled(), step).unwrap_or_else(|e| panic!("{e:#}"));
    (out.loss, out.grads.into_iter().collect())
}

/// `max |a − b| / max |b|` over the tensor.
pub fn rel_err(a: &Tensor, b: &Tensor) -> f64 {
    testing::rel_err(a, b).unwrap()
}

/// Checks one step of `cfg` against the reference: loss and every gradient within `tol`.
pub fn assert_step_parity(cfg: &TrainConfig<GptConfig>, tol: f64) {
    let weights = initial_weights(cfg);
    let (want_loss, want) = reference_step(cfg, &weights, 0);
    let (loss, got) = parallel_step(cfg, 0);
    let what = format!(
        "dp {} pp {} tp {} {} ops {}",
        cfg.dp, cfg.pp, cfg.tp, cfg.schedule, cfg.model.ops
    );
    let lerr = (loss - want_loss).abs() / want_loss.abs();
    assert!(
        lerr <= tol,
        "{what}: loss {loss} vs reference {want_loss} (rel {lerr:.2e})"
    );
    let mut names: Vec<_> = want.keys().cloned().collect();
    names.sort();
    let mut got_names: Vec<_> = got.keys().cloned().collect();
    got_names.sort();
    assert_eq!(
        got_names, names,
        "{what}: the parallel model has other parameters"
    );
    for n in &names {
        let e = rel_err(&got[n], &want[n]);
        assert!(
            e <= tol,
            "{what}: gradient of {n} differs by {e:.2e} (relative)"
        );
    }
}

/// Trains `cfg` for `steps` steps and returns, for every parameter with a padded
/// vocabulary (`ShardSpec::Padded`), its padding rows on every rank that holds any.
pub fn padding_after_steps(
    cfg: &TrainConfig<GptConfig>,
    steps: usize,
) -> Vec<(String, Vec<Vec<f32>>)> {
    let corpus = Corpus::bundled();
    let outs = Launcher::new(cfg.world_size())
        .threads_per_worker(1)
        .run(|world| {
            let mut w = Worker::new(world, cfg, &corpus, ParamSource::Init { seed: cfg.seed })?;
            for step in 0..steps {
                w.step(step)?
                    .map_err(|e| anyhow::anyhow!("step {}: not finite", e.step))?;
            }
            let (rank, n) = (w.mesh.coord.tp, cfg.tp);
            let mut out = Vec::new();
            for p in w.params() {
                let Some((c, real)) = p.spec.padded_rows(rank, n) else {
                    continue;
                };
                if real < c {
                    let rows = p.var.as_tensor().narrow(0, real, c - real)?;
                    out.push((format!("{} tp rank {rank}", p.name), rows.to_vec2::<f32>()?));
                }
            }
            Ok::<_, anyhow::Error>(out)
        })
        .unwrap_or_else(|e| panic!("{e}"));
    outs.into_iter().flatten().collect()
}

/// No hangs: `c` (two workers) trains a step; then rank 1 fails on purpose and rank 0's
/// next step must fail too, with an error naming each of `want` (the operation, the
/// ranks), not wait for it.
pub fn assert_a_failed_rank_fails_the_other(c: &TrainConfig<GptConfig>, want: &[&str]) {
    assert_eq!(c.world_size(), 2, "two workers");
    let corpus = Corpus::bundled();
    let outcomes = Launcher::new(c.world_size())
        .threads_per_worker(1)
        .run_each(|world: std::sync::Arc<dyn switchyard_comm::Communicator>| {
            let me = world.rank();
            let mut w = Worker::new(world, c, &corpus, ParamSource::Init { seed: c.seed })?;
            w.step(0)?.expect("finite");
            if me == 1 {
                return Err(switchyard_train::TrainError::Config(
                    "rank 1 fails on purpose".into(),
                ));
            }
            w.step(1)?.expect("finite");
            Ok(())
        });
    let e = outcomes[0]
        .as_ref()
        .expect_err("rank 0 cannot finish its step");
    for w in want {
        assert!(e.message.contains(w), "{w:?} in {}", e.message);
    }
    let e = outcomes[1].as_ref().expect_err("rank 1 failed");
    assert!(e.message.contains("on purpose"), "{}", e.message);
}

/// `cfg` with ZeRO stage `zero`.
pub fn with_zero(cfg: &TrainConfig<GptConfig>, zero: u8) -> TrainConfig<GptConfig> {
    TrainConfig {
        zero,
        ..cfg.clone()
    }
}
