//! What a run reports: per-step records (metrics file, progress bar), the end-of-run
//! report, and the trace — all assembled on rank 0 for the whole job.
//!
//! Everything goes through the world communicator (one small all-gather for the
//! per-rank figures, two for the trace), so a run on threads and a run of `mpirun`
//! processes report the same way.

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::{Context, Result};
use candle_core::{Device, Tensor};
use serde::Serialize;
use switchyard_mem::Category;
use switchyard_schedule::{simulate, Action, Costs, Op};

use crate::worker::{StepMetrics, Worker};

mod pipeline;
mod reduce;
mod sink;
use crate::TrainConfig;
use pipeline::{measured_split_costs, median_bubbles, rank_row, timed, MEANS_WIDTH};
pub use reduce::GradReduceReport;
use reduce::{reduce_row, REDUCE_WIDTH};
pub(crate) use sink::Sink;
use switchyard_models::Model;

/// One step, as reported by rank 0 for the whole job.
#[derive(Debug, Clone, Serialize)]
pub struct StepRecord {
    pub step: usize,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub tokens_per_s: f64,
    pub seconds: f64,
    /// The validation loss after this step, on the steps it was measured.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// The data-parallel gradient all-reduce of rank 0's group, in milliseconds: the
    /// part the backward did not hide (from the end of the slowest replica's pipeline),
    /// and how far apart the replicas' pipelines ended (without replicas, or under ZeRO,
    /// absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_reduce_exposed_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub grad_reduce_imbalance_ms: Option<f64>,
    /// What the model counted this step (`Model::step_metrics`, summed over the job):
    /// for a mixture of experts the balancing loss's part of the objective
    /// (`moe/aux_loss`), the tokens' choices and those over capacity, and each expert's
    /// tokens.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub model: BTreeMap<String, f64>,
    /// What the model says of `model` on the step line (`Model::summarize_metrics`).
    #[serde(skip)]
    pub summary: Option<String>,
}

impl StepRecord {
    pub(crate) fn of<M: Model>(cfg: &TrainConfig<M>, m: &StepMetrics) -> StepRecord {
        let model: BTreeMap<String, f64> = m.model.iter().cloned().collect();
        StepRecord {
            step: m.step,
            loss: m.loss,
            grad_norm: m.grad_norm,
            lr: m.lr,
            tokens_per_s: cfg.tokens_per_step() as f64 / m.seconds,
            seconds: m.seconds,
            val_loss: m.val_loss,
            grad_reduce_exposed_ms: m
                .grad_reduce
                .as_ref()
                .map(|g| 1e3 * g.exposed.as_secs_f64()),
            grad_reduce_imbalance_ms: m
                .grad_reduce
                .as_ref()
                .map(|g| 1e3 * g.imbalance.as_secs_f64()),
            summary: cfg.model.summarize_metrics(&model),
            model,
        }
    }
}

/// Measured and counted against predicted pipeline figures for one pipeline rank.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineRankReport {
    pub pp_rank: usize,
    /// Idle fraction of the step, measured from the executor's timings (median over the
    /// steps after the first): `1 − compute / makespan`, the makespan being the longest
    /// executor step of any rank ([`switchyard_pipeline::step_bubbles`]).
    pub bubble_measured: f64,
    /// The simulator's bubble for this rank: with F=1, B=2, and for a split backward
    /// (ZB-H1) with the `F`, `I` and `W` durations measured in this run (averaged over
    /// the ranks), whose split the model decides (the GPT's fused ops defer their weight
    /// products to `W`).
    pub bubble_predicted: f64,
    /// Most microbatches whose activations this rank had stashed at once, counted from
    /// the executed order of actions (+1 at a forward, −1 at its backward, or at its `W`
    /// for a split backward): a count, not a measurement of memory.
    pub peak_activations: usize,
    /// The same count from the simulator.
    pub peak_activations_predicted: u32,
    /// The counted peak of each stage this rank runs, `(stage, microbatches)`.
    pub peak_per_stage: Vec<(u32, usize)>,
}

/// A rank's place on the mesh.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Coords {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
}

