//! The training loop: start every rank (threads, or the processes of an MPI job), step,
//! save checkpoints, report.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{err, fail, Context, Result, TrainError};
use candle_core::Tensor;
use switchyard_comm::local::Launcher;
use switchyard_comm::{Communicator, ReduceOp};
use switchyard_shard::ParamSource;

use crate::checkpoint::{self, Checkpoint, CorpusInfo, FileEntry, FullState, Manifest};
use crate::data::Dataset;
use crate::report::{gather, Sink, StepRecord, TrainReport};
use crate::run_dir;
use crate::weights::Weights;
use crate::worker::Worker;
use crate::{memory_info, TrainConfig};
use switchyard_models::Model;

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
    /// A fresh run into a `checkpoint_dir` that holds checkpoints moves them into
    /// `DIR/stale-<their run id>/` instead of refusing to start (see [`crate::run_dir`]).
    pub overwrite: bool,
    /// Resume even though the configuration's seed differs from the checkpoint's.
    pub allow_seed_change: bool,
    /// Checked at every step boundary (e.g. set by a signal handler). Once it is set on any
    /// rank, every rank stops after the same step (they agree through an all-reduce), a
    /// checkpoint is saved when `checkpoint_dir` is set, and the report is `interrupted`.
    pub stop: Option<Arc<AtomicBool>>,
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
        path: PathBuf,
    },
}

/// Trains `cfg` on `data` with the in-process backend, one thread per rank, and
/// returns the job's report. Every configuration error is reported before any worker
/// starts.
pub fn train<M: Model>(
    cfg: &TrainConfig<M>,
    data: &dyn Dataset,
    opts: &TrainOptions,
) -> Result<TrainReport> {
    // Every worker is a thread of this process: check its threads and memory first.
    cfg.validate()
        .and_then(|()| cfg.check_machine(cfg.world_size()))
        .map_err(|e| err!(Config, "invalid configuration: {e}"))?;
    // The estimate is of the device's memory: host memory bounds it only on the CPU (a
    // GPU's free memory is not something candle reports; `--max-memory-per-worker` is).
    let available = memory_info().available.filter(|_| cfg.device.is_cpu());
    crate::estimate::fits::check_fits(cfg, cfg.world_size(), available)?;
    let ctx = RankContext::prepare(cfg, data, opts)?;
    ctx.plan.apply()?;
    let mut launcher =
        Launcher::new(cfg.world_size()).timeout(Duration::from_secs_f64(cfg.comm_timeout_secs));
    if cfg.threads_per_worker > 0 {
        launcher = launcher.threads_per_worker(cfg.threads_per_worker);
    }
    let reports = launcher.run(|world| run_rank(world, &ctx))?;
    reports
        .into_iter()
        .next()
        .flatten()
        .ok_or_else(|| err!(Config, "rank 0 returned no report"))
}

/// Trains as one rank of `world` (for example one process of an `mpirun` job): every
/// rank calls it; rank 0 gets the job's report, the others `None`. The world's size must
/// be `dp × pp × tp`.
pub fn train_rank<M: Model>(
    world: Arc<dyn Communicator>,
    cfg: &TrainConfig<M>,
    data: &dyn Dataset,
    opts: &TrainOptions,
) -> Result<Option<TrainReport>> {
    if world.world_size() != cfg.world_size() {
        fail!(Config,
            "invalid configuration: the job has {} ranks but dp {} × pp {} × tp {} needs {}: start {} processes or change the layout",
            world.world_size(),
            cfg.dp,
            cfg.pp,
            cfg.tp,
            cfg.world_size(),
            cfg.world_size()
        );
    }
    // Each process checks the budget (the node's memory is shared by processes it does
    // not know of: `check_machine` is the launcher's).
    crate::estimate::fits::check_fits(cfg, 1, None)?;
    let ctx = RankContext::prepare(cfg, data, opts)?;
    // Only rank 0 changes the checkpoint directory; the others wait for it.
    if world.rank() == 0 {
        ctx.plan.apply()?;
    }
    world.barrier()?;
    run_rank(world, &ctx)
}

/// What every rank shares.
struct RankContext<'a, M: Model> {
    cfg: &'a TrainConfig<M>,
    data: &'a dyn Dataset,
    corpus_info: CorpusInfo,
    opts: &'a TrainOptions,
    start: Start,
    /// Recorded in every manifest this run writes.
    run_id: String,
    plan: DirPlan,
}

