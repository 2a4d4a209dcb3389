//! ZeRO stages 1 and 2 (issue 16 §2): the same training as `--zero 0`, with the
//! optimizer state cut into `1/dp` per replica.
//!
//! - parity: the losses of 20 steps and every parameter after them equal `--zero 0`
//!   within 1e-6 relative, for dp 2 and 4, dp 2 × pp 2 and dp 2 × tp 2 (and dp 3, whose
//!   buckets need padding), with clipping and weight decay on; every replica ends with
//!   bit-identical parameters;
//! - the optimizer keeps `1/dp` of the moments (padding aside);
//! - communication, counted by `switchyard_comm::Counting`: the reduce-scatter and
//!   all-gather move what the all-reduce moved (up to the padding, exactly);
//! - checkpoints: a ZeRO checkpoint resumes without ZeRO on another layout and the other
//!   way round, continuing the same run.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::common::*;
use candle_core::Tensor;
use switchyard_comm::local::Launcher;
use switchyard_comm::{Communicator, Counting, Traffic};
use switchyard_models::GptConfig;
use switchyard_shard::{gather_full_tensor, ParamSource};
use switchyard_train::data::Corpus;
use switchyard_train::testing::{schedules, LAYOUTS};
use switchyard_train::zero::{Layout, Units};
use switchyard_train::{train, Recompute, Resume, TrainConfig, TrainError, TrainOptions, Worker};

/// What a run of `steps` steps left: the losses, every replica's full parameters by
/// name, and each rank's moment elements.
struct Run {
    losses: Vec<f64>,
    /// The global gradient norm of every step.
    norms: Vec<f64>,
    /// Per data-parallel replica, the full parameters (gathered over tp, from every
    /// pipeline rank).
    replicas: Vec<BTreeMap<String, Tensor>>,
    moment_elems: Vec<usize>,
}

fn run_steps(cfg: &TrainConfig<GptConfig>, steps: usize) -> Run {
    let corpus = Corpus::bundled();
    let outs = Launcher::new(cfg.world_size())
        .threads_per_worker(1)
        .run(|world| {
            let mut w = Worker::new(world, cfg, &corpus, ParamSource::Init { seed: cfg.seed })?;
            let mut losses = Vec::new();
            for step in 0..steps {
                let m = w.step(step)?.map_err(|e| {
                    TrainError::Config(format!("step {}: not finite on rank {}", e.step, e.rank))
                })?;
                losses.push((m.loss, m.grad_norm));
            }
            let tp = w.mesh.tp.clone();
            // ZeRO 3 keeps shards: gathered whole for the comparison.
            let full = w.gathered(|| {
                w.params()
                    .iter()
                    .map(|p| {
                        Ok((
                            p.name.clone(),
                            gather_full_tensor(&*tp, &p.spec, p.var.as_tensor())?,
                        ))
                    })
                    .collect::<Result<Vec<_>, TrainError>>()
            })?;
            Ok::<_, TrainError>((w.mesh.coord, losses, full, w.opt.moment_elems()))
        })
        .unwrap_or_else(|e| panic!("{e:#}"));
    let mut replicas = vec![BTreeMap::new(); cfg.dp];
    let mut losses: Vec<(f64, f64)> = Vec::new();
    let mut moment_elems = Vec::new();
    for (coord, l, full, elems) in outs {
        if losses.is_empty() {
            losses = l;
        }
        replicas[coord.dp].extend(full);
        moment_elems.push(elems);
    }
    Run {
        norms: losses.iter().map(|l| l.1).collect(),
        losses: losses.iter().map(|l| l.0).collect(),
        replicas,
        moment_elems,
    }
}

/// `cfg` without ZeRO, all-reducing the gradients over the rank's `dp` group in
/// `bucket_mib` buckets after the backward: the traffic ZeRO's is compared with
/// (overlapped, the all-reduces go block by block over the communication thread's own
/// group: tests/overlap.rs counts those).
fn all_reduce_after_backward(cfg: &TrainConfig<GptConfig>) -> TrainConfig<GptConfig> {
    TrainConfig {
        zero: 0,
        overlap_grad_reduce: false,
        ..cfg.clone()
    }
}