/// One rank's measured memory: the most bytes it held at once during the run, and what
/// they were for at that moment (`switchyard-mem`'s categories).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RankMemory {
    pub rank: usize,
    pub coords: Coords,
    pub peak_bytes: usize,
    pub bytes_by_category: BTreeMap<String, usize>,
    /// The id of the rank's process (on threads every rank shares one).
    pub process: u32,
    /// The peak resident set of the rank's process (`VmHWM`), a cross-check of the
    /// counted peak under MPI; `None` where unknown.
    pub peak_rss_bytes: Option<usize>,
    /// The estimator's prediction of `peak_bytes` ([`crate::estimate::memory`]); `None`
    /// when the model does not describe its activations.
    pub predicted_peak_bytes: Option<usize>,
}

/// What a run did.
#[derive(Debug, Clone, Serialize)]
pub struct TrainReport {
    pub steps: Vec<StepRecord>,
    /// Median tokens/s over the steps after the first.
    pub tokens_per_s: f64,
    pub pipeline: Vec<PipelineRankReport>,
    /// With data-parallel replicas (and no ZeRO): the gradient all-reduce of the rank
    /// that waited longest for it.
    pub grad_reduce: Option<GradReduceReport>,
    /// Each rank's measured memory; empty when the process does not count allocations
    /// (its global allocator is not `switchyard_mem::Counting`).
    pub memory: Vec<RankMemory>,
    pub world_size: usize,
    /// The run stopped early because [`TrainOptions::stop`](crate::TrainOptions::stop)
    /// was set; `steps` holds the steps it finished.
    pub interrupted: bool,
    /// The newest checkpoint this run saved, if any.
    pub last_checkpoint: Option<std::path::PathBuf>,
}

impl TrainReport {
    pub fn final_loss(&self) -> f64 {
        self.steps.last().map(|s| s.loss).unwrap_or(f64::NAN)
    }

    /// The last validation loss measured, with its step (counted from 1).
    pub fn val_loss(&self) -> Option<(usize, f64)> {
        self.steps
            .iter()
            .rev()
            .find_map(|s| s.val_loss.map(|v| (s.step + 1, v)))
    }

    /// A short text report.
    pub fn render<M>(&self, cfg: &TrainConfig<M>) -> String {
        let mut s = String::new();
        let first = self.steps.first().map(|r| r.loss).unwrap_or(f64::NAN);
        s += &format!(
            "trained {} steps on {} workers (dp {} × pp {} × tp {}, {}{}): loss {:.4} → {:.4}\n",
            self.steps.len(),
            self.world_size,
            cfg.dp,
            cfg.pp,
            cfg.tp,
            cfg.schedule,
            match cfg.zero {
                0 => String::new(),
                z => format!(", ZeRO {z}"),
            },
            first,
            self.final_loss()
        );
        if let Some((step, v)) = self.val_loss() {
            s += &format!(
                "validation loss: {v:.4} after step {step} ({} batches of {} × {} tokens)\n",
                cfg.eval_batches, cfg.batch, cfg.seq_len
            );
        }
        s += &format!(
            "throughput: {:.0} tokens/s (median step)\n",
            self.tokens_per_s
        );
        if let Some(g) = &self.grad_reduce {
            s += &reduce::line(g, cfg.overlap_grad_reduce);
        }
        if cfg.pp > 1 {
            s += "pipeline   bubble measured   bubble predicted   peak stashed microbatches (counted / predicted)   per stage\n";
            for p in &self.pipeline {
                let stages: Vec<String> = p
                    .peak_per_stage
                    .iter()
                    .map(|(k, v)| format!("{k}:{v}"))
                    .collect();
                s += &format!(
                    "  rank {:<4} {:>14.1}% {:>17.1}%   {:>3} / {:<44} {}\n",
                    p.pp_rank,
                    100.0 * p.bubble_measured,
                    100.0 * p.bubble_predicted,
                    p.peak_activations,
                    p.peak_activations_predicted,
                    stages.join(" ")
                );
            }
        }
        if !self.memory.is_empty() {
            s += "memory     measured peak   predicted   by category at the peak (MiB)\n";
            for m in &self.memory {
                let split: Vec<String> = m
                    .bytes_by_category
                    .iter()
                    .filter(|(_, &b)| b > 0)
                    .map(|(c, &b)| format!("{c} {:.2}", mib(b)))
                    .collect();
                let predicted = match m.predicted_peak_bytes {
                    Some(b) => format!("{:>9.2} MiB", mib(b)),
                    None => format!("{:>13}", "-"),
                };
                s += &format!(
                    "  rank {:<3} (dp {} pp {} tp {}) {:>9.2} MiB {predicted}   {}\n",
                    m.rank,
                    m.coords.dp,
                    m.coords.pp,
                    m.coords.tp,
                    mib(m.peak_bytes),
                    split.join(", ")
                );
            }
            s += &rss_line(&self.memory);
        }
        s
    }
}

