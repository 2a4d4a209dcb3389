//! `switchyard train`: flags over an optional TOML file over the defaults.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};
use clap::Args;
use switchyard_models::SplitSpec;
use switchyard_train::data::Corpus;
use switchyard_train::{train, train_rank, Resume, TrainConfig, TrainOptions};

#[derive(Args, Default)]
pub struct TrainArgs {
    /// A TOML file with any of the settings below (flags win); see docs/reference/config.md
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Data-parallel replicas
    #[arg(long)]
    pub dp: Option<usize>,
    /// Pipeline ranks
    #[arg(long)]
    pub pp: Option<usize>,
    /// Tensor-parallel ranks
    #[arg(long)]
    pub tp: Option<usize>,
    /// gpipe, 1f1b, interleaved (2 virtual stages unless --virtual-stages), zb-h1, or
    /// the path of a CSV schedule (one row per pipeline rank: `0,0F0,0F1,0B0,0B1`)
    #[arg(long)]
    pub schedule: Option<String>,
    /// Microbatches per step on each replica
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Model chunks per pipeline rank (interleaved)
    #[arg(long)]
    pub virtual_stages: Option<usize>,
    /// Layers per stage: even, balanced, or counts such as 3,2
    #[arg(long)]
    pub split: Option<SplitSpec>,
    #[arg(long)]
    pub steps: Option<usize>,
    /// Sequences per step, over all replicas
    #[arg(long)]
    pub batch: Option<usize>,
    #[arg(long)]
    pub seq_len: Option<usize>,
    #[arg(long)]
    pub d_model: Option<usize>,
    #[arg(long)]
    pub layers: Option<usize>,
    #[arg(long)]
    pub heads: Option<usize>,
    /// Share the token embedding with the LM head
    #[arg(long)]
    pub tied: bool,
    /// Peak learning rate
    #[arg(long)]
    pub lr: Option<f64>,
    #[arg(long)]
    pub min_lr: Option<f64>,
    #[arg(long)]
    pub warmup: Option<usize>,
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Clip the global gradient norm (0: off)
    #[arg(long)]
    pub grad_clip: Option<f64>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// A text file to train on (default: the bundled corpus)
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Write JSON lines, one per step
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write a Chrome trace of every action of every rank (open in Perfetto)
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Compute threads per worker (default: the cores shared out)
    #[arg(long)]
    pub threads_per_worker: Option<usize>,
    /// Bound on any blocking communication, in seconds
    #[arg(long)]
    pub comm_timeout: Option<f64>,
    /// Save checkpoints here (step-N/ directories; the newest --keep are kept)
    #[arg(long)]
    pub checkpoint_dir: Option<PathBuf>,
    /// Save every N steps (and at the end)
    #[arg(long)]
    pub save_every: Option<usize>,
    /// Keep the newest K checkpoints (0: all)
    #[arg(long)]
    pub keep: Option<usize>,
    /// Continue from the newest complete checkpoint in --checkpoint-dir (any layout)
    #[arg(long)]
    pub resume: bool,
    /// Continue from the checkpoint saved after STEP steps
    #[arg(long, value_name = "STEP")]
    pub resume_from: Option<usize>,
    /// Start from the weights in a .safetensors file with nanoGPT names (e.g. from `switchyard export` or PyTorch)
    #[arg(long, value_name = "FILE")]
    pub init: Option<PathBuf>,
    /// `local`: one thread per rank in this process. `mpi`: this process is one rank of
    /// an `mpirun -np <dp·pp·tp>` job (build with `--features mpi`)
    #[arg(long, value_enum, default_value_t = Backend::Local)]
    pub backend: Backend,
    /// No progress bar
    #[arg(long)]
    pub quiet: bool,
}

/// Where the ranks run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// One thread per rank in this process.
    #[default]
    Local,
    /// One process per rank, started by `mpirun`.
    Mpi,
}

/// The settings a TOML file may hold besides [`TrainConfig`]'s.
const FILE_ONLY: [&str; 6] = [
    "data",
    "metrics",
    "trace",
    "checkpoint_dir",
    "save_every",
    "keep",
];

fn load_file(path: &Path) -> anyhow::Result<(TrainConfig, toml::Table)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --config {}", path.display()))?;
    let mut table: toml::Table = text
        .parse()
        .with_context(|| format!("--config {} is not valid TOML", path.display()))?;
    let mut extra = toml::Table::new();
    for k in FILE_ONLY {
        if let Some(v) = table.remove(k) {
            extra.insert(k.into(), v);
        }
    }
    let cfg: TrainConfig = toml::Value::Table(table)
        .try_into()
        .with_context(|| format!("--config {}", path.display()))?;
    Ok((cfg, extra))
}

