//! What a run reports: per-step records (metrics file, progress bar), the end-of-run
//! report, and the trace — all assembled on rank 0 for the whole job.
//!
//! Everything goes through the world communicator (one small all-gather for the
//! per-rank figures, two for the trace), so a run on threads and a run of `mpirun`
//! processes report the same way.

use std::collections::BTreeMap;
use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use candle_core::{Device, Tensor};
use serde::Serialize;
use switchyard_schedule::{simulate, Action, Costs, Op};

use crate::worker::{StepMetrics, Worker};
use crate::TrainConfig;

/// One step, as reported by rank 0 for the whole job.
#[derive(Debug, Clone, Serialize)]
pub struct StepRecord {
    pub step: usize,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub tokens_per_s: f64,
    pub seconds: f64,
}

impl StepRecord {
    pub(crate) fn of(cfg: &TrainConfig, m: &StepMetrics) -> StepRecord {
        StepRecord {
            step: m.step,
            loss: m.loss,
            grad_norm: m.grad_norm,
            lr: m.lr,
            tokens_per_s: cfg.tokens_per_step() as f64 / m.seconds,
            seconds: m.seconds,
        }
    }
}

/// Measured against predicted pipeline figures for one pipeline rank.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineRankReport {
    pub pp_rank: usize,
    /// Idle fraction of the executor's step time, measured (median over steps).
    pub bubble_measured: f64,
    /// The simulator's bubble for this rank with costs F=1, B=2 (I=2, W=0 for a split
    /// backward, as the executor runs it).
    pub bubble_predicted: f64,
    /// Most microbatches whose activations this rank held at once (measured).
    pub peak_activations: usize,
    pub peak_activations_predicted: u32,
    /// The measured peak of each stage this rank runs, `(stage, microbatches)`.
    pub peak_per_stage: Vec<(u32, usize)>,
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    pub steps: Vec<StepRecord>,
    /// Median tokens/s over the steps after the first.
    pub tokens_per_s: f64,
    pub pipeline: Vec<PipelineRankReport>,
    pub world_size: usize,
}

impl TrainReport {
    pub fn final_loss(&self) -> f64 {
        self.steps.last().map(|s| s.loss).unwrap_or(f64::NAN)
    }

