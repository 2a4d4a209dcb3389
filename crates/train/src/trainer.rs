//! The training loop over all ranks: launch, step, report.

use std::collections::HashMap;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use candle_core::Tensor;
use serde::Serialize;
use switchyard_comm::local::Launcher;
use switchyard_comm::Communicator;
use switchyard_schedule::{simulate, Costs};
use switchyard_shard::ParamSource;

use crate::checkpoint::{self, fnv64, Checkpoint, CorpusInfo, FileEntry, FullState, Manifest};
use crate::data::Corpus;
use crate::weights::Weights;
use crate::worker::{StepMetrics, Worker};
use crate::TrainConfig;

/// Where the loop writes, besides the report it returns.
#[derive(Default, Clone)]
pub struct TrainOptions {
    /// JSON lines, one per step.
    pub metrics: Option<PathBuf>,
    /// A Chrome trace of every action of every rank (opens in Perfetto).
    pub trace: Option<PathBuf>,
    /// A progress bar (or periodic lines when stderr is not a terminal).
    pub progress: bool,
    /// Where checkpoints go (`step-N/` directories).
    pub checkpoint_dir: Option<PathBuf>,
    /// Save every this many steps (0: only at the end), when `checkpoint_dir` is set.
    pub save_every: usize,
    /// Keep the newest this many checkpoints (0: all).
    pub keep: usize,
    /// Continue from a checkpoint in `checkpoint_dir`.
    pub resume: Option<Resume>,
    /// Start from the weights of a `.safetensors` file (or a checkpoint) instead of the seed.
    pub init: Option<PathBuf>,
}

/// Which checkpoint `--resume` continues from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// The newest complete one.
    Latest,
    /// The one saved after this many steps.
    Step(usize),
}

/// Where a run starts: the state each rank loads.
enum Start {
    Seed,
    Weights(HashMap<String, Tensor>),
    Checkpoint {
        manifest: Box<Manifest>,
        full: FullState,
    },
}

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

