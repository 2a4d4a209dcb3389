//! The `--config` TOML file of `switchyard train`: the run's settings, the keys only a
//! file holds, the errors that name the key, and the model a weights file describes.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, Context};
use switchyard_models::GptConfig;
use switchyard_train::data::TokenWidth;
use switchyard_train::weights;
use switchyard_train::TrainConfig;

/// The settings a TOML file may hold besides [`TrainConfig`]'s.
pub(super) const FILE_ONLY: [&str; 10] = [
    "data",
    "metrics",
    "trace",
    "checkpoint_dir",
    "save_every",
    "keep",
    "tokenizer",
    "token_width",
    "ops",
    "precision",
];

/// The [`FILE_ONLY`] keys of a TOML file, each of its one type.
#[derive(Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct FileOnly {
    pub(super) data: Option<PathBuf>,
    /// The model's `ops` (as `--ops`; `[model] ops` is the same setting).
    pub(super) ops: Option<String>,
    /// The model's `precision` (as `--precision`; `[model] precision` is the same).
    pub(super) precision: Option<String>,
    pub(super) tokenizer: Option<PathBuf>,
    pub(super) token_width: Option<TokenWidth>,
    pub(super) metrics: Option<PathBuf>,
    pub(super) trace: Option<PathBuf>,
    pub(super) checkpoint_dir: Option<PathBuf>,
    pub(super) save_every: Option<usize>,
    pub(super) keep: Option<usize>,
}

/// A `--config` file's settings: the run's, the file-only keys, and whether it sets the
/// model's vocabulary.
pub(super) fn load_file(path: &Path) -> anyhow::Result<(TrainConfig<GptConfig>, FileOnly, bool)> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --config {}", path.display()))?;
    let mut table: toml::Table = text
        .parse()
        .with_context(|| format!("--config {} is not valid TOML", path.display()))?;
    let vocab = table
        .get("model")
        .and_then(|m| m.get("vocab_size"))
        .is_some();
    let mut extra = toml::Table::new();
    for k in FILE_ONLY {
        if let Some(v) = table.remove(k) {
            extra.insert(k.into(), v);
        }
    }
    let file_error = |e: toml::de::Error| anyhow!("--config {}: {}", path.display(), explain(&e));
    let extra: FileOnly = toml::Value::Table(extra).try_into().map_err(file_error)?;
    let cfg: TrainConfig<GptConfig> = toml::Value::Table(table).try_into().map_err(file_error)?;
    Ok((cfg, extra, vocab))
}

/// A TOML error as "key `k`: what is wrong, expected what", with TOML's names for types.
fn explain(e: &toml::de::Error) -> String {
    let text = e.to_string();
    let (msg, key) = match text.trim_end().rsplit_once("\nin `") {
        Some((m, k)) => (
            m.trim_end().to_string(),
            Some(k.trim_end_matches('`').to_string()),
        ),
        None => (text.trim_end().to_string(), None),
    };
    let mut msg = msg
        .replace("expected usize", "expected a non-negative integer")
        .replace("expected u64", "expected a non-negative integer")
        .replace("expected f64", "expected a number")
        .replace("expected path string", "expected a string (a path)")
        .replace("integer `-", "negative integer `-");
    if msg.starts_with("unknown field") && key.is_none() {
        msg = format!(
            "{msg}, or one of the file-only keys {}",
            FILE_ONLY.map(|k| format!("`{k}`")).join(", ")
        );
    }
    match key {
        Some(k) => format!("key `{k}`: {msg}"),
        None => msg,
    }
}

/// The model that the weights at `path` describe without reading their tensors: a
/// Hugging Face directory's `config.json`, or the `config` metadata of a switchyard
/// export. `None` for a file without it (a PyTorch state dict: the flags say).
pub(super) fn model_of(path: &Path) -> anyhow::Result<Option<GptConfig>> {
    use std::io::Read;
    if weights::is_hf_dir(path) {
        let json = weights::read_hf_config(path)?;
        let (m, _) = switchyard_models::hf::from_hf(&json, Default::default())
            .with_context(|| path.display().to_string())?;
        return Ok(Some(m));
    }
    // A safetensors file starts with the length of its JSON header.
    let header = (|| -> Option<serde_json::Value> {
        let mut f = std::fs::File::open(path).ok()?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len).ok()?;
        let len = usize::try_from(u64::from_le_bytes(len)).ok()?;
        let mut h = vec![0u8; len.min(100 << 20)];
        f.read_exact(&mut h).ok()?;
        serde_json::from_slice(&h).ok()
    })();
    Ok(header
        .as_ref()
        .and_then(|h| h.get("__metadata__")?.get("config")?.as_str())
        .and_then(|c| serde_json::from_str(c).ok()))
}
