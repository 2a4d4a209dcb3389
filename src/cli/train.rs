//! `switchyard train`: flags over an optional TOML file over the defaults.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context};
use clap::Args;
use switchyard_models::SplitSpec;
use switchyard_models::{GptConfig, OpsBackend, Precision};
use switchyard_schedule::{ScheduleChoice, ScheduleKind};
use switchyard_train::data::{self, Corpus, DataSpec, Dataset, TokenWidth};
use switchyard_train::optim::Decay;
mod file;
mod moe;
mod report;

use file::{load_file, model_of, FileOnly};
use moe::MoeArgs;
use report::{precision_note, report_json};
use switchyard_train::{
    train, train_rank, DeviceSpec, Resume, TrainConfig, TrainError, TrainOptions,
};

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
    /// Expert parallelism: groups of this many data-parallel replicas spread each
    /// mixture's experts over themselves (all-to-all); divides --dp and --experts
    #[arg(long)]
    pub ep: Option<usize>,
    /// gpipe, 1f1b, interleaved (2 virtual stages unless --virtual-stages), zb-h1, zb-h2, or
    /// the path of a CSV schedule (one row per pipeline rank: `0,0F0,0F1,0B0,0B1`;
    /// `./NAME` for a file named like a schedule)
    #[arg(long)]
    pub schedule: Option<ScheduleChoice>,
    /// Microbatches per step on each replica
    #[arg(long)]
    pub microbatches: Option<usize>,
    /// Model chunks per pipeline rank (interleaved)
    #[arg(long)]
    pub virtual_stages: Option<usize>,
    /// Layers per stage: even, balanced, or counts such as 3,2
    #[arg(long)]
    pub split: Option<SplitSpec>,
    /// ZeRO stage over the data-parallel replicas: 0 (off), 1 (AdamW's moments sharded:
    /// gradients reduce-scattered, parameters all-gathered), 2 (gradients sharded too,
    /// reduce-scattered segment by segment during the backward) or 3 (parameters sharded
    /// too, gathered segment by segment before use; CPU only)
    #[arg(long, value_name = "0|1|2|3")]
    pub zero: Option<u8>,
    /// The whole layout in one: `auto` (the fastest that `switchyard plan` finds fitting
    /// --workers and the memory budget) or its text form, such as "dp2 pp2 tp1 1f1b m8"
    /// (add "recompute-full" or "recompute-selective" for activation recomputation, "ep2"
    /// for expert parallelism, "sp" for sequence parallelism, "zero1" for ZeRO)
    #[arg(long, value_name = "auto|LAYOUT",
          conflicts_with_all = ["dp", "pp", "tp", "ep", "schedule", "microbatches",
                                "virtual_stages", "recompute", "zero", "sequence_parallel"])]
    pub layout: Option<String>,
    /// Workers for --layout auto (default: 4); `switchyard plan` plans for this many
    #[arg(long)]
    pub workers: Option<usize>,
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
    /// Hidden dropout while training: the probability of dropping each element of the
    /// embeddings' output and of each residual branch (GPT-2 trained with 0.1), in
    /// [0, 1); the same masks on every layout. Default 0
    #[arg(long, value_name = "P")]
    pub hidden_dropout: Option<f64>,
    #[command(flatten)]
    pub moe: MoeArgs,
    /// Share the token embedding with the LM head
    #[arg(long)]
    pub tied: bool,
    /// How the ops compute: `fused` (the CPU kernels; the default) or `composed` (their
    /// twins from candle's own ops, which run on every device; also on the CPU)
    #[arg(long, value_name = "fused|composed")]
    pub ops: Option<OpsBackend>,
    /// What the products multiply in: `f32` (the default) or `bf16` (bf16 products with
    /// f32 sums, f32 master weights, AdamW state and gradients, bf16 saved activations;
    /// native on CPUs with AMX or AVX-512 BF16, emulated elsewhere)
    #[arg(long, value_name = "f32|bf16")]
    pub precision: Option<Precision>,
    /// The candle device: cpu (the default), cuda:N or metal (a build with
    /// `--features cuda` or `--features metal`)
    #[arg(long, value_name = "cpu|cuda:N|metal")]
    pub device: Option<DeviceSpec>,
    /// Peak learning rate
    #[arg(long)]
    pub lr: Option<f64>,
    #[arg(long)]
    pub min_lr: Option<f64>,
    #[arg(long)]
    pub warmup: Option<usize>,
    /// AdamW's decoupled weight decay
    #[arg(long)]
    pub weight_decay: Option<f64>,
    /// Which parameters decay: matrices (weights with 2+ dims, as nanoGPT) or all (every
    /// parameter, as torch.optim.AdamW)
    #[arg(long, value_name = "matrices|all")]
    pub decay: Option<Decay>,
    /// AdamW's β₁, in [0, 1)
    #[arg(long)]
    pub beta1: Option<f64>,
    /// AdamW's β₂, in [0, 1)
    #[arg(long)]
    pub beta2: Option<f64>,
    /// AdamW's ε (> 0), added to the root of the second moment
    #[arg(long)]
    pub eps: Option<f64>,
    /// Clip the global gradient norm (0: off)
    #[arg(long)]
    pub grad_clip: Option<f64>,
    #[arg(long)]
    pub seed: Option<u64>,
    /// A text file, or a token file ending in .bin (nanoGPT's train.bin: u16 ids; a
    /// val.bin beside it is the validation split) (default: the bundled corpus)
    #[arg(long)]
    pub data: Option<PathBuf>,
    /// Tokenize the --data text with this Hugging Face tokenizer.json (cached beside the
    /// text in .switchyard-cache/)
    #[arg(long, value_name = "FILE")]
    pub tokenizer: Option<PathBuf>,
    /// The width of a .bin token file's ids: u16 (nanoGPT's) or u32
    #[arg(long, value_name = "u16|u32")]
    pub token_width: Option<TokenWidth>,
    /// The model's vocabulary (default: the tokenizer's, 256 for bytes, or a token
    /// file's largest id + 1)
    #[arg(long)]
    pub vocab_size: Option<usize>,
    /// Hold out the last fraction of the data for validation (default 0: none)
    #[arg(long)]
    pub val_fraction: Option<f64>,
    /// Report the validation loss every N steps (and at the end)
    #[arg(long, value_name = "N")]
    pub eval_every: Option<usize>,
    /// Batches of the validation split per validation loss (default 8)
    #[arg(long, value_name = "K")]
    pub eval_batches: Option<usize>,
    /// Consecutive windows from offset 0, in order (wrapping at the end), instead of
    /// seeded random offsets
    #[arg(long)]
    pub no_shuffle: bool,
    /// Write JSON lines, one per step
    #[arg(long)]
    pub metrics: Option<PathBuf>,
    /// Write a Chrome trace of every action of every rank (open in Perfetto)
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Write the end report as JSON: the layout, the config, and per rank its coords,
    /// measured peak memory by category, bubble and tokens/s
    #[arg(long, value_name = "FILE")]
    pub report_json: Option<PathBuf>,
    /// Compute threads per worker (default: the cores shared out)
    #[arg(long)]
    pub threads_per_worker: Option<usize>,
    /// Refuse to start when the estimated peak memory of any worker exceeds this
    /// (512MiB, 2GiB, 1.5GB); without it, refuse beyond this machine's available memory
    #[arg(long, value_name = "SIZE")]
    pub max_memory_per_worker: Option<switchyard_train::Bytes>,
    /// Activation recomputation: none (keep everything), selective (the MLP's GELU
    /// output is computed again in the backward) or full (each block keeps only its
    /// input and runs forward again before its backward)
    #[arg(long, value_name = "none|selective|full")]
    pub recompute: Option<switchyard_train::Recompute>,
    /// Sequence parallelism (with --tp > 1): LayerNorms and the residual stream run on
    /// seq-len / tp positions per tensor-parallel rank; each block's all-reduces become
    /// an all-gather and a reduce-scatter (needs --seq-len divisible by --tp)
    #[arg(long)]
    pub sequence_parallel: bool,
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
    /// Continue from the newest complete checkpoint in --checkpoint-dir (any layout); the
    /// steps, learning-rate schedule and seed come from the checkpoint unless given
    #[arg(long)]
    pub resume: bool,
    /// Continue from the checkpoint saved after STEP steps (later ones are moved aside)
    #[arg(long, value_name = "STEP")]
    pub resume_from: Option<usize>,
    /// Start a new run in a --checkpoint-dir that holds checkpoints: move them into
    /// DIR/stale-<run id>/ (nothing is deleted)
    #[arg(long, conflicts_with_all = ["resume", "resume_from"])]
    pub overwrite: bool,
    /// Resume with a --seed other than the checkpoint's (changes the data order)
    #[arg(long)]
    pub allow_seed_change: bool,
    /// Start from the weights in a .safetensors file with nanoGPT names (e.g. from `switchyard export` or PyTorch),
    /// or a Hugging Face GPT-2 directory (config.json + model.safetensors, e.g. GPT-2 from the Hub)
    #[arg(long, value_name = "PATH")]
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