/// Measured against predicted pipeline figures for one pipeline rank.
#[derive(Debug, Clone, Serialize)]
pub struct PipelineRankReport {
    pub pp_rank: usize,
    /// Idle fraction of the executor's step time, measured (median over steps).
    pub bubble_measured: f64,
    /// The simulator's bubble for this rank with costs F=1, B=2.
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
                let stages: Vec<String> = p.peak_per_stage.iter().map(|(k, v)| format!("{k}:{v}")).collect();
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

/// What each rank hands back.
struct RankOutcome {
    steps: Vec<StepMetrics>,
    trace: Vec<serde_json::Value>,
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Trains `cfg` on `corpus` with the in-process backend, one thread per rank.
/// Every configuration error is reported before any worker starts.
pub fn train(
    cfg: &TrainConfig,
    corpus: &Corpus,
    opts: &TrainOptions,
) -> anyhow::Result<TrainReport> {
    cfg.validate()
        .map_err(|e| anyhow!("invalid configuration: {e}"))?;
    corpus.check(cfg.seq_len).map_err(anyhow::Error::msg)?;
    let mut launcher =
        Launcher::new(cfg.world_size()).timeout(Duration::from_secs_f64(cfg.comm_timeout_secs));
    if cfg.threads_per_worker > 0 {
        launcher = launcher.threads_per_worker(cfg.threads_per_worker);
    }
    let corpus_info = CorpusInfo {
        name: corpus.name.clone(),
        bytes: corpus.len(),
        fnv64: fnv64(corpus.bytes()),
    };
    let start = prepare_start(cfg, opts, &corpus_info)?;
    let sink = Sink::open(opts, cfg)?;
    let epoch = Instant::now();
    let ctx = RankContext {
        cfg,
        corpus,
        corpus_info: &corpus_info,
        opts,
        sink: &sink,
        epoch,
        start: &start,
    };
    let outcomes = launcher
        .run(|world| run_rank(world, &ctx))
        .map_err(|e| anyhow!("{e}"))?;
    sink.finish();
    let program = cfg.program().map_err(anyhow::Error::msg)?;
    let predicted = simulate(&program, &Costs::default())?;
    let mesh = cfg.mesh();
    let mut pipeline = Vec::new();
    for pp_rank in 0..cfg.pp {
        let r = mesh.rank(switchyard_comm::MeshCoord {
            dp: 0,
            pp: pp_rank,
            tp: 0,
        });
        let steps = &outcomes[r].steps;
        let bubbles = steps
            .iter()
            .skip(usize::from(steps.len() > 1))
            .map(|s| 1.0 - s.exec.compute.as_secs_f64() / s.exec.wall.as_secs_f64().max(1e-12))
            .collect();
        pipeline.push(PipelineRankReport {
            pp_rank,
            bubble_measured: median(bubbles),
            bubble_predicted: predicted.ranks[pp_rank].bubble_fraction,
            peak_activations: steps
                .iter()
                .map(|s| s.exec.peak_activations)
                .max()
                .unwrap_or(0),
            peak_activations_predicted: predicted.ranks[pp_rank].peak_activations,
            peak_per_stage: steps
                .iter()
                .flat_map(|s| s.exec.peak_per_stage.iter().map(|(&k, &v)| (k, v)))
                .fold(std::collections::BTreeMap::new(), |mut m, (k, v)| {
                    let e: &mut usize = m.entry(k).or_default();
                    *e = (*e).max(v);
                    m
                })
                .into_iter()
                .collect(),
        });
    }
    if let Some(path) = &opts.trace {
        let mut events: Vec<serde_json::Value> = Vec::new();
        for (r, o) in outcomes.iter().enumerate() {
            let c = mesh.coord(r);
            events.push(serde_json::json!({
                "name": "thread_name", "ph": "M", "pid": 0, "tid": r,
                "args": { "name": format!("rank {r} (pp {}, dp {}, tp {})", c.pp, c.dp, c.tp) }
            }));
            events.extend(o.trace.iter().cloned());
        }
        let doc = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
        std::fs::write(path, serde_json::to_vec(&doc)?)
            .with_context(|| format!("cannot write the trace {}", path.display()))?;
    }
    let steps: Vec<StepRecord> = outcomes[0].steps.iter().map(|m| record(cfg, m)).collect();
    let tokens_per_s = median(
        steps
            .iter()
            .skip(usize::from(steps.len() > 1))
            .map(|s| s.tokens_per_s)
            .collect(),
    );
    Ok(TrainReport {
        steps,
        tokens_per_s,
        pipeline,
        world_size: cfg.world_size(),
    })
}

fn record(cfg: &TrainConfig, m: &StepMetrics) -> StepRecord {
    StepRecord {
        step: m.step,
        loss: m.loss,
        grad_norm: m.grad_norm,
        lr: m.lr,
        tokens_per_s: cfg.tokens_per_step() as f64 / m.seconds,
        seconds: m.seconds,
    }
}

/// What every rank shares.
struct RankContext<'a> {
    cfg: &'a TrainConfig,
    corpus: &'a Corpus,
    corpus_info: &'a CorpusInfo,
    opts: &'a TrainOptions,
    sink: &'a Sink,
    epoch: Instant,
    start: &'a Start,
}

/// Loads and checks whatever the run starts from, before any worker starts.
fn prepare_start(
    cfg: &TrainConfig,
    opts: &TrainOptions,
    corpus: &CorpusInfo,
) -> anyhow::Result<Start> {
    if opts.resume.is_some() && opts.init.is_some() {
        anyhow::bail!(
            "--resume and --init exclude each other: resume continues a run, init starts a new one"
        );
    }
    if let Some(r) = opts.resume {
        let dir = opts
            .checkpoint_dir
            .as_ref()
            .ok_or_else(|| anyhow!("--resume needs --checkpoint-dir"))?;
        let step = match r {
            Resume::Latest => None,
            Resume::Step(s) => Some(s),
        };
        let ckpt = Checkpoint::find(dir, step)?;
        let m = &ckpt.manifest;
        if m.config.model != cfg.model {
            anyhow::bail!(
                "{} holds a model {:?}, but this run builds {:?}: resume with the checkpoint's model flags",
                ckpt.path.display(),
                m.config.model,
                cfg.model
            );
        }
        if m.corpus.bytes != corpus.bytes || m.corpus.fnv64 != corpus.fnv64 {
            anyhow::bail!(
                "{} was trained on {} ({} bytes); this run reads {} ({} bytes): pass the same --data to resume",
                ckpt.path.display(),
                m.corpus.name,
                m.corpus.bytes,
                corpus.name,
                corpus.bytes
            );
        }
        if m.step >= cfg.steps {
            anyhow::bail!(
                "{} is already at step {} of a run of --steps {}: pass more --steps to continue",
                ckpt.path.display(),
                m.step,
                cfg.steps
            );
        }
        let full = ckpt.load_full()?;
        return Ok(Start::Checkpoint {
            manifest: Box::new(ckpt.manifest),
            full,
        });
    }
    if let Some(path) = &opts.init {
        let w = Weights::load(path, cfg.model.n_head)?;
        if w.config != cfg.model {
            anyhow::bail!(
                "{} holds a model {:?}, but this run builds {:?}: pass matching --d-model, --layers, --heads (and --tied)",
                path.display(),
                w.config,
                cfg.model
            );
        }
        return Ok(Start::Weights(w.tensors));
    }
    Ok(Start::Seed)
}

fn run_rank(world: Arc<dyn Communicator>, ctx: &RankContext) -> anyhow::Result<RankOutcome> {
    let (cfg, opts) = (ctx.cfg, ctx.opts);
    let me = world.rank();
    let (source, first_step) = match ctx.start {
        Start::Seed => (ParamSource::Init { seed: cfg.seed }, 0),
        Start::Weights(w) => (ParamSource::Full(w.clone()), 0),
        Start::Checkpoint { manifest, full } => {
            (ParamSource::Full(full.params.clone()), manifest.step)
        }
    };
    let mut worker = Worker::new(world, cfg, ctx.corpus, source)?;
    if let Start::Checkpoint { manifest, full } = ctx.start {
        worker.restore_optimizer(&full.m, &full.v, manifest.optimizer_t)?;
    }
    worker.set_epoch(ctx.epoch);
    let mut steps = Vec::new();
    let mut trace = Vec::new();
    for step in first_step..cfg.steps {
        let m = match worker.step(step)? {
            Ok(m) => m,
            Err(nf) if nf.rank == me => {
                let c = worker.mesh.coord;
                return Err(anyhow!(
                    "step {}: non-finite values first appeared on rank {me} (pp {}, dp {}, tp {}): {}",
                    nf.step,
                    c.pp,
                    c.dp,
                    c.tp,
                    nf.detail.unwrap_or_default()
                ));
            }
            // Another rank reports it; stop here without an error of our own.
            Err(_) => break,
        };
        if me == 0 {
            ctx.sink.step(&record(cfg, &m));
        }
        if opts.trace.is_some() {
            trace.extend(m.exec.events.iter().map(|e| {
                serde_json::json!({
                    "name": e.action, "cat": e.action.trim_matches(|c: char| c.is_ascii_digit()),
                    "ph": "X", "ts": e.start_us, "dur": e.dur_us, "pid": 0, "tid": me,
                    "args": { "step": m.step }
                })
            }));
        }
        steps.push(m);
        if let Some(dir) = &opts.checkpoint_dir {
            let done = step + 1;
            if done == cfg.steps || (opts.save_every > 0 && done % opts.save_every == 0) {
                save(&worker, dir, done, ctx)?;
            }
        }
    }
    Ok(RankOutcome { steps, trace })
}

/// Saves the state after `done` steps (see [`checkpoint`]). Collective over the world.
fn save(
    worker: &Worker,
    dir: &std::path::Path,
    done: usize,
    ctx: &RankContext,
) -> anyhow::Result<()> {
    let world = &worker.mesh.world;
    let staging = checkpoint::staging_dir(dir, done);
    if world.rank() == 0 {
        if staging.exists() {
            std::fs::remove_dir_all(&staging)?;
        }
        std::fs::create_dir_all(&staging)
            .with_context(|| format!("cannot create {}", staging.display()))?;
    }
    world.barrier()?;
    let c = worker.mesh.coord;
    let entry_path = |pp: usize, tp: usize| staging.join(format!("pp{pp}-tp{tp}.entry.json"));
    if c.dp == 0 {
        let entry =
            checkpoint::write_rank_file(&staging, c.pp, c.tp, &worker.checkpoint_shards()?)?;
        checkpoint::write_atomic(&entry_path(c.pp, c.tp), &serde_json::to_vec(&entry)?)?;
    }
    world.barrier()?;
    if world.rank() == 0 {
        let mut files = Vec::new();
        for pp in 0..ctx.cfg.pp {
            for tp in 0..ctx.cfg.tp {
                let p = entry_path(pp, tp);
                let entry: FileEntry = serde_json::from_slice(&std::fs::read(&p)?)?;
                std::fs::remove_file(&p)?;
                files.push(entry);
            }
        }
        let manifest = Manifest {
            format: checkpoint::FORMAT.into(),
            step: done,
            config: ctx.cfg.clone(),
            corpus: ctx.corpus_info.clone(),
            data_position: done,
            rng_seed: ctx.cfg.seed,
            optimizer_t: worker.opt.t,
            optimizer: worker.opt.config,
            files,
        };
        checkpoint::commit(dir, &manifest, ctx.opts.keep)?;
    }
    Ok(())
}

/// Rank 0's outputs while training: the metrics file and the progress display.
struct Sink {
    metrics: Mutex<Option<std::fs::File>>,
    progress: bool,
    tty: bool,
    steps: usize,
    start: Instant,
}

impl Sink {
    fn open(opts: &TrainOptions, cfg: &TrainConfig) -> anyhow::Result<Sink> {
        let metrics = match &opts.metrics {
            Some(p) => Some(
                std::fs::File::create(p)
                    .with_context(|| format!("cannot create --metrics {}", p.display()))?,
            ),
            None => None,
        };
        Ok(Sink {
            metrics: Mutex::new(metrics),
            progress: opts.progress,
            tty: std::io::stderr().is_terminal(),
            steps: cfg.steps,
            start: Instant::now(),
        })
    }

    fn step(&self, r: &StepRecord) {
        if let Some(f) = self
            .metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            let _ = writeln!(f, "{}", serde_json::to_string(r).unwrap_or_default());
        }
        if !self.progress {
            return;
        }
        let done = r.step + 1;
        let elapsed = self.start.elapsed().as_secs_f64();
        let eta = elapsed / done as f64 * (self.steps - done) as f64;
        let line = format!(
            "step {done:>5}/{} loss {:.4} | {:>6.0} tok/s | lr {:.2e} | eta {:.0}s",
            self.steps, r.loss, r.tokens_per_s, r.lr, eta
        );
        if self.tty {
            let width = 24;
            let filled = width * done / self.steps.max(1);
            eprint!(
                "\r[{}{}] {line}",
                "#".repeat(filled),
                ".".repeat(width - filled)
            );
            if done == self.steps {
                eprintln!();
            }
        } else if done == 1 || done == self.steps || done % (self.steps / 10).max(1) == 0 {
            eprintln!("{line}");
        }
    }

    fn finish(&self) {
        if let Some(f) = self
            .metrics
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_mut()
        {
            let _ = f.flush();
        }
    }
}