/// What happens to the checkpoint directory before the first step (see [`run_dir`]).
#[derive(Default)]
struct DirPlan {
    /// The checkpoint a resumed run starts from: (step, path).
    resumed: Option<(usize, PathBuf)>,
    /// Checkpoints to move aside, the directory name they go into, and why.
    aside: Vec<(usize, PathBuf)>,
    aside_name: String,
    why: String,
    dir: PathBuf,
}

impl DirPlan {
    /// Moves the stale checkpoints aside and says so, and what the run resumes from.
    fn apply(&self) -> Result<()> {
        if let Some((step, path)) = &self.resumed {
            eprintln!("switchyard: resumed from step {step} ({})", path.display());
        }
        if self.aside.is_empty() {
            return Ok(());
        }
        let into = run_dir::move_aside(&self.dir, &self.aside, &self.aside_name)?;
        let steps: Vec<String> = self.aside.iter().map(|(n, _)| n.to_string()).collect();
        eprintln!(
            "switchyard: moved the checkpoints of steps {} ({}) aside into {}",
            steps.join(", "),
            self.why,
            into.display()
        );
        Ok(())
    }
}

impl<'a, M: Model> RankContext<'a, M> {
    /// Checks the configuration, the data and whatever the run starts from.
    fn prepare(
        cfg: &'a TrainConfig<M>,
        data: &'a dyn Dataset,
        opts: &'a TrainOptions,
    ) -> Result<Self> {
        cfg.validate()
            .map_err(|e| err!(Config, "invalid configuration: {e}"))?;
        data.check(cfg.model.vocab_size().unwrap_or(usize::MAX), cfg.seq_len)?;
        let corpus_info = CorpusInfo {
            name: data.name().to_string(),
            bytes: data.train().len(),
            fnv64: data.fingerprint(),
        };
        let start = prepare_start(cfg, opts, &corpus_info)?;
        let (run_id, plan) = prepare_dir(cfg, opts, &start)?;
        Ok(RankContext {
            cfg,
            data,
            corpus_info,
            opts,
            start,
            run_id,
            plan,
        })
    }
}

/// Checks, before any work, that the run may write into its checkpoint directory (which
/// is created and probed), and plans what moves aside; returns the run id.
fn prepare_dir<M: Model>(
    cfg: &TrainConfig<M>,
    opts: &TrainOptions,
    start: &Start,
) -> Result<(String, DirPlan)> {
    let resumed = match start {
        Start::Checkpoint { manifest, path, .. } => Some((manifest.as_ref(), path)),
        _ => None,
    };
    let run_id = match resumed {
        Some((m, _)) if !m.run_id.is_empty() => m.run_id.clone(),
        _ => run_dir::new_run_id(cfg.seed),
    };
    let Some(dir) = &opts.checkpoint_dir else {
        return Ok((run_id, DirPlan::default()));
    };
    let plan = match resumed {
        Some((m, path)) => {
            run_dir::prepare_dir(dir)?;
            DirPlan {
                resumed: Some((m.step, path.clone())),
                aside: run_dir::steps_after(dir, m.step)?,
                aside_name: run_dir::stale_timeline_name(m.step),
                why: format!("the old timeline after step {}", m.step),
                dir: dir.clone(),
            }
        }
        None => {
            let aside = run_dir::check_fresh(dir, opts.overwrite)?;
            run_dir::prepare_dir(dir)?;
            DirPlan {
                resumed: None,
                aside_name: run_dir::overwrite_name(&aside),
                aside,
                why: "--overwrite".into(),
                dir: dir.clone(),
            }
        }
    };
    Ok((run_id, plan))
}