/// 20 steps of `cfg` with ZeRO 1, 2 and 3 against `--zero 0`.
///
/// Stage 1 sums each gradient in the same order as `--zero 0` (the microbatches on each
/// replica, then the replicas), so everything agrees within 1e-6: losses, gradient
/// norms and parameters. Stages 2 and 3 reduce-scatter every microbatch's gradients
/// as the backward makes them (that is their memory saving), so they sum the replicas
/// first and the microbatches after: the same sum in another order. Losses and the
/// global gradient norm of every step still agree within 1e-6; the parameters are
/// compared within 1e-6 with one microbatch per replica, where the order is the same.
/// (With several, parameters whose true gradient is zero, such as the attention's key
/// bias, follow the rounding noise of their gradient through AdamW's normalisation,
/// and a different summation order moves them by up to 1e-4 of the tensor's largest
/// value in 20 steps, as it does between two data-parallel layouts.)
fn assert_zero_parity(cfg: &TrainConfig<GptConfig>) {
    let what = format!("dp {} pp {} tp {}", cfg.dp, cfg.pp, cfg.tp);
    let want = run_steps(&with_zero(cfg, 0), 20);
    assert!(
        want.losses[19] < want.losses[0] - 0.3,
        "{what}: the run must learn: {:?}",
        want.losses
    );
    let one = TrainConfig {
        microbatches: 1,
        ..cfg.clone()
    };
    let want_one = run_steps(&with_zero(&one, 0), 20);
    for zero in [1, 2, 3] {
        let what = format!("{what} zero {zero}");
        let got = run_steps(&with_zero(cfg, zero), 20);
        assert_same_curves(&what, &got, &want);
        // The parameters where the order of the sums is the same.
        match zero {
            1 => assert_same_params(&what, &got, &want),
            _ => {
                let got_one = run_steps(&with_zero(&one, zero), 20);
                assert_same_curves(&format!("{what} m 1"), &got_one, &want_one);
                assert_same_params(&format!("{what} m 1"), &got_one, &want_one);
            }
        }
        // The optimizer keeps 1/dp of the moments, plus at most dp − 1 elements of
        // padding per bucket.
        let full: usize = want.moment_elems.iter().sum();
        let sharded: usize = got.moment_elems.iter().sum();
        assert!(
            sharded * cfg.dp >= full && sharded * cfg.dp <= full + 64 * cfg.dp * cfg.dp,
            "{what}: {sharded} moment elements over all ranks, {full} without ZeRO"
        );
    }
}

/// Losses and global gradient norms of every step within 1e-6 relative.
fn assert_same_curves(what: &str, got: &Run, want: &Run) {
    for (step, ((g, w), (gn, wn))) in got
        .losses
        .iter()
        .zip(&want.losses)
        .zip(got.norms.iter().zip(&want.norms))
        .enumerate()
    {
        let e = (g - w).abs() / w.abs();
        assert!(e <= 1e-6, "{what}: step {step} loss {g} vs {w} ({e:.2e})");
        let e = (gn - wn).abs() / wn.abs();
        assert!(
            e <= 1e-6,
            "{what}: step {step} gradient norm {gn} vs {wn} ({e:.2e})"
        );
    }
}

/// Every parameter within 1e-6 relative, and every replica's the same bit for bit.
fn assert_same_params(what: &str, got: &Run, want: &Run) {
    for (name, w) in &want.replicas[0] {
        let g = &got.replicas[0][name];
        let e = rel_err(g, w);
        assert!(
            e <= 1e-6,
            "{what}: {name} after 20 steps differs by {e:.2e}"
        );
        for (r, rep) in got.replicas.iter().enumerate().skip(1) {
            let d = (&rep[name] - g)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(d, 0.0, "{what}: {name} on replica {r}");
        }
    }
}

#[test]
fn zero_trains_the_same_model_with_dp_2_and_4() {
    for dp in [2, 4] {
        assert_zero_parity(&tiny(dp, 1, 1, "1f1b"));
    }
}

#[test]
fn zero_composes_with_a_pipeline_and_tensor_parallelism() {
    assert_zero_parity(&tiny(2, 2, 1, "1f1b"));
    assert_zero_parity(&tiny(2, 1, 2, "1f1b"));
}

