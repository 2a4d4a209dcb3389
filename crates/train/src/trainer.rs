//! The training loop: start every rank (threads, or the processes of an MPI job), step,
//! save checkpoints, report.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context};
use candle_core::Tensor;
use switchyard_comm::local::Launcher;
use switchyard_comm::Communicator;
use switchyard_shard::ParamSource;

use crate::checkpoint::{self, fnv64, Checkpoint, CorpusInfo, FileEntry, FullState, Manifest};
use crate::data::Corpus;
use crate::report::{gather, Sink, StepRecord, TrainReport};
use crate::weights::Weights;
use crate::worker::Worker;
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

/// Trains `cfg` on `corpus` with the in-process backend, one thread per rank, and
/// returns the job's report. Every configuration error is reported before any worker
/// starts.
pub fn train(
    cfg: &TrainConfig,
    corpus: &Corpus,
    opts: &TrainOptions,
) -> anyhow::Result<TrainReport> {
    let ctx = RankContext::prepare(cfg, corpus, opts)?;
    let mut launcher =
        Launcher::new(cfg.world_size()).timeout(Duration::from_secs_f64(cfg.comm_timeout_secs));
    if cfg.threads_per_worker > 0 {
        launcher = launcher.threads_per_worker(cfg.threads_per_worker);
    }
    let reports = launcher
        .run(|world| run_rank(world, &ctx))
        .map_err(|e| anyhow!("{e}"))?;
    reports
        .into_iter()
        .next()
        .flatten()
        .ok_or_else(|| anyhow!("rank 0 returned no report"))
}

/// Trains as one rank of `world` (for example one process of an `mpirun` job): every
/// rank calls it; rank 0 gets the job's report, the others `None`. The world's size must
/// be `dp × pp × tp`.
pub fn train_rank(
    world: Arc<dyn Communicator>,
    cfg: &TrainConfig,
    corpus: &Corpus,
    opts: &TrainOptions,
) -> anyhow::Result<Option<TrainReport>> {
    if world.world_size() != cfg.world_size() {
        anyhow::bail!(
            "invalid configuration: the job has {} ranks but dp {} × pp {} × tp {} needs {}: start {} processes or change the layout",
            world.world_size(),
            cfg.dp,
            cfg.pp,
            cfg.tp,
            cfg.world_size(),
            cfg.world_size()
        );
    }
    let ctx = RankContext::prepare(cfg, corpus, opts)?;
    run_rank(world, &ctx)
}

/// What every rank shares.
struct RankContext<'a> {
    cfg: &'a TrainConfig,
    corpus: &'a Corpus,
    corpus_info: CorpusInfo,
    opts: &'a TrainOptions,
    start: Start,
}

impl<'a> RankContext<'a> {
    /// Checks the configuration, the data and whatever the run starts from.
    fn prepare(
        cfg: &'a TrainConfig,
        corpus: &'a Corpus,
        opts: &'a TrainOptions,
    ) -> anyhow::Result<Self> {
        cfg.validate()
            .map_err(|e| anyhow!("invalid configuration: {e}"))?;
        corpus.check(cfg.seq_len).map_err(anyhow::Error::msg)?;
        let corpus_info = CorpusInfo {
            name: corpus.name.clone(),
            bytes: corpus.len(),
            fnv64: fnv64(corpus.bytes()),
        };
        let start = prepare_start(cfg, opts, &corpus_info)?;
        Ok(RankContext {
            cfg,
            corpus,
            corpus_info,
            opts,
            start,
        })
    }
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

fn run_rank(
    world: Arc<dyn Communicator>,
    ctx: &RankContext,
) -> anyhow::Result<Option<TrainReport>> {
    let (cfg, opts) = (ctx.cfg, ctx.opts);
    let me = world.rank();
    let (source, first_step) = match &ctx.start {
        Start::Seed => (ParamSource::Init { seed: cfg.seed }, 0),
        Start::Weights(w) => (ParamSource::Full(w.clone()), 0),
        Start::Checkpoint { manifest, full } => {
            (ParamSource::Full(full.params.clone()), manifest.step)
        }
    };
    let mut worker = Worker::new(world, cfg, ctx.corpus, source)?;
    if let Start::Checkpoint { manifest, full } = &ctx.start {
        worker.restore_optimizer(&full.m, &full.v, manifest.optimizer_t)?;
    }
    // One timeline for every rank's trace: start the clocks together.
    worker.mesh.world.barrier()?;
    worker.set_epoch(Instant::now());
    let mut sink = match me {
        0 => Some(Sink::open(
            opts.metrics.as_deref(),
            opts.progress,
            cfg.steps,
        )?),
        _ => None,
    };
    let mut steps = Vec::new();
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
        if let Some(sink) = sink.as_mut() {
            sink.step(&StepRecord::of(cfg, &m));
        }
        steps.push(m);
        if let Some(dir) = &opts.checkpoint_dir {
            let done = step + 1;
            if done == cfg.steps || (opts.save_every > 0 && done % opts.save_every == 0) {
                save(&worker, dir, done, ctx)?;
            }
        }
    }
    gather(&worker, &steps, opts.trace.as_deref())
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