/// Loads and checks whatever the run starts from, before any worker starts.
fn prepare_start<M: Model>(
    cfg: &TrainConfig<M>,
    opts: &TrainOptions,
    corpus: &CorpusInfo,
) -> Result<Start> {
    if opts.resume.is_some() && opts.init.is_some() {
        fail!(
            Config,
            "--resume and --init exclude each other: resume continues a run, init starts a new one"
        );
    }
    if let Some(r) = opts.resume {
        let dir = opts
            .checkpoint_dir
            .as_ref()
            .ok_or_else(|| err!(Config, "--resume needs --checkpoint-dir"))?;
        let step = match r {
            Resume::Latest => None,
            Resume::Step(s) => Some(s),
        };
        let ckpt = Checkpoint::find(dir, step)?;
        let m = &ckpt.manifest;
        let saved = m
            .config_of::<M>()
            .with_context(|| format!("{}", ckpt.path.display()))?;
        if saved.model != cfg.model {
            fail!(Checkpoint,
                "{} holds a model {:?}, but this run builds {:?}: resume with the checkpoint's model flags",
                ckpt.path.display(),
                saved.model,
                cfg.model
            );
        }
        if m.corpus.bytes != corpus.bytes || m.corpus.fnv64 != corpus.fnv64 {
            fail!(Checkpoint,
                "{} was trained on {} ({} tokens); this run reads {} ({} tokens): pass the same --data (and --val-fraction) to resume",
                ckpt.path.display(),
                m.corpus.name,
                m.corpus.bytes,
                corpus.name,
                corpus.bytes
            );
        }
        if m.rng_seed != cfg.seed && !opts.allow_seed_change {
            fail!(Checkpoint,
                "{} was trained with --seed {}, but this run has --seed {}: resume with --seed {} (a different seed changes the data order), or pass --allow-seed-change",
                ckpt.path.display(),
                m.rng_seed,
                cfg.seed,
                m.rng_seed
            );
        }
        if m.step >= cfg.steps {
            fail!(
                Checkpoint,
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
            path: ckpt.path,
        });
    }
    if let Some(path) = &opts.init {
        let w = Weights::load(path, &cfg.model)?;
        if let Some(note) = w.note(path) {
            eprintln!("{note}");
        }
        if w.config != cfg.model {
            return Err(TrainError::ModelMismatch {
                path: path.display().to_string(),
                have: format!("{:?}", w.config),
                want: format!("{:?}", cfg.model),
            });
        }
        return Ok(Start::Weights(w.tensors));
    }
    Ok(Start::Seed)
}

fn run_rank<M: Model>(
    world: Arc<dyn Communicator>,
    ctx: &RankContext<M>,
) -> Result<Option<TrainReport>> {
    let (cfg, opts) = (ctx.cfg, ctx.opts);
    let me = world.rank();
    let (source, first_step) = match &ctx.start {
        Start::Seed => (ParamSource::Init { seed: cfg.seed }, 0),
        Start::Weights(w) => (ParamSource::Full(w.clone()), 0),
        Start::Checkpoint { manifest, full, .. } => {
            (ParamSource::Full(full.params.clone()), manifest.step)
        }
    };
    let mut worker = Worker::new(world, cfg, ctx.data, source)?;
    if let Start::Checkpoint { manifest, full, .. } = &ctx.start {
        worker.restore_optimizer(&full.m, &full.v, manifest.optimizer_t)?;
    }
    // One timeline for every rank's trace: start the clocks together.
    worker.mesh.world.barrier()?;
    worker.set_epoch(Instant::now());
    let mut sink = match me {
        0 => Some(Sink::open(
            opts.metrics.as_deref(),
            first_step > 0,
            opts.progress,
            cfg.steps,
        )?),
        _ => None,
    };
    let mut steps = Vec::new();
    // The newest complete checkpoint of this run, named when a later save fails.
    let mut last_good = ctx.plan.resumed.as_ref().map(|(_, p)| p.clone());
    let mut saved_this_run = false;
    let mut interrupted = false;
    for step in first_step..cfg.steps {
        let mut m = match worker.step(step)? {
            Ok(m) => m,
            Err(nf) if nf.rank == me => {
                let c = worker.mesh.coord;
                return Err(TrainError::NonFinite {
                    step: nf.step,
                    rank: me,
                    pp: c.pp,
                    dp: c.dp,
                    tp: c.tp,
                    detail: nf.detail.unwrap_or_default(),
                });
            }
            // Another rank reports it; stop here without an error of our own.
            Err(_) => break,
        };
        let done = step + 1;
        if done == cfg.steps || (cfg.eval_every > 0 && done % cfg.eval_every == 0) {
            m.val_loss = worker.validation_loss(cfg.eval_batches)?;
        }
        if let Some(sink) = sink.as_mut() {
            sink.step(&StepRecord::of(cfg, &m));
        }
        // Every action's times are kept for the trace only: without one, a long run
        // would hold them all (about 1 KiB a step on the tiny GPT with 8 microbatches,
        // growing with actions per step).
        if opts.trace.is_none() {
            m.exec.events = Vec::new();
            m.expert_comm = Vec::new();
        }
        steps.push(m);
        let stop = done < cfg.steps && stop_requested(&worker, opts.stop.as_deref())?;
        if let Some(dir) = &opts.checkpoint_dir {
            let due = done == cfg.steps || (opts.save_every > 0 && done % opts.save_every == 0);
            if due || stop {
                save_or_explain(&worker, dir, done, ctx, last_good.as_deref())?;
                last_good = Some(checkpoint::step_dir(dir, done));
                saved_this_run = true;
            }
        }
        if stop {
            interrupted = true;
            break;
        }
    }
    let mut report = gather(&worker, &steps, opts.trace.as_deref())?;
    if let Some(r) = report.as_mut() {
        r.interrupted = interrupted;
        r.last_checkpoint = last_good.filter(|_| saved_this_run);
    }
    Ok(report)
}