#[test]
fn zero_with_padded_buckets_ties_and_decay_on_every_parameter() {
    // dp 3 does not divide the buckets of a width-16 model: the shards end in padding.
    // Small buckets (one or a few tensors each), tied embeddings across two stages, and
    // weight decay on the biases and gains too.
    let mut c = tiny(3, 2, 1, "1f1b");
    c.bucket_mib = 0.01;
    c.model.tied_embeddings = true;
    c.decay = switchyard_train::optim::Decay::All;
    let layout = Layout::new(&[4096, 128, 48], &[], c.bucket_mib, 3, 0);
    assert!(layout.buckets.iter().any(|b| b.padded() != b.len));
    assert_zero_parity(&c);
}

#[test]
fn zero_two_and_three_work_with_every_layout_schedule_and_recomputation() {
    // Every layout with data parallelism, under every schedule, with each recomputation:
    // the losses and gradient norms of `--zero 0` (see `assert_zero_parity` for why not
    // the parameters bit for bit).
    for (dp, pp, tp) in LAYOUTS.into_iter().filter(|l| l.0 > 1) {
        for s in schedules(pp) {
            for recompute in Recompute::ALL {
                let mut c = tiny(dp, pp, tp, s);
                c.recompute = recompute;
                let want = run_steps(&c, 4);
                for zero in [2, 3] {
                    let what =
                        format!("dp {dp} pp {pp} tp {tp} {s} recompute {recompute} zero {zero}");
                    assert_same_curves(&what, &run_steps(&with_zero(&c, zero), 4), &want);
                }
            }
        }
    }
    // The composed ops use the parameters' own storage (nothing fused to refill), and a
    // table tied to the head on one stage stays whole for the step.
    for (layout, tied) in [((2, 2, 2), false), ((2, 1, 1), true)] {
        let mut c = tiny_ops(layout.0, layout.1, layout.2, "1f1b", OpsBackend::Composed);
        c.model.tied_embeddings = tied;
        let want = run_steps(&c, 4);
        for zero in [2, 3] {
            let what = format!("{layout:?} composed tied {tied} zero {zero}");
            assert_same_curves(&what, &run_steps(&with_zero(&c, zero), 4), &want);
        }
    }
}

/// The traffic of one rank's data-parallel group over `steps` steps (all-reduce,
/// reduce-scatter, all-gather, and the all-gather of ZeRO 3's prefetch thread), and the
/// rank's ZeRO layout of its parameters.
#[allow(clippy::type_complexity)]
fn dp_traffic(
    cfg: &TrainConfig<GptConfig>,
    steps: usize,
) -> Vec<(usize, [Traffic; 5], Vec<usize>, Option<Units>)> {
    let corpus = Corpus::bundled();
    Launcher::new(cfg.world_size())
        .threads_per_worker(1)
        .run(|world: Arc<dyn Communicator>| {
            let (world, counts) = Counting::wrap_groups(world);
            let mut w = Worker::new(world, cfg, &corpus, ParamSource::Init { seed: cfg.seed })?;
            for step in 0..steps {
                w.step(step)?.expect("finite");
            }
            let t = |op| counts.traffic("dp", op);
            // ZeRO 2 and 3's reduce-scatters on their thread (`overlap_grad_reduce`).
            let thread = counts.traffic("dp/zero-scatter", "reduce_scatter");
            let rs = t("reduce_scatter");
            let rs_all = Traffic {
                calls: rs.calls + thread.calls,
                bytes: rs.bytes + thread.bytes,
            };
            let sizes = w.params().iter().map(|p| p.var.elem_count()).collect();
            Ok::<_, TrainError>((
                w.mesh.world.rank(),
                [
                    t("all_reduce"),
                    rs_all,
                    t("all_gather"),
                    counts.traffic("dp/prefetch", "all_gather"),
                    thread,
                ],
                sizes,
                w.zero_units().cloned(),
            ))
        })
        .unwrap_or_else(|e| panic!("{e:#}"))
}