    /// A short text report.
    pub fn render(&self, cfg: &TrainConfig) -> String {
        let mut s = String::new();
        let first = self.steps.first().map(|r| r.loss).unwrap_or(f64::NAN);
        s += &format!(
            "trained {} steps on {} workers (dp {} × pp {} × tp {}, {}): loss {:.4} → {:.4}\n",
            self.steps.len(),
            self.world_size,
            cfg.dp,
            cfg.pp,
            cfg.tp,
            cfg.schedule,
            first,
            self.final_loss()
        );
        s += &format!(
            "throughput: {:.0} tokens/s (median step)\n",
            self.tokens_per_s
        );
        if cfg.pp > 1 {
            s += "pipeline   bubble measured   bubble predicted   peak activations (measured / predicted)   per stage\n";
            for p in &self.pipeline {
                let stages: Vec<String> = p
                    .peak_per_stage
                    .iter()
                    .map(|(k, v)| format!("{k}:{v}"))
                    .collect();
                s += &format!(
                    "  rank {:<4} {:>14.1}% {:>17.1}%   {:>3} / {:<36} {}\n",
                    p.pp_rank,
                    100.0 * p.bubble_measured,
                    100.0 * p.bubble_predicted,
                    p.peak_activations,
                    p.peak_activations_predicted,
                    stages.join(" ")
                );
            }
        }
        s
    }
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// This rank's pipeline figures, as a fixed-size row: median bubble, peak, then
/// `(stage, peak)` for up to `v` stages (padded with −1).
fn rank_row(steps: &[StepMetrics], v: usize) -> Vec<f64> {
    let bubbles = steps
        .iter()
        .skip(usize::from(steps.len() > 1))
        .map(|s| 1.0 - s.exec.compute.as_secs_f64() / s.exec.wall.as_secs_f64().max(1e-12))
        .collect();
    let mut per_stage: BTreeMap<u32, usize> = BTreeMap::new();
    for s in steps {
        for (&k, &p) in &s.exec.peak_per_stage {
            let e = per_stage.entry(k).or_default();
            *e = (*e).max(p);
        }
    }
    let mut row = vec![
        median(bubbles),
        steps
            .iter()
            .map(|s| s.exec.peak_activations)
            .max()
            .unwrap_or(0) as f64,
    ];
    for i in 0..v {
        match per_stage.iter().nth(i) {
            Some((&k, &p)) => row.extend([k as f64, p as f64]),
            None => row.extend([-1.0, -1.0]),
        }
    }
    row
}

/// Assembles the report on rank 0 (`None` elsewhere) and writes the trace to `trace`.
/// Collective over the world.
pub(crate) fn gather(
    worker: &Worker,
    steps: &[StepMetrics],
    trace: Option<&Path>,
) -> anyhow::Result<Option<TrainReport>> {
    let cfg = &worker.cfg;
    let world = &*worker.mesh.world;
    let v = worker.program().num_stages as usize / cfg.pp;
    let row = rank_row(steps, v);
    let width = row.len();
    let rows = world
        .all_gather(&Tensor::new(row.as_slice(), &Device::Cpu)?, 0)?
        .to_vec1::<f64>()?;
    let events = match trace {
        Some(_) => Some(gather_events(worker, steps)?),
        None => None,
    };
    if world.rank() != 0 {
        return Ok(None);
    }
    if let (Some(path), Some(events)) = (trace, events) {
        write_trace(cfg, path, events)?;
    }
    // The executor runs the whole backward in `I` and only adds the kept weight
    // gradients in `W` (see switchyard-pipeline), so predict with those costs.
    let costs = match worker.program().has_split_backward() {
        true => Costs {
            i: 2.0,
            w: 0.0,
            ..Costs::default()
        },
        false => Costs::default(),
    };
    let predicted = simulate(worker.program(), &costs)?;
    let mesh = cfg.mesh();
    let pipeline = (0..cfg.pp)
        .map(|pp_rank| {
            let r = mesh.rank(switchyard_comm::MeshCoord {
                dp: 0,
                pp: pp_rank,
                tp: 0,
            });
            let x = &rows[r * width..(r + 1) * width];
            PipelineRankReport {
                pp_rank,
                bubble_measured: x[0],
                bubble_predicted: predicted.ranks[pp_rank].bubble_fraction,
                peak_activations: x[1] as usize,
                peak_activations_predicted: predicted.ranks[pp_rank].peak_activations,
                peak_per_stage: x[2..]
                    .chunks(2)
                    .filter(|c| c[0] >= 0.0)
                    .map(|c| (c[0] as u32, c[1] as usize))
                    .collect(),
            }
        })
        .collect();
    let records: Vec<StepRecord> = steps.iter().map(|m| StepRecord::of(cfg, m)).collect();
    let tokens_per_s = median(
        records
            .iter()
            .skip(usize::from(records.len() > 1))
            .map(|s| s.tokens_per_s)
            .collect(),
    );
    Ok(Some(TrainReport {
        steps: records,
        tokens_per_s,
        pipeline,
        world_size: cfg.world_size(),
    }))
}

/// Every rank's trace events on rank 0, as rows `[rank, step, stage, op, mb, start, dur]`.
fn gather_events(worker: &Worker, steps: &[StepMetrics]) -> anyhow::Result<Vec<[f64; 7]>> {
    let world = &*worker.mesh.world;
    let me = world.rank() as f64;
    let mut rows: Vec<f64> = Vec::new();
    for s in steps {
        for e in &s.exec.events {
            let a: Action = e.action.parse()?;
            rows.extend([
                me,
                s.step as f64,
                a.stage as f64,
                a.op.index() as f64,
                a.microbatch as f64,
                e.start_us,
                e.dur_us,
            ]);
        }
    }
    let n = rows.len() / 7;
    let counts = world
        .all_gather(&Tensor::new(&[n as f64], &Device::Cpu)?, 0)?
        .to_vec1::<f64>()?;
    let max = counts.iter().fold(0.0f64, |a, &b| a.max(b)) as usize;
    rows.resize(max * 7, -1.0);
    let all = world
        .all_gather(&Tensor::from_vec(rows, (max, 7), &Device::Cpu)?, 0)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    Ok(all
        .chunks(7)
        .filter(|r| r[0] >= 0.0)
        .map(|r| [r[0], r[1], r[2], r[3], r[4], r[5], r[6]])
        .collect())
}

/// A Chrome trace (Perfetto): a track per rank, a slice per action.
fn write_trace(cfg: &TrainConfig, path: &Path, events: Vec<[f64; 7]>) -> anyhow::Result<()> {
    let mesh = cfg.mesh();
    let mut out: Vec<serde_json::Value> = (0..cfg.world_size())
        .map(|r| {
            let c = mesh.coord(r);
            serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                "args": { "name": format!("rank {r} (pp {}, dp {}, tp {})", c.pp, c.dp, c.tp) }
            })
        })
        .collect();
    for e in events {
        let op = Op::ALL[e[3] as usize];
        let a = Action::new(e[2] as u32, op, e[4] as u32);
        out.push(serde_json::json!({
            "name": a.to_string(), "cat": op.code(), "ph": "X", "ts": e[5], "dur": e[6],
            "pid": 0, "tid": e[0] as usize, "args": { "step": e[1] as usize }
        }));
    }
    let doc = serde_json::json!({ "traceEvents": out, "displayTimeUnit": "ms" });
    std::fs::write(path, serde_json::to_vec(&doc)?)
        .with_context(|| format!("cannot write the trace {}", path.display()))
}

