//! Whole-model weights outside training: export to one nanoGPT-named safetensors file or
//! to a Hugging Face `transformers` directory, load either (ours, or one saved from
//! PyTorch or `transformers`), evaluate and sample.
//!
//! ## `switchyard eval` — exactly what it computes
//!
//! The mean cross-entropy, in nats per token (per byte for byte-level text), of predicting
//! each token from the tokens before it, over consecutive non-overlapping windows of
//! `L + 1` tokens starting at token 0 of the validation split (of the whole data when it
//! has none, see [`crate::data`]): window `k` is tokens `[k(L+1), (k+1)(L+1))`, its inputs
//! are its first `L` tokens and its targets its last `L`. A trailing partial window is
//! skipped; with `--max-windows N` only the first `N` windows count. Every target token
//! weighs the same: the result is the sum of all `N·L` losses divided by `N·L`.

use std::collections::HashMap;
use std::path::Path;

use crate::error::{err, fail, Context, Result};
use candle_core::{DType, Device, Tensor};
use switchyard_models::{plan_stages, Model, ModelStage, SplitSpec};
use switchyard_pipeline::Stage;
use switchyard_shard::{single_device, ParamSource, ParamStore};

use crate::checkpoint::Checkpoint;
use crate::data::Dataset;
pub use crate::export::{check_destination, Dest, Integrity};
use crate::export::{checksum, verify, write_dir, write_file, CHECKSUM_KEY};

pub const EXPORT_FORMAT: &str = "switchyard-export/1";
/// A Hugging Face directory's config and weights files.
pub const HF_CONFIG: &str = "config.json";
pub const HF_WEIGHTS: &str = "model.safetensors";

/// Whether `path` is a Hugging Face `transformers` directory: `config.json` beside
/// `model.safetensors`.
pub fn is_hf_dir(path: &Path) -> bool {
    path.join(HF_CONFIG).is_file() && path.join(HF_WEIGHTS).is_file()
}

/// The `config.json` of a Hugging Face directory, as JSON.
pub fn read_hf_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join(HF_CONFIG);
    let text = std::fs::read(&path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_slice(&text).map_err(|e| err!(Weights, "{} is not JSON: {e}", path.display()))
}

/// `tensors` as a safetensors file with `meta` and the checksum of the tensors
/// (`crate::export`) as metadata.
fn serialize<const N: usize>(
    tensors: &[(String, Tensor)],
    meta: [(&str, String); N],
) -> Result<Vec<u8>> {
    let views: Vec<(&str, &Tensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut meta: HashMap<String, String> =
        meta.into_iter().map(|(k, v)| (k.to_string(), v)).collect();
    meta.insert(CHECKSUM_KEY.to_string(), checksum(&views));
    safetensors::serialize(views, Some(meta))
        .map_err(|e| err!(Weights, "cannot serialise the weights: {e}"))
}

/// A safetensors file: how its checksum checked, its metadata, and its tensors in f32.
#[allow(clippy::type_complexity)]
fn read_safetensors(
    path: &Path,
) -> Result<(
    Integrity,
    Option<HashMap<String, String>>,
    HashMap<String, Tensor>,
)> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    let integrity = verify(path, &bytes)?;
    let bad = |e: &dyn std::fmt::Display| {
        err!(
            Weights,
            "{} is not a readable safetensors file: {e}",
            path.display()
        )
    };
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(&e))?;
    let mut tensors =
        candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| bad(&e))?;
    for t in tensors.values_mut() {
        *t = t.to_dtype(DType::F32)?;
    }
    Ok((integrity, meta.metadata().clone(), tensors))
}

/// The metadata key of the model's kind ([`Model::NAME`]) in an export.
const MODEL_KEY: &str = "model";

/// A model's full weights by parameter name, and its config.
pub struct Weights<M> {
    pub config: M,
    pub tensors: HashMap<String, Tensor>,
    /// How the loaded tensors were checked.
    pub integrity: Integrity,
}