/// The data a run reads, and whether its vocabulary was given (else the data's is used).
pub struct DataChoice {
    pub spec: DataSpec,
    pub vocab_given: bool,
}

/// The error of a `--config` key that names a setting by its name (`ops`, `precision`).
fn file_key_error(a: &TrainArgs, key: &str, e: &dyn std::fmt::Display) -> anyhow::Error {
    anyhow!(
        "--config {}: key `{key}`: {e}",
        a.config.clone().unwrap_or_default().display()
    )
}

/// The configuration and options `a` describes.
pub fn resolve(
    a: &TrainArgs,
) -> anyhow::Result<(TrainConfig<GptConfig>, DataChoice, TrainOptions)> {
    let (mut c, file, vocab_in_file) = match &a.config {
        Some(p) => load_file(p)?,
        None => (
            TrainConfig::<GptConfig>::default(),
            FileOnly::default(),
            false,
        ),
    };
    // Weights to start from say what model they are: it is the default of every model
    // flag (a flag that disagrees is then refused by the trainer, naming both).
    let init_model = match (&a.init, &a.config) {
        (Some(path), None) => model_of(path)?,
        _ => None,
    };
    if let Some(m) = &init_model {
        c.model = m.clone();
    }
    macro_rules! set {
        ($($flag:ident => $($field:ident).+),* $(,)?) => {
            $(if let Some(v) = a.$flag.clone() { c.$($field).+ = v; })*
        };
    }
    set!(dp => dp, pp => pp, tp => tp, ep => ep, zero => zero, schedule => schedule, microbatches => microbatches,
        virtual_stages => virtual_stages, split => split, steps => steps, batch => batch,
        seq_len => seq_len, d_model => model.d_model, layers => model.n_layer,
        heads => model.n_head, hidden_dropout => model.hidden_dropout, lr => lr, min_lr => min_lr, warmup => warmup,
        weight_decay => weight_decay, decay => decay, beta1 => beta1, beta2 => beta2,
        eps => eps, grad_clip => grad_clip, seed => seed,
        threads_per_worker => threads_per_worker, comm_timeout => comm_timeout_secs,
        vocab_size => model.vocab_size, val_fraction => val_fraction,
        eval_every => eval_every, eval_batches => eval_batches, device => device,
        recompute => recompute);
    a.moe.apply(&mut c.model.moe);
    if let Some(b) = a.max_memory_per_worker {
        c.max_memory_per_worker = Some(b);
    }
    if let Some(ops) = &file.ops {
        c.model.ops = ops.parse().map_err(|e| file_key_error(a, "ops", &e))?;
    }
    if let Some(ops) = a.ops {
        c.model.ops = ops;
    }
    if let Some(p) = &file.precision {
        c.model.precision = p.parse().map_err(|e| file_key_error(a, "precision", &e))?;
    }
    if let Some(p) = a.precision {
        c.model.precision = p;
    }
    // Off the CPU every op runs as its composed twin; saying so makes the memory estimate
    // and the report describe what runs.
    if !c.device.is_cpu() {
        c.model.ops = OpsBackend::Composed;
    }
    if a.tied {
        c.model.tied_embeddings = true;
    }
    if a.no_shuffle {
        c.shuffle = false;
    }
    if a.sequence_parallel {
        c.sequence_parallel = true;
    }
    let resume = match (a.resume, a.resume_from) {
        (_, Some(s)) => Some(Resume::Step(s)),
        (true, None) => Some(Resume::Latest),
        (false, None) => None,
    };
    let checkpoint_dir = a.checkpoint_dir.clone().or(file.checkpoint_dir);
    if checkpoint_dir.is_none() {
        // Both only matter when checkpoints are saved: without a directory they would
        // silently do nothing.
        let config = a.config.clone().unwrap_or_default();
        let from = |flag: &str, key: &str, flag_set: bool, v: usize| match flag_set {
            true => format!("{flag} {v}"),
            false => format!("`{key} = {v}` in --config {}", config.display()),
        };
        if let Some(n) = a.save_every.or(file.save_every) {
            bail!(
                "{} needs --checkpoint-dir (or `checkpoint_dir` in --config): without a \
                 checkpoint directory nothing is saved",
                from("--save-every", "save_every", a.save_every.is_some(), n)
            );
        }
        if let Some(n) = a.keep.or(file.keep) {
            bail!(
                "{} needs --checkpoint-dir (or `checkpoint_dir` in --config): it says how \
                 many saved checkpoints to keep",
                from("--keep", "keep", a.keep.is_some(), n)
            );
        }
    }
    if let (Some(r), Some(dir)) = (resume, &checkpoint_dir) {
        super::resume::restore(&mut c, a, dir, r)?;
    }
    // Interleaving with one chunk per rank is plain 1F1B: default to two.
    // (`interleaved:V` asks for V.)
    if let Some(ScheduleKind::Interleaved { virtual_stages }) = c.schedule.kind() {
        if a.virtual_stages.is_none() && c.virtual_stages == 1 {
            c.virtual_stages = virtual_stages;
        }
    }
    if a.lr.is_some() && a.min_lr.is_none() && c.min_lr > c.lr {
        c.min_lr = c.lr / 10.0;
    }
    if a.seq_len.is_some() && c.model.block_size < c.seq_len && init_model.is_none() {
        c.model.block_size = c.seq_len;
    }
    let opts = TrainOptions {
        metrics: a.metrics.clone().or(file.metrics),
        trace: a.trace.clone().or(file.trace),
        progress: !a.quiet,
        checkpoint_dir,
        save_every: a.save_every.or(file.save_every).unwrap_or(0),
        keep: a.keep.or(file.keep).unwrap_or(3),
        resume,
        init: a.init.clone(),
        overwrite: a.overwrite,
        allow_seed_change: a.allow_seed_change,
        stop: None,
    };
    let data = DataChoice {
        spec: DataSpec {
            data: a.data.clone().or(file.data),
            tokenizer: a.tokenizer.clone().or(file.tokenizer),
            width: a.token_width.or(file.token_width).unwrap_or_default(),
            val_fraction: c.val_fraction,
        },
        vocab_given: a.vocab_size.is_some()
            || vocab_in_file
            || resume.is_some()
            || init_model.is_some(),
    };
    Ok((c, data, opts))
}

