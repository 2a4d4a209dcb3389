//! The end-to-end benchmark behind `switchyard bench`: one workload trained on one worker
//! and on each parallel layout, with warm-up and the median of several steps, as a table
//! of tokens/s, speed-up over one worker, model-FLOPs utilisation (MFU), measured against
//! predicted pipeline bubble, and peak memory per worker.
//!
//! * **Baseline.** One worker on one core (one compute thread). Every speed-up is over
//!   that row, measured in the same run; a 2-core machine runs 2 workers with one thread
//!   each, so each parallel layout is compared at one core per worker.
//! * **MFU** = tokens/s × model FLOPs per token / (cores × measured per-core peak), with
//!   the FLOPs a token actually needs ([`Preset::flops_per_token`]: 6 × non-embedding
//!   parameters + the causal attention products) and the per-core peak an AVX-512 FMA
//!   loop ([`fma_peak_gflops`]).
//! * **Ideal pipeline speed-up** = `pp × (1 − bubble)`, the bubble from the schedule
//!   simulator with backward = 2 × forward.
//! * **Predicted step time**: `switchyard_train::estimate::time`'s model, calibrated once
//!   on this machine at the start of the run ([`calibrate`]) for each ops backend of the
//!   table, next to the measured median and their ratio (the issue's target: within
//!   20 %).

use serde::{Deserialize, Serialize};
use switchyard_models::{GptConfig, OpsBackend, Precision};
use switchyard_schedule::ScheduleChoice;

use switchyard_train::data::Corpus;
use switchyard_train::estimate::time::{predict_step_time, StepTime, TimeModel};
use switchyard_train::{train, Recompute, TrainOptions};

mod cases;
mod machine;

pub use cases::{cases, config};
pub use machine::{fma_peak_gflops, peak_rss_mib};

/// What can go wrong in a benchmark.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BenchError {
    /// A preset or setting no row can run, naming the `switchyard bench` flag.
    #[error("{0}")]
    Preset(String),
    /// A row's training run failed.
    #[error(transparent)]
    Train(#[from] switchyard_train::TrainError),
}

/// A workload: the model, the batch, and how many steps to time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Preset {
    pub name: String,
    pub model: GptConfig,
    /// Sequences per step (all replicas together).
    pub batch: usize,
    pub seq_len: usize,
    /// Microbatches of the pipeline rows.
    pub microbatches: usize,
    /// Untimed steps first.
    pub warmup: usize,
    /// Timed steps (the median is reported).
    pub steps: usize,
}

impl Preset {
    /// `reference` (the issue's workload: d 256, 8 layers, 8 heads, T 128, 32 sequences),
    /// `small` (d 128, 4 layers, T 64, 16 sequences) or `tiny` (seconds, for smoke tests).
    pub fn named(name: &str) -> Result<Preset, BenchError> {
        let model = |d: usize, layers: usize, heads: usize, t: usize| GptConfig {
            vocab_size: 256,
            block_size: t,
            n_layer: layers,
            n_head: heads,
            d_model: d,
            tied_embeddings: false,
            ops: OpsBackend::Fused,
            precision: Precision::F32,
            moe: Default::default(),
            hidden_dropout: 0.0,
        };
        let (m, batch, t, warmup, steps) = match name {
            "reference" => (model(256, 8, 8, 128), 32, 128, 2, 5),
            "small" => (model(128, 4, 4, 64), 16, 64, 2, 5),
            "tiny" => (model(32, 2, 4, 16), 8, 16, 5, 20),
            other => {
                return Err(BenchError::Preset(format!(
                    "unknown preset {other}: use reference, small or tiny"
                )))
            }
        };
        Ok(Preset {
            name: name.into(),
            model: m,
            batch,
            seq_len: t,
            microbatches: 8,
            warmup,
            steps,
        })
    }

    /// Refuses settings no row can run, naming the `switchyard bench` flag: timed steps
    /// and microbatches must be at least 1, and the microbatches must divide the batch.
    pub fn check(&self) -> Result<(), BenchError> {
        if self.steps == 0 {
            return Err(BenchError::Preset(
                "--steps must be at least 1: each row reports the median of its timed steps".into(),
            ));
        }
        if self.microbatches == 0 {
            return Err(BenchError::Preset(
                "--microbatches must be at least 1".into(),
            ));
        }
        if !self.batch.is_multiple_of(self.microbatches) {
            let divisors: Vec<String> = (1..=self.batch)
                .filter(|d| self.batch.is_multiple_of(*d))
                .map(|d| d.to_string())
                .collect();
            return Err(BenchError::Preset(format!(
                "--microbatches {} does not divide the {} preset's batch of {} sequences: use one of {}",
                self.microbatches,
                self.name,
                self.batch,
                divisors.join(", ")
            )));
        }
        Ok(())
    }

