//! Checkpoints that survive crashes and reshard across layouts.
//!
//! ## On disk
//!
//! ```text
//! DIR/step-00000100/manifest.json        layout, step, config, data position, RNG, optimizer
//! DIR/step-00000100/pp0-tp0.safetensors  rank (pp 0, tp 0)'s shards: parameters and Adam moments
//! DIR/step-00000100/pp0-tp1.safetensors  …
//! ```
//!
//! Every rank of data-parallel replica 0 writes its own shards (replicas hold identical
//! copies; a replicated parameter is written once, by tensor rank 0; a tied embedding
//! once, by the stage that owns the table). Each file holds `NAME` (the parameter shard,
//! f32), `NAME#adam_m` and `NAME#adam_v` (its moments, f64), keyed by nanoGPT names.
//!
//! ## Atomicity
//!
//! A save writes into `step-N.partial/`: each file goes to a temporary name, is synced,
//! then renamed; rank 0 then writes `manifest.json` the same way — last — and renames the
//! directory to `step-N`. A checkpoint is complete exactly when `step-N/manifest.json`
//! exists, so a crash at any moment leaves every earlier checkpoint intact and loadable.
//! Only after the commit are older checkpoints of the same run beyond the newest `keep`
//! deleted; which checkpoints a run may prune or move aside is in [`crate::run_dir`].
//!
//! ## Resharding
//!
//! The manifest records each shard's [`ShardSpec`] and full shape, so loading merges the
//! shards of any old layout into full tensors ([`Checkpoint::load_full`]) that the new
//! layout cuts again (`ParamSource::Full`) — parameters and optimizer moments alike.
//!
//! ## Integrity
//!
//! The manifest records each file's size and FNV-1a 64 hash. [`Checkpoint::open`] checks
//! all of them, and every tensor's name, dtype and shape, before anything else happens;
//! every problem is an error naming the file and what is wrong, and loading never writes.

use std::collections::HashMap;
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::error::{err, fail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};
use switchyard_shard::ShardSpec;

use switchyard_models::Model;

use crate::optim::AdamWConfig;
use crate::TrainConfig;

pub const FORMAT: &str = "switchyard-checkpoint/1";
pub const MANIFEST: &str = "manifest.json";
const MOMENT_M: &str = "#adam_m";
const MOMENT_V: &str = "#adam_v";

/// One shard in one file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TensorEntry {
    pub name: String,
    pub spec: ShardSpec,
    pub full_shape: Vec<usize>,
    pub shape: Vec<usize>,
    pub tp_rank: usize,
    pub tp_size: usize,
}

/// One rank's file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FileEntry {
    pub file: String,
    pub pp: usize,
    pub tp: usize,
    /// `--ep`: the rank of the expert group whose experts the file holds besides (on
    /// rank 0) everything else; 0 without expert parallelism.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub ep: usize,
    pub bytes: u64,
    /// FNV-1a 64 of the file's bytes, in hex.
    pub fnv64: String,
    pub tensors: Vec<TensorEntry>,
}

/// Identifies the training data ([`crate::data::Dataset`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CorpusInfo {
    pub name: String,
    /// Tokens in the training split (bytes, for a byte-level text).
    pub bytes: usize,
    /// [`crate::data::Dataset::fingerprint`]: for a text, FNV-1a 64 of its bytes in hex.
    pub fnv64: String,
}

/// Everything but the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// The run that wrote it: a fresh run makes a new id, a resumed run keeps the id of
    /// the checkpoint it resumed from. Empty in checkpoints written before run ids.
    #[serde(default)]
    pub run_id: String,
    /// Steps completed; a resumed run starts at this step.
    pub step: usize,
    /// The kind of model ([`Model::NAME`]). Empty in checkpoints written before the
    /// field existed, all of which hold a GPT.
    #[serde(default)]
    pub model_kind: String,
    /// The run's configuration, layout included, with the model's config as JSON
    /// (read it as a model's type with [`Manifest::config_of`]).
    pub config: TrainConfig<serde_json::Value>,
    pub corpus: CorpusInfo,
    /// The index of the next batch. Batches depend only on the step and the config (the
    /// seed, or with `shuffle` off the batch size: see `data::Sampler`), so this and the
    /// seed are the whole data-loader and RNG state.
    pub data_position: usize,
    pub rng_seed: u64,
    /// AdamW's step count and hyper-parameters; the moments are in the shard files.
    pub optimizer_t: u64,
    pub optimizer: AdamWConfig,
    pub files: Vec<FileEntry>,
}