/// Whether any rank's stop flag is set: collective, so every rank stops after the same step.
fn stop_requested<M: Model>(worker: &Worker<M>, flag: Option<&AtomicBool>) -> Result<bool> {
    let Some(flag) = flag else {
        return Ok(false);
    };
    let mine = if flag.load(Ordering::SeqCst) {
        1f32
    } else {
        0f32
    };
    let any = worker
        .mesh
        .world
        .all_reduce(
            &Tensor::new(&[mine], &candle_core::Device::Cpu)?,
            ReduceOp::Max,
        )?
        .to_vec1::<f32>()?;
    Ok(any[0] > 0.0)
}

/// [`save`], with an error that names the last good checkpoint when it fails.
fn save_or_explain<M: Model>(
    worker: &Worker<M>,
    dir: &Path,
    done: usize,
    ctx: &RankContext<M>,
    last_good: Option<&Path>,
) -> Result<()> {
    save(worker, dir, done, ctx).map_err(|e| {
        let last = match last_good {
            Some(p) => format!("the last good checkpoint is {}", p.display()),
            None => "no earlier checkpoint of this run exists".into(),
        };
        // One message: the local launcher reports a failed rank's error by its Display.
        err!(
            Checkpoint,
            "saving the checkpoint of step {done} into {} failed ({e:#}); {last}",
            dir.display()
        )
    })
}

/// Saves the state after `done` steps (see [`checkpoint`]). Collective over the world.
fn save<M: Model>(worker: &Worker<M>, dir: &Path, done: usize, ctx: &RankContext<M>) -> Result<()> {
    let world = &worker.mesh.world;
    let staging = checkpoint::staging_dir(dir, done);
    if world.rank() == 0 {
        if staging.exists() {
            std::fs::remove_dir_all(&staging)
                .with_context(|| format!("cannot remove {}", staging.display()))?;
        }
        std::fs::create_dir_all(&staging)
            .with_context(|| format!("cannot create {}", staging.display()))?;
    }
    world.barrier()?;
    let c = worker.mesh.coord;
    let entry_path =
        |pp: usize, tp: usize, ep: usize| staging.join(format!("pp{pp}-tp{tp}-ep{ep}.entry.json"));
    // Every replica takes part: under ZeRO the moments are gathered from all of them.
    // The first replica writes; under `--ep` the others of the first expert group
    // write their experts.
    let shards = worker.checkpoint_shards()?;
    let writers = ctx.cfg.ep.max(1);
    if c.dp < writers {
        let entry = checkpoint::write_rank_file(&staging, c.pp, c.tp, c.dp, &shards)?;
        let path = entry_path(c.pp, c.tp, c.dp);
        checkpoint::write_atomic(&path, &serde_json::to_vec(&entry)?)?;
    }
    world.barrier()?;
    if world.rank() == 0 {
        let mut files = Vec::new();
        for pp in 0..ctx.cfg.pp {
            for tp in 0..ctx.cfg.tp {
                for ep in 0..writers {
                    let p = entry_path(pp, tp, ep);
                    let read = std::fs::read(&p)
                        .with_context(|| format!("cannot read {}", p.display()))?;
                    let entry: FileEntry = serde_json::from_slice(&read)?;
                    std::fs::remove_file(&p)
                        .with_context(|| format!("cannot remove {}", p.display()))?;
                    files.push(entry);
                }
            }
        }
        let manifest = Manifest {
            format: checkpoint::FORMAT.into(),
            run_id: ctx.run_id.clone(),
            step: done,
            model_kind: M::NAME.into(),
            config: checkpoint::erase_model(ctx.cfg)?,
            corpus: ctx.corpus_info.clone(),
            data_position: done,
            rng_seed: ctx.cfg.seed,
            optimizer_t: worker.opt.t(),
            optimizer: worker.opt.config(),
            files,
        };
        checkpoint::commit(dir, &manifest, ctx.opts.keep)?;
    }
    Ok(())
}