    /// The FLOPs one token actually needs, forward and backward:
    ///
    /// ```text
    /// 6 · N  +  6 · layers · d · (T + 1)
    /// ```
    ///
    /// * `N`, the non-embedding parameters: all parameters but the token and position
    ///   tables (`wte`, `wpe`), which are looked up, not multiplied (a tied head's
    ///   product with `wte` is counted: `V · d` more). Each weight costs 2 FLOPs per
    ///   token forward and 4 backward (input and weight gradients): `6 · N`.
    /// * Attention, per layer: position `i` of a causal sequence attends to `i` keys
    ///   (1-based), `(T + 1)/2` on average, so `QKᵀ` and `A·V` each cost
    ///   `2 · d · (T + 1)/2` forward, `2 · d · (T + 1)` together; ×3 for forward and
    ///   backward: `6 · d · (T + 1)`. The masked half of the `T × T` products is not
    ///   counted: it is not needed (and the kernels skip it).
    pub fn flops_per_token(&self) -> f64 {
        let m = &self.model;
        let tables = (m.vocab_size + m.block_size) * m.d_model;
        let tied_head = if m.tied_embeddings {
            m.vocab_size * m.d_model
        } else {
            0
        };
        let n = (m.param_count() - tables + tied_head) as f64;
        6.0 * n + 6.0 * (m.n_layer * m.d_model * (self.seq_len + 1)) as f64
    }

    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.seq_len
    }
}

/// One row of the table: a layout and how it is run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Case {
    pub name: String,
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    pub threads_per_worker: usize,
    pub schedule: ScheduleChoice,
    pub microbatches: usize,
    /// The fused CPU kernels or their composed twins (the path of every other device).
    #[serde(default, with = "switchyard_models::ops_serde")]
    pub ops: OpsBackend,
    /// Activation recomputation.
    #[serde(default)]
    pub recompute: Recompute,
    /// What the products multiply in.
    #[serde(default, with = "switchyard_models::precision_serde")]
    pub precision: Precision,
    /// Data-parallel rows: all-reduce each block's gradients during the backward
    /// (`overlap_grad_reduce`, the default) or all of them after it.
    #[serde(default = "yes")]
    pub overlap_grad_reduce: bool,
    /// Tensor-parallel rows: split the LayerNorms and the residual stream along the
    /// sequence (`--sequence-parallel`).
    #[serde(default)]
    pub sequence_parallel: bool,
    /// Hidden dropout's rate (`--hidden-dropout`; 0: none).
    #[serde(default)]
    pub hidden_dropout: f64,
}

fn yes() -> bool {
    true
}

impl Case {
    pub fn workers(&self) -> usize {
        self.dp * self.pp * self.tp
    }
    pub fn cores(&self) -> usize {
        self.workers() * self.threads_per_worker
    }
}

/// What one case measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Row {
    pub case: Case,
    /// Median over the timed steps.
    pub tokens_per_s: f64,
    pub step_s: f64,
    /// Over the baseline row of the same run.
    pub speedup: Option<f64>,
    pub mfu: Option<f64>,
    /// Pipeline rows: the measured bubble of each pipeline rank (idle fraction of the
    /// executor's time, median over steps) and the simulator's.
    pub bubble_measured: Vec<f64>,
    pub bubble_predicted: Vec<f64>,
    /// The arithmetic limit of the speed-up: cores, times `1 − predicted bubble` for
    /// pipeline rows.
    pub ideal_speedup: f64,
    /// Peak resident memory of the process running the case, divided by its workers.
    pub peak_mib_per_worker: Option<f64>,
    /// The largest counted peak of a rank (`switchyard-mem`), MiB; `None` when the
    /// process does not count.
    #[serde(default)]
    pub memory_measured_mib: Option<f64>,
    /// The memory estimator's largest peak of a rank, MiB.
    #[serde(default)]
    pub memory_predicted_mib: Option<f64>,
    /// The largest |predicted − measured| / measured peak over the ranks.
    #[serde(default)]
    pub memory_worst_error: Option<f64>,
    pub final_loss: f64,
    /// The time model's step, before the run (filled in by [`Report::predict`]).
    #[serde(default)]
    pub predicted: Option<StepTime>,
    /// Data-parallel rows: the gradient all-reduce's milliseconds a step, `(exposed,
    /// total)`, of the rank that waited longest (medians over the timed steps).
    #[serde(default)]
    pub grad_reduce_ms: Option<(f64, f64)>,
}