#[test]
fn zero_moves_the_bytes_of_the_all_reduce() {
    for (dp, pp, tp, bucket_mib) in [
        (2, 1, 1, 25.0),
        (4, 1, 1, 0.01),
        (3, 1, 1, 0.01),
        (2, 2, 2, 0.01),
    ] {
        let mut c = tiny(dp, pp, tp, "1f1b");
        c.bucket_mib = bucket_mib;
        let steps = 2;
        let base = dp_traffic(&all_reduce_after_backward(&c), steps);
        // Stage 1: the buckets of stage 0, reduce-scattered and gathered once a step.
        let zero = 1;
        let got = dp_traffic(&with_zero(&c, zero), steps);
        for ((rank, want, sizes, _), (_, [ar, rs, ag, ..], _, _)) in base.iter().zip(&got) {
            let what = format!("dp {dp} pp {pp} tp {tp} zero {zero} rank {rank}");
            let layout = Layout::new(sizes, &[], bucket_mib, dp, 0);
            let n = layout.buckets.len();
            let len: usize = layout.buckets.iter().map(|b| b.len).sum();
            let padded: usize = layout.buckets.iter().map(|b| b.padded()).sum();
            // Without ZeRO: one all-reduce of every bucket per step.
            assert_eq!(
                want[0],
                Traffic {
                    calls: n * steps,
                    bytes: (4 * len * steps) as u128
                },
                "{what}: the all-reduce"
            );
            assert_eq!(want[1].calls + want[2].calls, 0, "{what}");
            // With ZeRO: no all-reduce on dp; one reduce-scatter of every padded
            // bucket (f32 gradients) and one all-gather of every padded bucket (f32
            // parameters) per step.
            assert_eq!(ar.calls, 0, "{what}: an all-reduce");
            let once = Traffic {
                calls: n * steps,
                bytes: (4 * padded * steps) as u128,
            };
            assert_eq!(*rs, once, "{what}: the reduce-scatter");
            assert_eq!(*ag, once, "{what}: the all-gather");
            // On a ring each rank sends (dp − 1)/dp of a reduce-scatter's and of an
            // all-gather's bytes and 2·(dp − 1)/dp of an all-reduce's: the same
            // bytes, but for the padding (dp − 1)/dp · 2 · 4 · (padded − len).
            let ring = |t: &Traffic, k: u128| t.bytes * k * (dp as u128 - 1);
            assert_eq!(
                ring(rs, 1) + ring(ag, 1),
                ring(&want[0], 2) + (2 * 4 * (padded - len) * steps) as u128 * (dp as u128 - 1),
                "{what}: the ring's bytes × dp"
            );
            if dp == 2 || dp == 4 {
                assert_eq!(padded, len, "{what}: a width-16 model needs no padding");
            } else {
                assert!(padded > len, "{what}: dp 3 pads");
            }
        }
    }
}