/// The processes' peak resident sets, a cross-check of the counted peaks: one line for
/// one process (threads), or each rank's process (MPI).
fn rss_line(memory: &[RankMemory]) -> String {
    let rss: Vec<usize> = memory.iter().filter_map(|m| m.peak_rss_bytes).collect();
    if rss.len() != memory.len() || rss.is_empty() {
        return String::new();
    }
    let counted: usize = memory.iter().map(|m| m.peak_bytes).sum();
    if memory.iter().all(|m| m.process == memory[0].process) {
        return format!(
            "  process peak resident set {:.2} MiB (every rank's; their counted peaks add up to \
             {:.2} MiB; the binary, the data and the pages the allocator keeps come on top)\n",
            mib(rss[0]),
            mib(counted)
        );
    }
    let per: Vec<String> = memory
        .iter()
        .zip(&rss)
        .map(|(m, r)| format!("rank {} {:.2}", m.rank, mib(*r)))
        .collect();
    format!(
        "  peak resident set of each rank's process (MiB): {}\n",
        per.join(", ")
    )
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Entries of [`memory_row`]: measured or not, the peak, the process's id and peak
/// resident set, the peak's split by category.
const MEMORY_WIDTH: usize = 4 + Category::ALL.len();

/// This rank's measured memory (switchyard-mem) as a row of [`MEMORY_WIDTH`]: `1` when
/// measured (the process counts allocations and this thread charges a rank's ledger),
/// else all `0`.
fn memory_row() -> Vec<f64> {
    match switchyard_mem::this_ledger().filter(|_| switchyard_mem::is_counting()) {
        Some(u) => [
            1.0,
            u.peak as f64,
            f64::from(std::process::id()),
            peak_rss().unwrap_or(0) as f64,
        ]
        .into_iter()
        .chain(u.peak_by_category.iter().map(|&b| b as f64))
        .collect(),
        None => vec![0.0; MEMORY_WIDTH],
    }
}

/// This process's peak resident set (`VmHWM` of `/proc/self/status`, Linux), bytes.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Assembles the report on rank 0 (`None` elsewhere) and writes the trace to `trace`.
/// Collective over the world.
pub(crate) fn gather<M: Model>(
    worker: &Worker<M>,
    steps: &[StepMetrics],
    trace: Option<&Path>,
) -> Result<Option<TrainReport>> {
    let cfg = &worker.cfg;
    let world = &*worker.mesh.world;
    let v = worker.program().num_stages as usize / cfg.pp;
    let mut row = rank_row(steps, v);
    let total = reduce::totals(worker, steps)?;
    row.extend(reduce_row(steps, total));
    row.extend(memory_row());
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
    // A split backward's `I` and `W` cost what the model splits into them (the fused
    // ops defer their weight products to `W`; a model that does not, nothing): predict
    // with the mean `F`, `I` and `W` every rank measured.
    let reduce_at = width - MEMORY_WIDTH - REDUCE_WIDTH;
    let means_at = reduce_at - MEANS_WIDTH;
    let costs = match worker.program().has_split_backward() {
        true => measured_split_costs(&rows, width, means_at),
        false => Costs::default(),
    };
    let predicted = simulate(worker.program(), &costs)?;
    let offset = 1 + 2 * v;
    let bubbles = median_bubbles(&rows, width, offset, timed(steps).len());
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
                bubble_measured: bubbles[r],
                bubble_predicted: predicted.ranks[pp_rank].bubble_fraction,
                peak_activations: x[0] as usize,
                peak_activations_predicted: predicted.ranks[pp_rank].peak_activations,
                peak_per_stage: x[1..offset]
                    .chunks(2)
                    .filter(|c| c[0] >= 0.0)
                    .map(|c| (c[0] as u32, c[1] as usize))
                    .collect(),
            }
        })
        .collect();
    let predicted_memory = crate::estimate::memory::estimate_memory(cfg).ok();
    let memory = (0..cfg.world_size())
        .filter_map(|r| {
            let x = &rows[(r + 1) * width - MEMORY_WIDTH..(r + 1) * width];
            (x[0] > 0.0).then(|| {
                let c = mesh.coord(r);
                RankMemory {
                    rank: r,
                    coords: Coords {
                        dp: c.dp,
                        pp: c.pp,
                        tp: c.tp,
                    },
                    peak_bytes: x[1] as usize,
                    process: x[2] as u32,
                    peak_rss_bytes: (x[3] > 0.0).then_some(x[3] as usize),
                    bytes_by_category: Category::ALL
                        .iter()
                        .zip(&x[4..])
                        .map(|(c, &b)| (c.name().to_string(), b as usize))
                        .collect(),
                    predicted_peak_bytes: predicted_memory.as_ref().map(|p| p[c.pp].peak_bytes),
                }
            })
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
        grad_reduce: reduce::worst(&rows, width, reduce_at),
        memory,
        world_size: cfg.world_size(),
        interrupted: false,
        last_checkpoint: None,
    }))
}

