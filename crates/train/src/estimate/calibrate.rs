//! Calibration of the step-time model ([`super::time`]): this machine's rates, measured
//! in a few seconds by timing a small probe model, AdamW, and messages and all-reduces
//! between two in-process ranks. Everything here starts threads and times them; the
//! predictions themselves live in `time.rs`.

use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use switchyard_comm::{local::Launcher, threads, Communicator, ReduceOp};
use switchyard_models::{plan_stages, Model, ModelStage, SplitSpec};
use switchyard_pipeline::Stage;
use switchyard_shard::{single_device, ParamSource, ParamStore};

use super::time::{predict_step_time, stage_flops, AlphaBeta, PartCurve, TimeModel};
use crate::data::Corpus;
use crate::error::{err, TrainError};
use crate::optim::{AdamW, AdamWConfig};
use crate::{TrainConfig, TrainOptions};

impl TimeModel {
    /// Measures this machine's rates in a few seconds. `probe(d, T)` is a small model of
    /// the kind to predict (the same ops backend): 2 layers of width `d`, taking
    /// sequences of `T` tokens. Timed: one microbatch's forward and backward of the
    /// probe at widths 32, 128 and 256 and two or three lengths each, on one thread and
    /// on two when there are two cores, in two rounds (the curves `S₁` and `e`), and the forward alone
    /// at one size (`φ`); AdamW with the gradient norm and clipping over a million
    /// parameters in 4 and in 256 tensors (`a`, `a_t`); messages and all-reduces of
    /// three sizes between two ranks of the in-process threads backend (`α`, `β`, least
    /// squares); a step's fixed costs, by training a model of almost no FLOPs on one
    /// worker and on two (`o_step`, `o_world`).
    pub fn calibrate<M: Model>(
        probe: impl Fn(usize, usize) -> M + Sync,
    ) -> Result<TimeModel, TrainError> {
        // Per width d: (T, sequences per microbatch), from launch-bound to FLOP-bound.
        let grid: [(usize, &[(usize, usize)]); 3] = [
            (32, &[(16, 1), (16, 8), (16, 32)]),
            (128, &[(64, 1), (64, 4), (64, 16)]),
            (256, &[(128, 1), (128, 4)]),
        ];
        let time_all = |threads: usize| {
            on_pool(threads, || {
                grid.iter()
                    .map(|&(d, sizes)| {
                        sizes
                            .iter()
                            .map(|&(t, b)| time_probe(&probe(d, t), t, b, false))
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .collect::<Result<Vec<_>, _>>()
            })
        };
        // Two rounds, one thread then two, keeping each size's faster: a burst of other
        // work on the machine rarely spans both.
        let two_cores = threads::available_cores() >= 2;
        let (mut one, mut two) = (time_all(1)?, two_cores.then(|| time_all(2)).transpose()?);
        merge_faster(&mut one, time_all(1)?);
        if let Some(two) = &mut two {
            merge_faster(two, time_all(2)?);
        }
        // Two workers at once, a thread each: what sharing the machine costs.
        let concurrent = match two_cores {
            true => Some(std::thread::scope(|s| {
                let other = s.spawn(|| time_all(1));
                let mine = time_all(1);
                other
                    .join()
                    .unwrap_or_else(|_| Err(err!(Config, "the calibration thread panicked")))?;
                mine
            })?),
            false => None,
        };
        let curves: Vec<PartCurve> = grid
            .iter()
            .enumerate()
            .map(|(i, &(width, _))| PartCurve {
                concurrent_slowdown: match &concurrent {
                    Some(c) => c[i]
                        .iter()
                        .zip(&one[i])
                        .map(|(c, one)| (c.seconds / one.seconds).max(1.0))
                        .collect(),
                    None => Vec::new(),
                },
                width,
                points: one[i]
                    .iter()
                    .map(|r| (r.flops / r.parts, r.seconds / r.parts))
                    .collect(),
                thread_efficiency: match &two {
                    Some(two) => two[i]
                        .iter()
                        .zip(&one[i])
                        .map(|(two, one)| (one.seconds / two.seconds - 1.0).clamp(0.0, 1.0))
                        .collect(),
                    None => vec![0.0; one[i].len()],
                },
            })
            .collect();
        let forward_fraction = on_pool(1, || {
            let run = time_probe(&probe(128, 64), 64, 4, true)?;
            Ok((run.forward / run.seconds).clamp(0.05, 0.95))
        })?;
        // A million parameters in 4 tensors, then in 256: per element, per tensor.
        let (few, many) = on_pool(1, || Ok((time_optimizer(4)?, time_optimizer(256)?)))?;
        let optimizer_s_per_param = few / (1 << 20) as f64;
        let optimizer_s_per_tensor = ((many - few) / 252.0).max(0.0);
        let (p2p, collective) = time_comm()?;
        let mut tm = TimeModel {
            flops_per_s_per_thread: curves[curves.len() - 1].rate(),
            overhead_per_part_s: curves[0].overhead(),
            curves,
            forward_fraction,
            optimizer_s_per_param,
            optimizer_s_per_tensor,
            p2p,
            collective,
            dp_collective: None,
            step_overhead_s: 0.0,
            world_overhead_s: 0.0,
            cores: Some(threads::available_cores()),
        };
        // A step's fixed costs: what training a model of almost no FLOPs takes beyond
        // what the rest of the model predicts for it, on one worker, then on two.
        tm.step_overhead_s = step_overhead(&probe, 1, &tm)?;
        if two_cores {
            tm.world_overhead_s = step_overhead(&probe, 2, &tm)?;
        }
        Ok(tm)
    }
}

/// How much longer than `tm` predicts a training step of `dp` data-parallel workers
/// (one thread each) takes on a model of almost no FLOPs (`probe(16, 8)`, 2 sequences of
/// 8 tokens a replica): the faster of two runs' medians over 15 steps after 5, at least 0.
fn step_overhead<M: Model>(
    probe: &impl Fn(usize, usize) -> M,
    dp: usize,
    tm: &TimeModel,
) -> Result<f64, TrainError> {
    let cfg = TrainConfig {
        dp,
        pp: 1,
        tp: 1,
        microbatches: 1,
        batch: 2 * dp,
        seq_len: 8,
        steps: 20,
        threads_per_worker: 1,
        ..TrainConfig::with_model(probe(16, 8))
    };
    let predicted = predict_step_time(&cfg, tm)?.seconds;
    let run = || -> Result<f64, TrainError> {
        let report = crate::train(&cfg, &Corpus::bundled(), &TrainOptions::default())?;
        Ok(median(
            report.steps.iter().skip(5).map(|s| s.seconds).collect(),
        ))
    };
    let measured = run()?.min(run()?);
    Ok((measured - predicted).max(0.0))
}

/// The fastest of at least `reps` timings of `f`, in seconds, after one untimed run;
/// short ones are repeated for up to 50 ms (at most 100 times), so that the fastest of
/// them is not a scheduler's accident.
fn fastest<E>(reps: usize, mut f: impl FnMut() -> Result<(), E>) -> Result<f64, E> {
    f()?;
    let (start, mut best) = (Instant::now(), f64::INFINITY);
    for i in 0..100 {
        if i >= reps && start.elapsed().as_secs_f64() > 0.05 {
            break;
        }
        let t0 = Instant::now();
        f()?;
        best = best.min(t0.elapsed().as_secs_f64());
    }
    Ok(best)
}

/// Runs `f` on a fresh thread in a compute pool of `threads` threads (as a worker
/// computes), so that the caller's own pool, if any, is not involved.
fn on_pool<T: Send>(
    threads: usize,
    f: impl FnOnce() -> Result<T, TrainError> + Send,
) -> Result<T, TrainError> {
    std::thread::scope(|s| {
        s.spawn(|| threads::worker_pool(threads)?.install(f))
            .join()
            .unwrap_or_else(|_| Err(err!(Config, "the calibration thread panicked")))
    })
}

/// Keeps, size by size, the faster of two rounds of timings.
fn merge_faster(best: &mut [Vec<Timed>], other: Vec<Vec<Timed>>) {
    for (b, o) in best.iter_mut().zip(other) {
        for (b, o) in b.iter_mut().zip(o) {
            if o.seconds < b.seconds {
                *b = o;
            }
        }
    }
}

/// One timed microbatch.
struct Timed {
    /// Forward and backward, seconds.
    seconds: f64,
    /// Forward (and the loss) alone, when asked for.
    forward: f64,
    flops: f64,
    parts: f64,
}

/// Forward and backward of one microbatch of `b` sequences of `t` tokens through the
/// whole of `model` as one stage, on the current thread pool; the forward alone too
/// when `forward`.
fn time_probe<M: Model>(model: &M, t: usize, b: usize, forward: bool) -> Result<Timed, TrainError> {
    model.validate()?;
    model.check_layout(1, t)?;
    let costs = model.costs(t);
    let plan = plan_stages(&costs, 1, &SplitSpec::Even)?.remove(0);
    let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 0 })?;
    let stage = model.stage(&plan, &store, single_device())?;
    let vocab = model.vocab_size().unwrap_or(256).max(2);
    let ids: Vec<u32> = (0..b * t).map(|i| (i * 7 % vocab) as u32).collect();
    let x = Tensor::from_vec(ids.clone(), (b, t), &Device::Cpu)?;
    let y = Tensor::from_vec(
        ids.iter()
            .map(|&i| (i + 1) % vocab as u32)
            .collect::<Vec<_>>(),
        (b, t),
        &Device::Cpu,
    )?;
    let step = |backward: bool| -> candle_core::Result<()> {
        stage.begin_step()?;
        let loss = stage.loss(&stage.forward(&x)?, &y)?;
        if backward {
            loss.backward()?;
        }
        stage.end_step();
        Ok(())
    };
    let reps = 2;
    Ok(Timed {
        seconds: fastest(reps, || step(true))?,
        forward: match forward {
            true => fastest(reps, || step(false))?,
            false => 0.0,
        },
        flops: (b * t) as f64 * stage_flops(&costs, &plan),
        parts: (plan.blocks.len() + 2) as f64,
    })
}