/// Rank 0's outputs while training: the metrics file and the progress display.
pub(crate) struct Sink {
    metrics: Option<std::fs::File>,
    progress: bool,
    tty: bool,
    steps: usize,
    start: Instant,
}

impl Sink {
    pub(crate) fn open(
        metrics: Option<&Path>,
        progress: bool,
        steps: usize,
    ) -> anyhow::Result<Sink> {
        let metrics = match metrics {
            Some(p) => Some(
                std::fs::File::create(p)
                    .with_context(|| format!("cannot create --metrics {}", p.display()))?,
            ),
            None => None,
        };
        Ok(Sink {
            metrics,
            progress,
            tty: std::io::stderr().is_terminal(),
            steps,
            start: Instant::now(),
        })
    }

    pub(crate) fn step(&mut self, r: &StepRecord) {
        if let Some(f) = self.metrics.as_mut() {
            let _ = writeln!(f, "{}", serde_json::to_string(r).unwrap_or_default());
            let _ = f.flush();
        }
        if !self.progress {
            return;
        }
        let done = r.step + 1;
        let elapsed = self.start.elapsed().as_secs_f64();
        let eta = elapsed / done as f64 * self.steps.saturating_sub(done) as f64;
        let line = format!(
            "step {done:>5}/{} loss {:.4} | {:>6.0} tok/s | lr {:.2e} | eta {:.0}s",
            self.steps, r.loss, r.tokens_per_s, r.lr, eta
        );
        if self.tty {
            let width = 24;
            let filled = (width * done / self.steps.max(1)).min(width);
            eprint!(
                "\r[{}{}] {line}",
                "#".repeat(filled),
                ".".repeat(width - filled)
            );
            if done >= self.steps {
                eprintln!();
            }
        } else if done == 1 || done == self.steps || done.is_multiple_of((self.steps / 10).max(1)) {
            eprintln!("{line}");
        }
    }
}