impl Manifest {
    /// The run's configuration for a model of kind `M`; refuses a checkpoint of another
    /// kind of model, or a model config that does not read as `M`'s.
    pub fn config_of<M: Model>(&self) -> Result<TrainConfig<M>> {
        if !self.model_kind.is_empty() && self.model_kind != M::NAME {
            fail!(
                Checkpoint,
                "the checkpoint holds a {} model, not a {} model",
                self.model_kind,
                M::NAME
            );
        }
        let value = serde_json::to_value(&self.config)?;
        serde_json::from_value(value).map_err(|e| {
            err!(
                Checkpoint,
                "the checkpoint's model config does not read as a {} model's: {e}",
                M::NAME
            )
        })
    }
}

/// `cfg` with its model config as JSON, as a [`Manifest`] holds it.
pub fn erase_model<M: Model>(cfg: &TrainConfig<M>) -> Result<TrainConfig<serde_json::Value>> {
    Ok(serde_json::from_value(serde_json::to_value(cfg)?)?)
}

/// FNV-1a 64.
pub fn fnv64(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// The directory of the checkpoint after `step` steps.
pub fn step_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!("step-{step:08}"))
}

/// The staging directory a save of `step` writes into.
pub fn staging_dir(dir: &Path, step: usize) -> PathBuf {
    dir.join(format!("step-{step:08}.partial"))
}

/// The name of the file of rank (pp, tp) and, under `--ep`, expert-group rank `ep`
/// (the experts of expert-group ranks above 0 go into files of their own).
pub fn file_name(pp: usize, tp: usize, ep: usize) -> String {
    match ep {
        0 => format!("pp{pp}-tp{tp}.safetensors"),
        _ => format!("pp{pp}-tp{tp}-ep{ep}.safetensors"),
    }
}

fn is_zero(x: &usize) -> bool {
    *x == 0
}

/// Writes `bytes` to `path` atomically: a temporary file, synced, then renamed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let (tmp, mut f) = crate::export::create_temp(path)?;
    let written = f
        .write_all(bytes)
        .and_then(|_| f.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))
        .and_then(|_| {
            fs::rename(&tmp, path)
                .with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
        });
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
    }
    written
}