/// Every rank's trace events on rank 0, as rows `[rank, step, stage, op, mb, start, dur]`.
fn gather_events<M: Model>(worker: &Worker<M>, steps: &[StepMetrics]) -> Result<Vec<[f64; 7]>> {
    let world = &*worker.mesh.world;
    let me = world.rank() as f64;
    let mut rows: Vec<f64> = Vec::new();
    for s in steps {
        for e in &s.exec.events {
            let a = e.action;
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
    rows.extend(reduce::trace_rows(me, steps));
    for s in steps {
        for c in &s.expert_comm {
            // (Every collective `Timed` records is in the list.)
            let Some(op) = EXPERT_OPS.iter().position(|o| *o == c.op) else {
                continue;
            };
            rows.extend([
                me,
                s.step as f64,
                -1.0,
                EXPERT_OP - op as f64,
                c.bytes as f64,
                c.start_us,
                c.dur_us,
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

/// The op codes of the expert group's collectives in the gathered trace rows:
/// `EXPERT_OP − k` for `EXPERT_OPS[k]` (the executor's actions use `Op::index`, from 0;
/// the gradient all-reduce −1).
const EXPERT_OP: f64 = -2.0;
const EXPERT_OPS: [&str; 6] = [
    "all_to_all",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "barrier",
];

/// A Chrome trace (Perfetto): a track per rank, a slice per action; with data-parallel
/// replicas, a second track per rank (`tid` = world size + rank) with its gradient
/// all-reduces (the communication thread's during the backward, and the one after it);
/// with expert parallelism, a third (`tid` = 2 × world size + rank) with the expert
/// group's all-to-alls, forward and backward, each with its bytes.
fn write_trace<M>(cfg: &TrainConfig<M>, path: &Path, events: Vec<[f64; 7]>) -> Result<()> {
    let mesh = cfg.mesh();
    let world = cfg.world_size();
    let track = |tid: usize, name: String| {
        serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": { "name": name }
        })
    };
    let mut out: Vec<serde_json::Value> = (0..world)
        .map(|r| {
            let c = mesh.coord(r);
            track(
                r,
                format!("rank {r} (pp {}, dp {}, tp {})", c.pp, c.dp, c.tp),
            )
        })
        .collect();
    let mut comm_tracks = std::collections::BTreeSet::new();
    let mut expert_tracks = std::collections::BTreeSet::new();
    for e in events {
        let rank = e[0] as usize;
        if e[3] == reduce::ALL_REDUCE_OP {
            if comm_tracks.insert(rank) {
                out.push(track(
                    world + rank,
                    format!("rank {rank} gradient all-reduce"),
                ));
            }
            let name = match e[4] {
                k if k >= 0.0 => format!("all-reduce bucket {}", k as usize),
                _ => "all-reduce after the backward".to_string(),
            };
            out.push(serde_json::json!({
                "name": name, "cat": "all-reduce",
                "ph": "X", "ts": e[5], "dur": e[6], "pid": 0, "tid": world + rank,
                "args": { "step": e[1] as usize }
            }));
            continue;
        }
        if e[3] <= EXPERT_OP {
            if expert_tracks.insert(rank) {
                out.push(track(
                    2 * world + rank,
                    format!("rank {rank} expert-parallel all-to-all"),
                ));
            }
            let op = EXPERT_OPS[(EXPERT_OP - e[3]) as usize];
            out.push(serde_json::json!({
                "name": op.replace('_', "-"), "cat": "expert",
                "ph": "X", "ts": e[5], "dur": e[6], "pid": 0, "tid": 2 * world + rank,
                "args": { "step": e[1] as usize, "bytes": e[4] as u64 }
            }));
            continue;
        }
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

#[cfg(test)]
#[path = "report_tests.rs"]
mod tests;