impl Row {
    /// Predicted over measured step time.
    pub fn time_ratio(&self) -> Option<f64> {
        self.predicted.as_ref().map(|p| p.seconds / self.step_s)
    }
}

/// The model the time model is calibrated on: a 2-layer GPT of width `d` and block
/// size `t`, computing as `compute` says (its ops backend and precision).
pub fn probe(compute: Compute, d: usize, t: usize) -> GptConfig {
    GptConfig {
        vocab_size: 256,
        block_size: t,
        n_layer: 2,
        n_head: 4,
        d_model: d,
        tied_embeddings: false,
        ops: compute.0,
        precision: compute.1,
        moe: Default::default(),
        hidden_dropout: 0.0,
    }
}

/// How a model computes, which decides its time model: the ops backend and the
/// precision.
pub type Compute = (OpsBackend, Precision);

/// The name of a [`Compute`] in tables: `fused`, `fused, bf16`.
pub fn compute_name((ops, precision): Compute) -> String {
    match precision {
        Precision::F32 => ops.name().to_string(),
        p => format!("{}, {p}", ops.name()),
    }
}

/// The time model of each way of computing among `cases`, calibrated on this machine.
pub fn calibrate(cases: &[&Case]) -> Result<Vec<(Compute, TimeModel)>, BenchError> {
    let mut models: Vec<(Compute, TimeModel)> = Vec::new();
    for c in cases {
        let key = (c.ops, c.precision);
        if !models.iter().any(|(k, _)| *k == key) {
            models.push((key, TimeModel::calibrate(|d, t| probe(key, d, t))?));
        }
    }
    Ok(models)
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Trains `c` on `p` in this process and measures it (speed-up and MFU are filled in by
/// [`Report::new`]).
pub fn run_case(p: &Preset, c: &Case) -> Result<Row, BenchError> {
    let cfg = config(p, c);
    let report = train(&cfg, &Corpus::bundled(), &TrainOptions::default())?;
    let timed: Vec<f64> = report
        .steps
        .iter()
        .skip(p.warmup)
        .map(|s| s.seconds)
        .collect();
    let step_s = median(timed);
    let max_bubble = |v: &[f64]| v.iter().cloned().fold(0.0f64, f64::max);
    let bubble_predicted: Vec<f64> = match c.pp > 1 {
        true => report.pipeline.iter().map(|r| r.bubble_predicted).collect(),
        false => vec![],
    };
    // The arithmetic limit: every core busy, less the pipeline's predicted bubble.
    let pipeline = match c.pp > 1 {
        true => c.pp as f64 * (1.0 - max_bubble(&bubble_predicted)),
        false => 1.0,
    };
    let ideal_speedup = pipeline * (c.dp * c.tp * c.threads_per_worker) as f64;
    Ok(Row {
        case: c.clone(),
        tokens_per_s: p.tokens_per_step() as f64 / step_s,
        step_s,
        speedup: None,
        mfu: None,
        bubble_measured: match c.pp > 1 {
            true => report.pipeline.iter().map(|r| r.bubble_measured).collect(),
            false => vec![],
        },
        bubble_predicted,
        ideal_speedup,
        peak_mib_per_worker: peak_rss_mib().map(|m| m / c.workers() as f64),
        memory_measured_mib: report
            .memory
            .iter()
            .map(|m| m.peak_bytes as f64 / MIB)
            .reduce(f64::max),
        memory_predicted_mib: report
            .memory
            .iter()
            .filter_map(|m| m.predicted_peak_bytes)
            .map(|b| b as f64 / MIB)
            .reduce(f64::max),
        memory_worst_error: report
            .memory
            .iter()
            .filter_map(|m| {
                let p = m.predicted_peak_bytes? as f64;
                Some((p - m.peak_bytes as f64).abs() / m.peak_bytes as f64)
            })
            .reduce(f64::max),
        final_loss: report.final_loss(),
        predicted: None,
        grad_reduce_ms: report.grad_reduce.map(|g| (g.exposed_ms, g.total_ms)),
    })
}

const MIB: f64 = 1024.0 * 1024.0;

/// The whole table.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub preset: Preset,
    pub flops_per_token: f64,
    /// Measured peak of one core, GFLOP/s.
    pub peak_gflops_per_core: f64,
    pub rows: Vec<Row>,
    /// The calibrated time models the predictions used, by ops backend.
    #[serde(default)]
    pub time_models: Vec<(String, TimeModel)>,
}

impl Report {
    /// Fills in speed-ups (over the first row, the one-worker baseline) and MFU.
    pub fn new(preset: Preset, peak_gflops_per_core: f64, mut rows: Vec<Row>) -> Report {
        let fpt = preset.flops_per_token();
        let base = rows.first().map(|r| r.tokens_per_s);
        for r in &mut rows {
            r.speedup = base.map(|b| r.tokens_per_s / b);
            if peak_gflops_per_core > 0.0 {
                let peak = peak_gflops_per_core * 1e9 * r.case.cores() as f64;
                r.mfu = Some(r.tokens_per_s * fpt / peak);
            }
        }
        Report {
            preset,
            flops_per_token: fpt,
            peak_gflops_per_core,
            rows,
            time_models: Vec::new(),
        }
    }

    /// Predicts every row's step time with the time model of its ops backend and
    /// precision.
    pub fn predict(&mut self, models: &[(Compute, TimeModel)]) -> Result<(), BenchError> {
        for r in &mut self.rows {
            let key = (r.case.ops, r.case.precision);
            let Some((_, tm)) = models.iter().find(|(k, _)| *k == key) else {
                continue;
            };
            r.predicted = Some(predict_step_time(&config(&self.preset, &r.case), tm)?);
        }
        self.time_models = models
            .iter()
            .map(|(k, tm)| (compute_name(*k), tm.clone()))
            .collect();
        Ok(())
    }

    /// A Markdown table with a short header.
    pub fn render(&self) -> String {
        let p = &self.preset;
        let m = &p.model;
        let mut s = format!(
            "preset {}: GPT d {} × {} layers × {} heads, T {}, {} sequences ({} tokens) a step, f32, AdamW; \
             {:.1} MFLOP/token; peak {:.0} GFLOP/s per core (measured); median of {} steps after {} warm-up\n\n",
            p.name,
            m.d_model,
            m.n_layer,
            m.n_head,
            p.seq_len,
            p.batch,
            p.tokens_per_step(),
            self.flops_per_token / 1e6,
            self.peak_gflops_per_core,
            p.steps,
            p.warmup
        );
        s += "| layout | workers × threads | tokens/s | speed-up | ideal | MFU | bubble measured / predicted | step ms measured / predicted | predicted ÷ measured | peak MiB of a rank measured / predicted (worst rank's error) | resident MiB per worker | dp all-reduce ms exposed / total |\n";
        s += "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|\n";
        for r in &self.rows {
            let c = &r.case;
            let bubble = match r.bubble_measured.is_empty() {
                true => "–".to_string(),
                false => r
                    .bubble_measured
                    .iter()
                    .zip(&r.bubble_predicted)
                    .map(|(m, p)| format!("{:.1}% / {:.1}%", 100.0 * m, 100.0 * p))
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            let step = match &r.predicted {
                Some(p) => format!("{:.1} / {:.1}", 1e3 * r.step_s, 1e3 * p.seconds),
                None => format!("{:.1} / –", 1e3 * r.step_s),
            };
            let memory = match (r.memory_measured_mib, r.memory_predicted_mib) {
                (Some(m), Some(p)) => format!(
                    "{m:.1} / {p:.1} ({:.1}%)",
                    100.0 * r.memory_worst_error.unwrap_or(f64::NAN)
                ),
                (Some(m), None) => format!("{m:.1} / –"),
                _ => "–".into(),
            };
            let reduce = match r.grad_reduce_ms {
                Some((exposed, total)) => format!("{exposed:.1} / {total:.1}"),
                None => "–".into(),
            };
            s += &format!(
                "| {} | {} × {} | {:.0} | {} | {:.2}× | {} | {} | {} | {} | {memory} | {} | {reduce} |\n",
                c.name,
                c.workers(),
                c.threads_per_worker,
                r.tokens_per_s,
                r.speedup.map_or("–".into(), |x| format!("{x:.2}×")),
                r.ideal_speedup,
                r.mfu.map_or("–".into(), |x| format!("{:.1}%", 100.0 * x)),
                bubble,
                step,
                r.time_ratio().map_or("–".into(), |x| format!("{x:.2}")),
                r.peak_mib_per_worker
                    .map_or("–".into(), |x| format!("{x:.0}")),
            );
        }
        s
    }
}

#[cfg(test)]
mod tests;
