//! `switchyard export`, `eval` and `sample`: a trained model outside training.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{anyhow, Context};
use clap::Args;
use switchyard_models::sample::sample_with;
use switchyard_models::GptConfig;
use switchyard_train::data::{self, DataSpec, Dataset, TokenWidth};
use switchyard_train::weights::{check_destination, evaluate, Dest, Weights};

/// The number of heads to assume for a weights file without switchyard metadata.
const DEFAULT_HEADS: usize = 4;

#[derive(Args)]
pub struct ExportArgs {
    /// A checkpoint directory (its newest complete checkpoint) or a step-N directory
    #[arg(long)]
    checkpoint: PathBuf,
    /// What to write: `nanogpt` (one .safetensors file, nanoGPT names and shapes) or
    /// `hf-gpt2` (a directory that transformers' GPT2LMHeadModel.from_pretrained loads)
    #[arg(long, value_enum, default_value_t = ExportFormat::Nanogpt)]
    format: ExportFormat,
    /// The file (nanogpt) or directory (hf-gpt2) to write; not inside the checkpoint
    #[arg(long)]
    out: PathBuf,
    /// With hf-gpt2: the run's Hugging Face tokenizer.json, copied beside the weights
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// Replace --out if it exists
    #[arg(long)]
    force: bool,
    /// The dtype of the exported tensors: `f32` (the master weights as trained) or
    /// `bf16` (half the bytes, each value rounded to the nearest bf16)
    #[arg(long, value_enum, default_value_t = ExportDtype::F32)]
    dtype: ExportDtype,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ExportDtype {
    F32,
    Bf16,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ExportFormat {
    Nanogpt,
    #[value(name = "hf-gpt2")]
    HfGpt2,
}

/// The weights at `path`, with a note on stderr when a file carries no checksum.
fn load(path: &std::path::Path, heads: usize) -> anyhow::Result<Weights<GptConfig>> {
    let hint = GptConfig {
        n_head: heads,
        ..GptConfig::default()
    };
    let w = Weights::load(path, &hint)?;
    if let Some(note) = w.note(path) {
        eprintln!("{note}");
    }
    Ok(w)
}

pub fn export(a: ExportArgs) -> anyhow::Result<()> {
    let dest = match a.format {
        ExportFormat::Nanogpt => Dest::File,
        ExportFormat::HfGpt2 => Dest::Dir,
    };
    if dest == Dest::File && a.tokenizer.is_some() {
        return Err(anyhow!(
            "--tokenizer goes with --format hf-gpt2 (a nanogpt export is one file)"
        ));
    }
    check_destination(&a.out, a.force, Some(&a.checkpoint), dest)?;
    let extra = match &a.tokenizer {
        Some(t) => vec![(
            "tokenizer.json",
            std::fs::read(t).with_context(|| format!("cannot read --tokenizer {}", t.display()))?,
        )],
        None => Vec::new(),
    };
    let mut w = load(&a.checkpoint, DEFAULT_HEADS)?;
    if a.dtype == ExportDtype::Bf16 {
        w = w.to_dtype(candle_core::DType::BF16)?;
    }
    let tensors = match a.format {
        ExportFormat::Nanogpt => w.export_to(&a.out, a.force)?,
        ExportFormat::HfGpt2 => w.export_hf(&a.out, &extra, a.force)?,
    };
    println!(
        "wrote {} ({} tensors, {:.2}M parameters)",
        a.out.display(),
        tensors,
        w.config.param_count() as f64 / 1e6
    );
    Ok(())
}

#[derive(Args)]
pub struct EvalArgs {
    /// A checkpoint directory, a step-N directory, or a .safetensors file
    #[arg(long)]
    checkpoint: PathBuf,
    /// The text or .bin token file to evaluate on (default: the bundled corpus); its
    /// validation split is scored (the whole data when it has none)
    #[arg(long)]
    data: Option<PathBuf>,
    /// Tokenize the --data text with this Hugging Face tokenizer.json
    #[arg(long, value_name = "FILE")]
    tokenizer: Option<PathBuf>,
    /// The width of a .bin token file's ids: u16 or u32
    #[arg(long, value_name = "u16|u32")]
    token_width: Option<TokenWidth>,
    /// The held-out fraction at the end of the data that is scored (default: the
    /// checkpoint's --val-fraction; 0: score all of the data)
    #[arg(long)]
    val_fraction: Option<f64>,
    /// Window length L: each window is L + 1 tokens (default: the model's block size)
    #[arg(long)]
    seq_len: Option<usize>,
    /// Only the first N windows
    #[arg(long)]
    max_windows: Option<usize>,
    /// Heads, for a weights file without switchyard metadata
    #[arg(long, default_value_t = DEFAULT_HEADS)]
    heads: usize,
    /// Print JSON
    #[arg(long)]
    json: bool,
}

pub fn eval(a: EvalArgs) -> anyhow::Result<()> {
    if a.max_windows == Some(0) {
        return Err(anyhow!(
            "--max-windows must be at least 1 (leave it out to evaluate every window)"
        ));
    }
    let w = load(&a.checkpoint, a.heads)?;
    // A checkpoint knows which fraction it held out; a weights file does not.
    let val_fraction = match (
        a.val_fraction,
        a.checkpoint.is_dir() && !switchyard_train::weights::is_hf_dir(&a.checkpoint),
    ) {
        (Some(f), _) => f,
        (None, true) => {
            use switchyard_train::checkpoint::{locate, read_manifest};
            read_manifest(&locate(&a.checkpoint, None)?)?
                .config
                .val_fraction
        }
        (None, false) => 0.0,
    };
    let corpus = data::open(&DataSpec {
        data: a.data.clone(),
        tokenizer: a.tokenizer.clone(),
        width: a.token_width.unwrap_or_default(),
        val_fraction,
    })
    .map_err(anyhow::Error::msg)?;
    let seq_len = a.seq_len.unwrap_or(w.config.block_size);
    let r = evaluate(&w, &corpus, seq_len, a.max_windows)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
    } else {
        let unit = match w.config.vocab_size <= 256 && a.tokenizer.is_none() {
            true => "byte",
            false => "token",
        };
        let split = corpus.validation().unwrap_or(corpus.train());
        println!(
            "{:.4} nats/{unit} ({:.4} bits/{unit}) over {} windows of {}+1 {unit}s of {}",
            r.nats_per_byte,
            r.nats_per_byte / std::f64::consts::LN_2,
            r.windows,
            r.seq_len,
            split.name
        );
    }
    Ok(())
}

#[derive(Args)]
pub struct SampleArgs {
    /// A checkpoint directory, a step-N directory, or a .safetensors file
    #[arg(long)]
    checkpoint: PathBuf,
    #[arg(long, default_value = "And God said")]
    prompt: String,
    /// Bytes to generate
    #[arg(long, default_value_t = 200)]
    tokens: usize,
    /// 0 samples greedily
    #[arg(long, default_value_t = 0.8)]
    temperature: f64,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Heads, for a weights file without switchyard metadata
    #[arg(long, default_value_t = DEFAULT_HEADS)]
    heads: usize,
}

pub fn sample_text(a: SampleArgs) -> anyhow::Result<()> {
    if !(a.temperature.is_finite() && a.temperature >= 0.0) {
        return Err(anyhow!(
            "--temperature must be a number ≥ 0 (0 samples greedily), got {}",
            a.temperature
        ));
    }
    let w = load(&a.checkpoint, a.heads)?;
    // Each piece of text as it is generated, so that a long run shows progress.
    let mut out = std::io::stdout().lock();
    write!(out, "{}", a.prompt)?;
    out.flush()?;
    let model = w.model()?;
    sample_with(
        &w.config,
        &model,
        &a.prompt,
        a.tokens,
        a.temperature,
        a.seed,
        |piece| {
            out.write_all(piece.as_bytes())?;
            out.flush()?;
            Ok::<(), anyhow::Error>(())
        },
    )?;
    writeln!(out)?;
    Ok(())
}