/// Seconds of the step's end (sum of squares, clipping, AdamW) over a million
/// parameters in `tensors` tensors.
fn time_optimizer(tensors: usize) -> Result<f64, TrainError> {
    let n = (1 << 20) / tensors;
    let params = (0..tensors)
        .map(|_| Var::ones(n, DType::F32, &Device::Cpu))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let grads: Vec<Option<Tensor>> = params
        .iter()
        .map(|p| p.as_tensor().affine(1e-3, 0.0).map(Some))
        .collect::<candle_core::Result<_>>()?;
    let mut opt = AdamW::new(params, AdamWConfig::default());
    fastest(3, || -> Result<(), TrainError> {
        let mut clipped = Vec::with_capacity(grads.len());
        for g in grads.iter().flatten() {
            g.sqr()?.sum_all()?.to_scalar::<f32>()?;
            clipped.push(Some(g.affine(0.5, 0.0)?));
        }
        opt.step(&clipped, 1e-3)?;
        Ok(())
    })
}

/// Pipeline messages (one way) and all-reduces between two ranks of the threads
/// backend, each fitted through three sizes, timed on rank 0's clock with a waiting
/// partner, as in training (a tight loop with both ranks awake would time only the
/// copy): a message goes to rank 1, which computes for [`LATE`] and sends it back, so
/// that each way wakes a sleeping receiver, `P = (round trip − LATE) / 2`; for an
/// all-reduce, rank 0 starts rank 1 with a one-float message and enters the
/// all-reduce, which rank 1 joins [`LATE`] later, `A = elapsed − LATE − P(4 bytes)`.
/// Medians of 20.
fn time_comm() -> Result<(AlphaBeta, AlphaBeta), TrainError> {
    let sizes = [1usize << 8, 1 << 14, 1 << 18];
    let per_rank = Launcher::new(2).threads_per_worker(1).run(
        |comm: Arc<dyn Communicator>| -> Result<Vec<(f64, f64, f64)>, TrainError> {
            let me = comm.rank();
            let token = Tensor::ones(1, DType::F32, &Device::Cpu)?;
            let mut tag = 0u64;
            let mut round_trip = |x: &Tensor| -> Result<f64, TrainError> {
                tag += 1;
                let t0 = Instant::now();
                if me == 0 {
                    comm.send(x, 1, tag)?;
                    comm.recv(1, tag)?;
                } else {
                    let y = comm.recv(0, tag)?;
                    spin(LATE);
                    comm.send(&y, 0, tag)?;
                }
                Ok((t0.elapsed().as_secs_f64() - LATE) / 2.0)
            };
            let one_way = |x: &Tensor, rt: &mut dyn FnMut(&Tensor) -> Result<f64, TrainError>| {
                (0..20)
                    .map(|_| rt(x))
                    .collect::<Result<Vec<_>, _>>()
                    .map(median)
            };
            let start = one_way(&token, &mut round_trip)?;
            let mut out = Vec::new();
            for (k, &n) in sizes.iter().enumerate() {
                let x = Tensor::ones(n, DType::F32, &Device::Cpu)?;
                let p2p = one_way(&x, &mut round_trip)?;
                let mut reduce = Vec::new();
                for rep in 0..20u64 {
                    let tag = 1_000_000 * (k as u64 + 1) + rep;
                    let t0 = Instant::now();
                    if me == 0 {
                        comm.send(&token, 1, tag)?;
                    } else {
                        comm.recv(0, tag)?;
                        spin(LATE);
                    }
                    comm.all_reduce(&x, ReduceOp::Sum)?;
                    reduce.push(t0.elapsed().as_secs_f64() - LATE - start);
                }
                out.push(((4 * n) as f64, p2p, median(reduce)));
            }
            Ok(out)
        },
    )?;
    let rank0 = &per_rank[0];
    Ok((
        AlphaBeta::fit(&rank0.iter().map(|r| (r.0, r.1)).collect::<Vec<_>>()),
        AlphaBeta::fit(&rank0.iter().map(|r| (r.0, r.2)).collect::<Vec<_>>()),
    ))
}

/// How long rank 1 computes before it answers a timed message or joins a timed
/// all-reduce, in seconds.
const LATE: f64 = 300e-6;

/// Busy for `seconds` (computing, as a rank between two operations).
fn spin(seconds: f64) {
    let t0 = Instant::now();
    while t0.elapsed().as_secs_f64() < seconds {
        std::hint::spin_loop();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