fn sync_dir(dir: &Path) {
    // Best effort: persists the renames on file systems that need it.
    if let Ok(d) = fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Writes one rank's shards into the staging directory of a save; returns its entry.
/// `tensors`: `(name, spec, full shape, tp rank, tp size, shard, m, v)` per parameter.
pub fn write_rank_file(
    staging: &Path,
    pp: usize,
    tp: usize,
    ep: usize,
    shards: &[RankShard],
) -> Result<FileEntry> {
    let mut map: Vec<(String, Tensor)> = Vec::new();
    let mut tensors = Vec::new();
    for s in shards {
        map.push((s.name.clone(), s.value.clone()));
        map.push((format!("{}{MOMENT_M}", s.name), s.m.clone()));
        map.push((format!("{}{MOMENT_V}", s.name), s.v.clone()));
        tensors.push(TensorEntry {
            name: s.name.clone(),
            spec: s.spec,
            full_shape: s.full_shape.clone(),
            shape: s.value.dims().to_vec(),
            tp_rank: s.tp_rank,
            tp_size: s.tp_size,
        });
    }
    let bytes =
        safetensors::serialize(map.iter().map(|(k, v)| (k.as_str(), v)), None).map_err(|e| {
            err!(
                Checkpoint,
                "cannot serialise the shards of pp {pp} tp {tp}: {e}"
            )
        })?;
    let file = file_name(pp, tp, ep);
    write_atomic(&staging.join(&file), &bytes)?;
    Ok(FileEntry {
        file,
        pp,
        tp,
        ep,
        bytes: bytes.len() as u64,
        fnv64: fnv64(&bytes),
        tensors,
    })
}

/// One parameter shard as a rank saves it.
pub struct RankShard {
    pub name: String,
    pub spec: ShardSpec,
    pub full_shape: Vec<usize>,
    pub tp_rank: usize,
    pub tp_size: usize,
    pub value: Tensor,
    pub m: Tensor,
    pub v: Tensor,
}

/// Completes a save: writes the manifest last, renames the staging directory, then keeps
/// only the newest `keep` checkpoints of the manifest's run (0 keeps all; see
/// [`crate::run_dir::prune`]).
pub fn commit(dir: &Path, manifest: &Manifest, keep: usize) -> Result<PathBuf> {
    let staging = staging_dir(dir, manifest.step);
    let json = serde_json::to_vec_pretty(manifest)?;
    write_atomic(&staging.join(MANIFEST), &json)?;
    sync_dir(&staging);
    let done = step_dir(dir, manifest.step);
    if done.exists() {
        fs::remove_dir_all(&done).with_context(|| format!("cannot replace {}", done.display()))?;
    }
    fs::rename(&staging, &done)
        .with_context(|| format!("cannot rename {} to {}", staging.display(), done.display()))?;
    sync_dir(dir);
    crate::run_dir::prune(dir, &manifest.run_id, manifest.step, keep)?;
    // Staging left behind by earlier crashes is garbage now.
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_name().to_string_lossy().ends_with(".partial") {
                let _ = fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(done)
}

/// The complete checkpoints in `dir`, oldest first.
pub fn complete_steps(dir: &Path) -> Result<Vec<(usize, PathBuf)>> {
    let mut out = Vec::new();
    let entries = fs::read_dir(dir)
        .with_context(|| format!("cannot read the checkpoint directory {}", dir.display()))?;
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(n) = name
            .strip_prefix("step-")
            .and_then(|n| n.parse::<usize>().ok())
        else {
            continue;
        };
        if e.path().join(MANIFEST).is_file() {
            out.push((n, e.path()));
        }
    }
    out.sort();
    Ok(out)
}

/// A checkpoint whose files have all been checked.
pub struct Checkpoint {
    pub path: PathBuf,
    pub manifest: Manifest,
    files: Vec<HashMap<String, Tensor>>,
}

/// Full (merged) tensors of a checkpoint, by parameter name.
pub struct FullState {
    pub params: HashMap<String, Tensor>,
    pub m: HashMap<String, Tensor>,
    pub v: HashMap<String, Tensor>,
}

/// Reads and parses the manifest of the checkpoint in `path` (a `step-N` directory)
/// without checking its files; the step must match the directory's name.
pub fn read_manifest(path: &Path) -> Result<Manifest> {
    let mpath = path.join(MANIFEST);
    let text = fs::read(&mpath).with_context(|| format!("cannot read {}", mpath.display()))?;
    let manifest: Manifest = serde_json::from_slice(&text).map_err(|e| {
        err!(
            Checkpoint,
            "{} is not a valid switchyard manifest: {e}",
            mpath.display()
        )
    })?;
    if manifest.format != FORMAT {
        fail!(
            Checkpoint,
            "{}: format {:?}, expected {FORMAT:?}",
            mpath.display(),
            manifest.format
        );
    }
    let named = path
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("step-"))
        .and_then(|n| n.parse::<usize>().ok());
    if let Some(n) = named {
        if n != manifest.step {
            fail!(Checkpoint,
                "{} says step {}, but its directory is step {n}: the checkpoint is inconsistent; resume from another step",
                mpath.display(),
                manifest.step
            );
        }
    }
    Ok(manifest)
}

/// The checkpoint directory [`Checkpoint::find`] would open, without checking its files.
pub fn locate(dir: &Path, step: Option<usize>) -> Result<PathBuf> {
    if dir.join(MANIFEST).is_file() {
        return Ok(dir.to_path_buf());
    }
    let all = complete_steps(dir)?;
    let chosen = match step {
        Some(s) => all.iter().find(|(n, _)| *n == s).ok_or_else(|| {
            let have: Vec<String> = all.iter().map(|(n, _)| n.to_string()).collect();
            err!(
                Checkpoint,
                "{} has no complete checkpoint of step {s} (it has: {})",
                dir.display(),
                have.join(", ")
            )
        })?,
        None => all.last().ok_or_else(|| {
            err!(
                Checkpoint,
                "{} holds no complete checkpoint (no step-N/{MANIFEST})",
                dir.display()
            )
        })?,
    };
    Ok(chosen.1.clone())
}