pub fn run(a: TrainArgs) -> anyhow::Result<()> {
    let (mut cfg, data, mut opts) = resolve(&a)?;
    // A device this build has no backend for is refused before the data is read.
    cfg.device.check()?;
    // Under MPI every process runs this; only rank 0 speaks.
    let rank0 = match a.backend {
        Backend::Local => true,
        Backend::Mpi => switchyard_comm::mpi::launcher_rank().unwrap_or(0) == 0,
    };
    opts.progress &= rank0;
    let corpus = data::open(&data.spec).map_err(anyhow::Error::msg)?;
    if !data.vocab_given {
        cfg.model.vocab_size = corpus.vocab_size();
    }
    match (&a.layout, a.workers) {
        (Some(l), _) if l == "auto" && matches!(a.backend, Backend::Mpi) => bail!(
            "--layout auto times this machine, and every process would choose on its own: \
             run `switchyard plan` once and give its layout (--layout \"dp2 pp2 tp1 1f1b m8\")"
        ),
        (Some(layout), workers) => {
            cfg = super::plan::choose_layout(cfg, layout, workers, rank0)?;
        }
        (None, Some(_)) => bail!("--workers is for --layout auto"),
        (None, None) => {}
    }
    cfg.validate()
        .map_err(|e| anyhow!("invalid configuration: {e}"))?;
    corpus
        .check(cfg.model.vocab_size, cfg.seq_len)
        .map_err(anyhow::Error::msg)?;
    let workers = cfg.world_size();
    // Workers sharing this machine: all of them on threads; under MPI, this node's.
    let local_workers = match a.backend {
        Backend::Local => workers,
        Backend::Mpi => std::env::var("OMPI_COMM_WORLD_LOCAL_SIZE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1),
    };
    // This machine's threads and memory, before any worker starts.
    let threads = cfg
        .check_machine(local_workers)
        .map_err(|e| anyhow!("invalid configuration: {e}"))?;
    super::set_gemm_threads(threads);
    // On threads, Ctrl-C and SIGTERM stop the run after the current step, with a save.
    // Under mpirun the signals belong to mpirun: it sends SIGTERM to end the job when a
    // rank fails (and forwards a Ctrl-C the same way), so a rank must not take it as a
    // request to finish its step with peers that are gone.
    let signals = match a.backend {
        Backend::Local => Some(super::interrupt::install()?),
        Backend::Mpi => None,
    };
    opts.stop = signals.as_ref().map(|s| std::sync::Arc::clone(&s.stop));
    if rank0 {
        eprintln!(
            "switchyard: GPT {} layers × d {}{}, vocabulary {} ({:.2}M parameters) on {} ({} tokens{}); {} workers: dp {} × pp {} × tp {}{}, {} with {} microbatches{}{}",
            cfg.model.n_layer,
            cfg.model.d_model,
            match cfg.model.moe.is_dense() {
                true => String::new(),
                false => format!(
                    ", {} blocks of {} experts (top {})",
                    cfg.model.moe.moe_layers(cfg.model.n_layer),
                    cfg.model.moe.experts,
                    cfg.model.moe.top_k
                ),
            },
            cfg.model.vocab_size,
            cfg.model.param_count() as f64 / 1e6,
            corpus.name,
            corpus.len(),
            match corpus.validation() {
                Some(v) => format!(", {} held out for validation", v.len()),
                None => String::new(),
            },
            workers,
            cfg.dp,
            cfg.pp,
            cfg.tp,
            match (cfg.ep, cfg.splits_sequence()) {
                (1, false) => String::new(),
                (1, true) => " (sequence parallel)".to_string(),
                (ep, _) => format!(" (experts over ep {ep})"),
            },
            cfg.schedule,
            cfg.microbatches,
            match cfg.zero {
                0 => String::new(),
                z => format!(", ZeRO stage {z}"),
            },
            precision_note(cfg.model.precision),
        );
    }
    let report = match a.backend {
        Backend::Local => train(&cfg, &corpus, &opts).map_err(with_flag_advice)?,
        Backend::Mpi => match run_mpi(&cfg, &corpus, &opts, threads)? {
            Some(report) => report,
            None => return Ok(()),
        },
    };
    print!("{}", report.render(&cfg));
    if let Some(p) = &a.report_json {
        let mut text = serde_json::to_vec_pretty(&report_json(&cfg, &report))?;
        text.push(b'\n');
        std::fs::write(p, text)
            .with_context(|| format!("cannot write --report-json {}", p.display()))?;
        println!("report: {}", p.display());
    }
    if let Some(p) = &opts.metrics {
        println!("metrics: {}", p.display());
    }
    if let Some(p) = &opts.trace {
        println!("trace: {} (open in https://ui.perfetto.dev)", p.display());
    }
    if let Some(p) = &opts.checkpoint_dir {
        println!("checkpoints: {}", p.display());
    }
    if let Some(signals) = signals.as_ref().filter(|_| report.interrupted) {
        let code = signals.report(&report, cfg.steps, opts.checkpoint_dir.as_deref());
        use std::io::Write;
        let _ = std::io::stdout().flush();
        std::process::exit(code);
    }
    Ok(())
}

/// One rank of an `mpirun` job; rank 0 gets the report. A rank whose work fails ends
/// the whole job through `MPI_Abort` (printing `rank R failed: …`), so that no other
/// rank waits for it until its timeout.
fn run_mpi(
    cfg: &TrainConfig<GptConfig>,
    corpus: &Corpus,
    opts: &TrainOptions,
    threads: usize,
) -> anyhow::Result<Option<switchyard_train::TrainReport>> {
    // `--comm-timeout` / `comm_timeout_secs` bounds every wait, as on threads; being
    // explicit, it wins over SWITCHYARD_COMM_TIMEOUT_SECS (the default of `mpi::init` only).
    let world = switchyard_comm::mpi::init_with(switchyard_comm::mpi::MpiConfig {
        timeout: std::time::Duration::from_secs_f64(cfg.comm_timeout_secs),
    })?;
    // This process is one rank: its memory is measured on its own ledger.
    let ledger = switchyard::mem::Ledger::new();
    let _charging = ledger.as_ref().map(|l| l.enter());
    let pool =
        switchyard_comm::threads::worker_pool_charging(threads, ledger.as_ref().map(|l| l.id()))
            .map_err(anyhow::Error::msg)?;
    match pool.install(|| train_rank(world, cfg, corpus, opts)) {
        Ok(report) => Ok(report),
        Err(e) => switchyard_comm::mpi::abort(1, &format!("{:#}", with_flag_advice(e))),
    }
}

/// The trainer's error, with what to pass on this command line where the library can
/// only say what differs (it knows no flags of the GPT).
fn with_flag_advice(e: TrainError) -> anyhow::Error {
    match e {
        TrainError::ModelMismatch { path, have, want } => anyhow::anyhow!(
            "{path} holds a model {have}, but this run builds {want}: pass matching \
             --d-model, --layers, --heads (and --tied)"
        ),
        e => e.into(),
    }
}