#[test]
fn zero_two_and_three_scatter_every_microbatch_and_three_gathers_every_use() {
    for (dp, pp, tp, schedule, recompute) in [
        (2, 1, 1, "1f1b", Recompute::None),
        (3, 2, 1, "1f1b", Recompute::Full),
        (2, 2, 2, "zb-h1", Recompute::None),
        (2, 2, 1, "interleaved", Recompute::Selective),
    ] {
        let mut c = tiny(dp, pp, tp, schedule);
        c.recompute = recompute;
        c.model.tied_embeddings = true;
        let (steps, m) = (2, c.microbatches);
        let base = dp_traffic(&all_reduce_after_backward(&c), steps);
        for (zero, prefetch, overlap) in [
            (2, false, true),
            (2, false, false),
            (3, false, true),
            (3, true, false),
            (3, true, true),
        ] {
            let mut z = with_zero(&c, zero);
            z.zero_prefetch = prefetch;
            z.overlap_grad_reduce = overlap;
            let got = dp_traffic(&z, steps);
            for ((rank, want, ..), (_, [ar, rs, ag, ahead, thread], sizes, units)) in
                base.iter().zip(&got)
            {
                let what = format!(
                    "dp {dp} pp {pp} tp {tp} {schedule} zero {zero} prefetch {prefetch} \
                     overlap {overlap} rank {rank}"
                );
                let units = units.as_ref().expect("units under ZeRO 2 and 3");
                let layout = Layout::of_groups(units.groups.clone(), sizes, &[], dp, 0);
                let bytes = |k: usize| 4 * layout.buckets[k].padded();
                let segments: Vec<usize> = units.bucket_of.values().copied().collect();
                assert_eq!(
                    segments.len() + units.resident.len(),
                    layout.buckets.len(),
                    "{what}"
                );
                // A tied table is resident (its copies are summed across stages first).
                assert!(!units.resident.is_empty(), "{what}: the tied table");
                // `ks`' buckets, `times` a step, over `steps` steps.
                let sum = |ks: &[usize], times: usize, steps: usize| Traffic {
                    calls: ks.len() * times * steps,
                    bytes: (ks.iter().map(|&k| bytes(k)).sum::<usize>() * times * steps) as u128,
                };
                let add = |a: Traffic, b: Traffic| Traffic {
                    calls: a.calls + b.calls,
                    bytes: a.bytes + b.bytes,
                };
                assert_eq!(ar.calls, 0, "{what}: an all-reduce");
                assert!(want[0].calls > 0, "{what}: zero 0 all-reduces");
                // Each segment's bucket once per microbatch as its backward ends; the
                // resident ones once per step.
                let scatter = add(sum(&segments, m, steps), sum(&units.resident, 1, steps));
                assert_eq!(*rs, scatter, "{what}: the reduce-scatter");
                // With overlap the segments' go on the thread, the resident ones not.
                let threaded = match overlap {
                    true => sum(&segments, m, steps),
                    false => Traffic::default(),
                };
                assert_eq!(
                    *thread, threaded,
                    "{what}: the reduce-scatters on the thread"
                );
                // Stage 2 gathers the updated shards once per step; stage 3 gathers a
                // segment's parameters before its forward and before its backward (a
                // recomputed forward runs inside the backward's), the resident ones once.
                let gather = match zero {
                    2 => sum(&(0..layout.buckets.len()).collect::<Vec<_>>(), 1, steps),
                    _ => add(sum(&segments, 2 * m, steps), sum(&units.resident, 1, steps)),
                };
                assert_eq!(add(*ag, *ahead), gather, "{what}: the all-gather");
                // The prefetch thread gathers every segment's bucket from the second
                // step on (the first records the order); nothing without it.
                let prefetched = match prefetch {
                    true => sum(&segments, 2 * m, steps - 1),
                    false => Traffic::default(),
                };
                assert_eq!(*ahead, prefetched, "{what}: the prefetched all-gathers");
            }
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-zero-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run_with_checkpoints(
    cfg: &TrainConfig<GptConfig>,
    dir: &Path,
    save_every: usize,
    resume: Option<Resume>,
) -> Vec<f64> {
    let opts = TrainOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        save_every,
        keep: 0,
        resume,
        ..TrainOptions::default()
    };
    let r = train(cfg, &Corpus::bundled(), &opts).unwrap_or_else(|e| panic!("{e:#}"));
    r.steps.iter().map(|s| s.loss).collect()
}

#[test]
fn a_zero_checkpoint_resumes_on_any_layout_and_stage() {
    // A fixed global batch of 8 sequences, whatever the layout.
    let cfg = |dp, pp, tp, zero| {
        let mut c = tiny(dp, pp, tp, "1f1b");
        c.batch = 8;
        c.microbatches = 2;
        c.steps = 8;
        c.zero = zero;
        c
    };
    for (from, to) in [
        (cfg(2, 1, 1, 1), cfg(1, 1, 1, 0)),
        (cfg(2, 2, 1, 2), cfg(4, 1, 1, 1)),
        (cfg(1, 2, 2, 0), cfg(2, 1, 2, 2)),
        (cfg(2, 2, 1, 3), cfg(1, 2, 2, 0)),
        (cfg(2, 1, 2, 0), cfg(2, 2, 1, 3)),
    ] {
        let what = format!(
            "dp {} pp {} tp {} zero {} → dp {} pp {} tp {} zero {}",
            from.dp, from.pp, from.tp, from.zero, to.dp, to.pp, to.tp, to.zero
        );
        let dir = scratch(&format!("{}-{}-{}-{}", from.dp, from.pp, from.zero, to.dp));
        let full = run_with_checkpoints(&from, &dir, 4, None);
        // The files hold whole moments, as without ZeRO.
        let ck = switchyard_train::checkpoint::Checkpoint::open(&dir.join("step-00000004"))
            .unwrap_or_else(|e| panic!("{what}: {e:#}"));
        let state = ck.load_full().unwrap();
        for (name, p) in &state.params {
            assert_eq!(state.m[name].dims(), p.dims(), "{what}: {name}");
        }
        let resumed = run_with_checkpoints(&to, &dir, 0, Some(Resume::Step(4)));
        assert_eq!(resumed.len(), 4);
        for (k, (r, f)) in resumed.iter().zip(&full[4..]).enumerate() {
            let e = (r - f).abs() / f.abs();
            assert!(
                e <= 1e-5,
                "{what}: step {} loss {r} vs {f} ({e:.2e})",
                k + 4
            );
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_zero_checkpoint_holds_the_moments_of_an_unsharded_run() {
    // One microbatch per replica: every stage sums the gradients in the same order.
    let mut c = tiny(2, 1, 2, "1f1b");
    c.batch = 8;
    c.microbatches = 1;
    c.steps = 3;
    let state = |zero: u8| {
        let dir = scratch(&format!("moments-{zero}"));
        run_with_checkpoints(&with_zero(&c, zero), &dir, 0, None);
        let ck =
            switchyard_train::checkpoint::Checkpoint::open(&dir.join("step-00000003")).unwrap();
        assert_eq!(ck.manifest.optimizer_t, 3);
        let s = ck.load_full().unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        s
    };
    let want = state(0);
    for zero in [1, 2, 3] {
        let got = state(zero);
        assert_eq!(got.m.len(), want.m.len());
        for (name, w) in &want.m {
            for (what, g, w) in [
                ("m", &got.m[name], w),
                ("v", &got.v[name], &want.v[name]),
                ("value", &got.params[name], &want.params[name]),
            ] {
                assert_eq!(g.dims(), w.dims(), "zero {zero}: {name} {what}");
                let e = rel_err(g, w);
                assert!(e <= 1e-6, "zero {zero}: {name} {what} differs by {e:.2e}");
            }
        }
    }
}

#[test]
fn zero_on_the_same_layout_resumes_bit_exact() {
    let mut c = tiny(2, 1, 1, "1f1b");
    c.batch = 8;
    c.steps = 8;
    for zero in [2, 3] {
        c.zero = zero;
        let dir = scratch(&format!("same-{zero}"));
        let full = run_with_checkpoints(&c, &dir, 4, None);
        let resumed = run_with_checkpoints(&c, &dir, 0, Some(Resume::Step(4)));
        assert_eq!(resumed, full[4..], "zero {zero}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn a_non_finite_gradient_stops_every_rank_under_zero() {
    for zero in [1, 2, 3] {
        let mut cfg = tiny(2, 2, 1, "1f1b");
        cfg.zero = zero;
        cfg.lr = 1e30;
        cfg.min_lr = 1e30;
        cfg.warmup = 0;
        cfg.grad_clip = 0.0;
        cfg.steps = 5;
        let e = train(&cfg, &Corpus::bundled(), &TrainOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("step 1: non-finite values first appeared on rank"),
            "zero {zero}: {e}"
        );
    }
}

/// No hangs: a replica that fails while the others' prefetch threads gather from it
/// makes every other replica's step return an error that names the gather, the rank
/// and the failed peer.
#[test]
fn a_replica_that_fails_mid_prefetch_fails_the_others_cleanly() {
    let c = with_zero(&tiny(2, 1, 1, "1f1b"), 3);
    assert!(c.zero_prefetch, "the default");
    // Rank 0's second step starts by prefetching its first segment from rank 1.
    assert_a_failed_rank_fails_the_other(
        &c,
        &[
            "ZeRO 3: prefetching bucket",
            "all_gather",
            "rank 0",
            "rank 1",
        ],
    );
}