impl Checkpoint {
    /// The newest complete checkpoint in `dir` (or `dir` itself if it is one); with
    /// `step`, that step's. Checks every file before returning.
    pub fn find(dir: &Path, step: Option<usize>) -> Result<Checkpoint> {
        Checkpoint::open(&locate(dir, step)?)
    }

    /// Opens and checks the checkpoint in `path` (a `step-N` directory).
    pub fn open(path: &Path) -> Result<Checkpoint> {
        let manifest = read_manifest(path)?;
        let mut files = Vec::new();
        for f in &manifest.files {
            let fpath = path.join(&f.file);
            let bytes = fs::read(&fpath).map_err(|e| {
                err!(
                    Checkpoint,
                    "{} is missing {} listed in its manifest: {e}",
                    path.display(),
                    f.file
                )
            })?;
            if bytes.len() as u64 != f.bytes {
                fail!(
                    Checkpoint,
                    "{} is truncated or corrupt: {} bytes, the manifest says {}",
                    fpath.display(),
                    bytes.len(),
                    f.bytes
                );
            }
            let h = fnv64(&bytes);
            if h != f.fnv64 {
                fail!(
                    Checkpoint,
                    "{} is corrupt: its checksum is {h}, the manifest says {}",
                    fpath.display(),
                    f.fnv64
                );
            }
            let tensors =
                candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| {
                    err!(
                        Checkpoint,
                        "{} is not a readable safetensors file: {e}",
                        fpath.display()
                    )
                })?;
            for t in &f.tensors {
                for (key, dtype) in [
                    (t.name.clone(), DType::F32),
                    (format!("{}{MOMENT_M}", t.name), DType::F64),
                    (format!("{}{MOMENT_V}", t.name), DType::F64),
                ] {
                    let Some(x) = tensors.get(&key) else {
                        fail!(
                            Checkpoint,
                            "{} has no tensor {key}, which its manifest lists",
                            fpath.display()
                        );
                    };
                    if x.dims() != t.shape.as_slice() || x.dtype() != dtype {
                        fail!(
                            Checkpoint,
                            "{}: {key} is {:?} {:?}, the manifest says {:?} {dtype:?}",
                            fpath.display(),
                            x.dims(),
                            x.dtype(),
                            t.shape
                        );
                    }
                }
            }
            files.push(tensors);
        }
        Ok(Checkpoint {
            path: path.to_path_buf(),
            manifest,
            files,
        })
    }

    /// Merges the shards of every parameter (and its moments) into full tensors.
    pub fn load_full(&self) -> Result<FullState> {
        let mut parts: HashMap<&str, Vec<(&TensorEntry, usize)>> = HashMap::new();
        for (i, f) in self.manifest.files.iter().enumerate() {
            for t in &f.tensors {
                parts.entry(t.name.as_str()).or_default().push((t, i));
            }
        }
        let mut out = FullState {
            params: HashMap::new(),
            m: HashMap::new(),
            v: HashMap::new(),
        };
        for (name, mut shards) in parts {
            shards.sort_by_key(|(t, _)| t.tp_rank);
            let first = shards[0].0;
            let merge = |suffix: &str| -> Result<Tensor> {
                let key = format!("{name}{suffix}");
                let pieces: Vec<Tensor> = shards
                    .iter()
                    .map(|(_, i)| self.files[*i][&key].clone())
                    .collect();
                let full = match first.spec {
                    ShardSpec::Replicated => pieces[0].clone(),
                    _ => {
                        let ranks: Vec<usize> = shards.iter().map(|(t, _)| t.tp_rank).collect();
                        if ranks != (0..first.tp_size).collect::<Vec<_>>() {
                            fail!(Checkpoint,
                                "{}: parameter {name} has shards of tensor ranks {ranks:?}, expected 0..{}",
                                self.path.display(),
                                first.tp_size
                            );
                        }
                        first.spec.merge(&pieces)?
                    }
                };
                if full.dims() != first.full_shape.as_slice() {
                    fail!(
                        Checkpoint,
                        "{}: parameter {name} merges to {:?}, the manifest says {:?}",
                        self.path.display(),
                        full.dims(),
                        first.full_shape
                    );
                }
                Ok(full)
            };
            out.params.insert(name.to_string(), merge("")?);
            out.m.insert(name.to_string(), merge(MOMENT_M)?);
            out.v.insert(name.to_string(), merge(MOMENT_V)?);
        }
        Ok(out)
    }
}