impl<M: Model> Weights<M> {
    /// From a checkpoint directory (its newest complete checkpoint, or a `step-N`
    /// directory) or a `.safetensors` file. A file without switchyard metadata (for
    /// example one saved from PyTorch) is read by [`Model::import`], with `hint` for
    /// what its shapes cannot say (a GPT's number of heads). A file's `checksum` metadata
    /// must match its tensors; a file without one loads as [`Integrity::Unverified`]
    /// (see [`Weights::note`]).
    pub fn load(path: &Path, hint: &M) -> Result<Weights<M>> {
        if is_hf_dir(path) {
            return Self::load_hf(path, hint);
        }
        if path.is_dir() {
            let ckpt = Checkpoint::find(path, None)?;
            let config = ckpt
                .manifest
                .config_of::<M>()
                .with_context(|| format!("{}", ckpt.path.display()))?
                .model;
            let full = ckpt.load_full()?;
            return Ok(Weights {
                config,
                tensors: full.params,
                integrity: Integrity::Checkpoint,
            });
        }
        let (integrity, meta, tensors) = read_safetensors(path)?;
        let meta = meta.as_ref();
        if let Some(kind) = meta.and_then(|m| m.get(MODEL_KEY)) {
            if kind != M::NAME {
                fail!(
                    Weights,
                    "{} holds a {kind} model, not a {} model",
                    path.display(),
                    M::NAME
                );
            }
        }
        let from_meta = meta
            .and_then(|m| m.get("config"))
            .map(|c| serde_json::from_str::<M>(c))
            .transpose()
            .map_err(|e| err!(Weights, "{}: bad switchyard metadata: {e}", path.display()))?;
        let (config, tensors) = from_meta
            .as_ref()
            .unwrap_or(hint)
            .import(tensors)
            .map_err(|e| err!(Weights, "{}: {e}", path.display()))?;
        let config =
            match from_meta {
                Some(c) if c != config => fail!(Weights,
                "{}: the metadata describes the model {c:?}, but its tensors the model {config:?}",
                path.display()
            ),
                _ => config,
            };
        Weights {
            config,
            tensors,
            integrity,
        }
        .checked(path)
    }

    /// A Hugging Face `transformers` directory (`config.json` beside
    /// `model.safetensors`, as `save_pretrained` writes it), read by [`Model::hf_import`].
    fn load_hf(dir: &Path, hint: &M) -> Result<Weights<M>> {
        let json = read_hf_config(dir)?;
        let (integrity, _, tensors) = read_safetensors(&dir.join(HF_WEIGHTS))?;
        let (config, tensors) = hint
            .hf_import(&json, tensors)
            .map_err(|e| err!(Weights, "{}: {e}", dir.display()))?;
        Weights {
            config,
            tensors,
            integrity,
        }
        .checked(dir)
    }

    /// `self` if its tensors are the config's parameters ([`Weights::check`]), else the
    /// mismatch, naming `path`.
    fn checked(self, path: &Path) -> Result<Weights<M>> {
        self.check()
            .map_err(|e| err!(Weights, "{}: {e}", path.display()))?;
        Ok(self)
    }

    /// Writes a Hugging Face `transformers` directory ([`Model::hf_export`]): `config.json`,
    /// `model.safetensors` (with `transformers`' `format: pt` metadata, the model's kind
    /// and a checksum of the tensors) and `extra` files (such as a `tokenizer.json`).
    /// The directory is written beside `out` and renamed into place; an existing `out`
    /// is replaced only when `force`.
    pub fn export_hf(&self, out: &Path, extra: &[(&str, Vec<u8>)], force: bool) -> Result<usize> {
        let (config, tensors) = self.config.hf_export(&self.tensors)?;
        let weights = serialize(
            &tensors,
            [
                ("format", "pt".to_string()),
                (MODEL_KEY, M::NAME.to_string()),
            ],
        )?;
        let mut config = serde_json::to_vec_pretty(&config)?;
        config.push(b'\n');
        let mut files: Vec<(&str, &[u8])> = vec![(HF_CONFIG, &config), (HF_WEIGHTS, &weights)];
        files.extend(extra.iter().map(|(n, b)| (*n, b.as_slice())));
        write_dir(out, &files, force)?;
        Ok(tensors.len())
    }

    /// Checks the names and shapes against the config.
    pub fn check(&self) -> Result<()> {
        let c = &self.config;
        let want = c.param_shapes()?;
        for (name, shape) in &want {
            match self.tensors.get(name) {
                None => {
                    return Err(err!(
                        Weights,
                        "no tensor {name}, which the model {c:?} needs"
                    ))
                }
                Some(t) if t.dims() != shape.as_slice() => {
                    return Err(err!(
                        Weights,
                        "{name} has shape {:?}, the model {c:?} needs {shape:?}",
                        t.dims()
                    ))
                }
                _ => {}
            }
        }
        let known: std::collections::HashSet<&String> = want.iter().map(|(n, _)| n).collect();
        let mut extra: Vec<&String> = self.tensors.keys().filter(|k| !known.contains(k)).collect();
        extra.sort();
        if !extra.is_empty() {
            return Err(err!(
                Weights,
                "unexpected tensors for the model {c:?}: {extra:?}"
            ));
        }
        Ok(())
    }

    /// A line for the user when the tensors could not be verified, naming `path`.
    pub fn note(&self, path: &Path) -> Option<String> {
        (self.integrity == Integrity::Unverified).then(|| {
            format!(
                "note: {} has no switchyard checksum (it was not written by `switchyard export`, \
                 or by an older version): its tensors are used unverified",
                path.display()
            )
        })
    }