/// The configuration and options `a` describes.
pub fn resolve(a: &TrainArgs) -> anyhow::Result<(TrainConfig, Option<PathBuf>, TrainOptions)> {
    let (mut c, file) = match &a.config {
        Some(p) => load_file(p)?,
        None => (TrainConfig::default(), toml::Table::new()),
    };
    let path = |k: &str| file.get(k).and_then(|v| v.as_str()).map(PathBuf::from);
    macro_rules! set {
        ($($flag:ident => $($field:ident).+),* $(,)?) => {
            $(if let Some(v) = a.$flag.clone() { c.$($field).+ = v; })*
        };
    }
    set!(dp => dp, pp => pp, tp => tp, schedule => schedule, microbatches => microbatches,
        virtual_stages => virtual_stages, split => split, steps => steps, batch => batch,
        seq_len => seq_len, d_model => model.d_model, layers => model.n_layer,
        heads => model.n_head, lr => lr, min_lr => min_lr, warmup => warmup,
        weight_decay => weight_decay, grad_clip => grad_clip, seed => seed,
        threads_per_worker => threads_per_worker, comm_timeout => comm_timeout_secs);
    if a.tied {
        c.model.tied_embeddings = true;
    }
    // Interleaving with one chunk per rank is plain 1F1B: default to two.
    if c.schedule == "interleaved" && a.virtual_stages.is_none() && c.virtual_stages == 1 {
        c.virtual_stages = 2;
    }
    if a.lr.is_some() && a.min_lr.is_none() && c.min_lr > c.lr {
        c.min_lr = c.lr / 10.0;
    }
    if a.seq_len.is_some() && c.model.block_size < c.seq_len {
        c.model.block_size = c.seq_len;
    }
    let int = |k: &str| {
        file.get(k)
            .and_then(|v| v.as_integer())
            .map(|v| v.max(0) as usize)
    };
    let resume = match (a.resume, a.resume_from) {
        (_, Some(s)) => Some(Resume::Step(s)),
        (true, None) => Some(Resume::Latest),
        (false, None) => None,
    };
    let opts = TrainOptions {
        metrics: a.metrics.clone().or_else(|| path("metrics")),
        trace: a.trace.clone().or_else(|| path("trace")),
        progress: !a.quiet,
        checkpoint_dir: a.checkpoint_dir.clone().or_else(|| path("checkpoint_dir")),
        save_every: a.save_every.or_else(|| int("save_every")).unwrap_or(0),
        keep: a.keep.or_else(|| int("keep")).unwrap_or(3),
        resume,
        init: a.init.clone(),
    };
    Ok((c, a.data.clone().or_else(|| path("data")), opts))
}

pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let (cfg, data, mut opts) = resolve(&a)?;
    // Under MPI every process runs this; only rank 0 speaks.
    let rank0 = match a.backend {
        Backend::Local => true,
        Backend::Mpi => switchyard_comm::mpi::launcher_rank().unwrap_or(0) == 0,
    };
    opts.progress &= rank0;
    cfg.validate()
        .map_err(|e| anyhow!("invalid configuration: {e}"))?;
    let corpus = match &data {
        Some(p) => Corpus::from_file(p).map_err(anyhow::Error::msg)?,
        None => Corpus::bundled(),
    };
    let workers = cfg.world_size();
    // Workers sharing this machine: all of them on threads; under MPI, this node's.
    let local_workers = match a.backend {
        Backend::Local => workers,
        Backend::Mpi => std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1),
    };
    let threads = match cfg.threads_per_worker {
        0 => switchyard_comm::threads::default_threads_per_worker(local_workers),
        n => n,
    };
    super::set_gemm_threads(threads);
    if rank0 {
        eprintln!(
            "switchyard: GPT {} layers × d {} ({:.2}M parameters) on {} ({} bytes); {} workers: dp {} × pp {} × tp {}, {} with {} microbatches",
            cfg.model.n_layer,
            cfg.model.d_model,
            cfg.model.param_count() as f64 / 1e6,
            corpus.name,
            corpus.len(),
            workers,
            cfg.dp,
            cfg.pp,
            cfg.tp,
            cfg.schedule,
            cfg.microbatches
        );
    }
    let report = match a.backend {
        Backend::Local => train(&cfg, &corpus, &opts)?,
        Backend::Mpi => match run_mpi(&cfg, &corpus, &opts, threads)? {
            Some(report) => report,
            None => return Ok(()),
        },
    };
    print!("{}", report.render(&cfg));
    if let Some(p) = &opts.metrics {
        println!("metrics: {}", p.display());
    }
    if let Some(p) = &opts.trace {
        println!("trace: {} (open in https://ui.perfetto.dev)", p.display());
    }
    if let Some(p) = &opts.checkpoint_dir {
        println!("checkpoints: {}", p.display());
    }
    Ok(())
}

/// One rank of an `mpirun` job; rank 0 gets the report. A rank whose work fails ends
/// the whole job through `MPI_Abort` (printing `rank R failed: …`), so that no other
/// rank waits for it until its timeout.
fn run_mpi(
    cfg: &TrainConfig,
    corpus: &Corpus,
    opts: &TrainOptions,
    threads: usize,
) -> anyhow::Result<Option<switchyard_train::TrainReport>> {
    let world = switchyard_comm::mpi::init()?;
    let pool = switchyard_comm::threads::worker_pool(threads).map_err(anyhow::Error::msg)?;
    match pool.install(|| train_rank(world, cfg, corpus, opts)) {
        Ok(report) => Ok(report),
        Err(e) => switchyard_comm::mpi::abort(1, &format!("{e:#}")),
    }
}