    /// The same weights with every tensor in `dtype` (`switchyard export --dtype`): bf16
    /// halves an export's bytes, each value rounded to the nearest bf16. Checkpoints
    /// always keep the f32 master weights; a bf16 export loads back as f32.
    pub fn to_dtype(&self, dtype: DType) -> Result<Weights<M>> {
        if !matches!(dtype, DType::F32 | DType::BF16) {
            return Err(err!(Weights, "exports are f32 or bf16, not {dtype:?}"));
        }
        let tensors = self
            .tensors
            .iter()
            .map(|(k, v)| Ok((k.clone(), v.to_dtype(dtype)?)))
            .collect::<Result<HashMap<_, _>>>()?;
        Ok(Weights {
            config: self.config.clone(),
            tensors,
            integrity: self.integrity,
        })
    }

    /// The tensors an export writes, sorted by name: the parameters and the aliases of
    /// [`Model::export`] (a GPT's tied table also under `lm_head.weight`, as PyTorch's
    /// state dict has it).
    pub fn export_tensors(&self) -> Result<Vec<(String, Tensor)>> {
        let mut map: Vec<(String, Tensor)> = self
            .tensors
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        self.config.export(&mut map)?;
        map.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(map)
    }

    /// Writes one safetensors file ([`Weights::export_tensors`]) with the model's kind,
    /// its config and the checksum of the tensors as metadata. Refuses an existing
    /// `out`: see [`Weights::export_to`].
    pub fn export(&self, out: &Path) -> Result<()> {
        self.export_to(out, false).map(|_| ())
    }

    /// [`Weights::export`], replacing an existing file at `out` when `force`. The file is
    /// written through a unique temporary file next to it (`crate::export`'s docs).
    pub fn export_to(&self, out: &Path, force: bool) -> Result<usize> {
        let tensors = self.export_tensors()?;
        let bytes = serialize(
            &tensors,
            [
                ("format", EXPORT_FORMAT.to_string()),
                (MODEL_KEY, M::NAME.to_string()),
                ("config", serde_json::to_string(&self.config)?),
            ],
        )?;
        write_file(out, &bytes, force)?;
        Ok(tensors.len())
    }

    /// The whole model as one stage on this thread (no parallelism).
    pub fn model(&self) -> Result<M::Stage> {
        let plan = plan_stages(&self.config.costs(1), 1, &SplitSpec::Even)?;
        let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Full(self.tensors.clone()))?;
        Ok(self.config.stage(&plan[0], &store, single_device())?)
    }
}

/// What `switchyard eval` reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct EvalReport {
    pub windows: usize,
    pub seq_len: usize,
    pub tokens: usize,
    pub nats_per_byte: f64,
}

/// The mean cross-entropy over the evaluation windows (see the module docs).
pub fn evaluate<M: Model>(
    w: &Weights<M>,
    data: &dyn Dataset,
    seq_len: usize,
    max_windows: Option<usize>,
) -> Result<EvalReport> {
    w.config.check_layout(1, seq_len)?;
    let split = data.validation().unwrap_or(data.train());
    if let Some(((id, at), vocab)) = split
        .largest
        .zip(w.config.vocab_size())
        .filter(|((id, _), vocab)| *id as usize >= *vocab)
    {
        fail!(
            Weights,
            "the data {} has token id {id} at token offset {at}, but the model's vocabulary \
             has {} ids: evaluate on data made with the model's tokenizer",
            split.name,
            vocab
        );
    }
    let windows = data.eval_windows(seq_len, max_windows);
    if windows.is_empty() {
        fail!(
            Weights,
            "{} is shorter than one window of {} tokens",
            split.name,
            seq_len + 1
        );
    }
    let model = w.model()?;
    let mut total = 0.0;
    for chunk in windows.chunks(16) {
        let n = chunk.len();
        let x: Vec<u32> = chunk.iter().flat_map(|(x, _)| x.iter().copied()).collect();
        let y: Vec<u32> = chunk.iter().flat_map(|(_, y)| y.iter().copied()).collect();
        let x = Tensor::from_vec(x, (n, seq_len), &Device::Cpu)?;
        let y = Tensor::from_vec(y, (n, seq_len), &Device::Cpu)?;
        let loss = model.loss(&model.forward(&x)?, &y)?.to_scalar::<f32>()? as f64;
        total += loss * (n * seq_len) as f64;
    }
    let tokens = windows.len() * seq_len;
    Ok(EvalReport {
        windows: windows.len(),
        seq_len,
        tokens,
        nats_per_byte: total / tokens as f64,
    })
}
