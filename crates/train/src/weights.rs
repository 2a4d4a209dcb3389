//! Whole-model weights outside training: export to one nanoGPT-named safetensors file,
//! load such a file (ours, or one saved from PyTorch), evaluate and sample.
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

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use switchyard_models::{plan_stages, GptConfig, GptStage, LayerCosts, SplitSpec};
use switchyard_shard::{single_device, ParamSource, ParamStore};

use crate::checkpoint::Checkpoint;
use crate::data::Dataset;
pub use crate::export::{check_destination, Integrity};
use crate::export::{checksum, verify, write_file, CHECKSUM_KEY};

pub const EXPORT_FORMAT: &str = "switchyard-export/1";

/// Buffers of nanoGPT state dicts that are not parameters (causal masks), ignored on load.
fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
}

/// A model's full weights by nanoGPT name and its config.
pub struct Weights {
    pub config: GptConfig,
    pub tensors: HashMap<String, Tensor>,
    /// How the loaded tensors were checked.
    pub integrity: Integrity,
}

impl Weights {
    /// From a checkpoint directory (its newest complete checkpoint, or a `step-N`
    /// directory) or a `.safetensors` file. A file without switchyard metadata (for
    /// example one saved from PyTorch) takes its shapes from the tensors and the number
    /// of heads from `n_head`. A file's `checksum` metadata must match its tensors; a
    /// file without one loads as [`Integrity::Unverified`] (see [`Weights::note`]).
    pub fn load(path: &Path, n_head: usize) -> Result<Weights> {
        if path.is_dir() {
            let ckpt = Checkpoint::find(path, None)?;
            let full = ckpt.load_full()?;
            return Ok(Weights {
                config: ckpt.manifest.config.model.clone(),
                tensors: full.params,
                integrity: Integrity::Checkpoint,
            });
        }
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
        let integrity = verify(path, &bytes)?;
        let bad = |e: &dyn std::fmt::Display| {
            anyhow!("{} is not a readable safetensors file: {e}", path.display())
        };
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(&e))?;
        let mut tensors =
            candle_core::safetensors::load_buffer(&bytes, &Device::Cpu).map_err(|e| bad(&e))?;
        tensors.retain(|k, _| !is_buffer(k));
        for t in tensors.values_mut() {
            *t = t.to_dtype(DType::F32)?;
        }
        let from_meta = meta
            .metadata()
            .as_ref()
            .and_then(|m| m.get("config"))
            .map(|c| serde_json::from_str::<GptConfig>(c))
            .transpose()
            .map_err(|e| anyhow!("{}: bad switchyard metadata: {e}", path.display()))?;
        let config = match from_meta {
            Some(c) => c,
            None => {
                let shapes = tensors
                    .iter()
                    .map(|(k, v)| (k.clone(), v.dims().to_vec()))
                    .collect();
                let mut c = GptConfig::infer(&shapes, n_head)
                    .map_err(|e| anyhow!("{}: {e}", path.display()))?;
                // nanoGPT ties its head and saves the table under both names.
                let (w, h) = (
                    tensors.get("transformer.wte.weight"),
                    tensors.get("lm_head.weight"),
                );
                if let (Some(w), Some(h)) = (w, h) {
                    c.tied_embeddings = w.dims() == h.dims() && max_abs_diff(w, h)? == 0.0;
                }
                c
            }
        };
        let mut w = Weights {
            config,
            tensors,
            integrity,
        };
        w.check().map_err(|e| anyhow!("{}: {e}", path.display()))?;
        Ok(w)
    }

    /// Checks the names and shapes against the config; drops a tied head's duplicate.
    pub fn check(&mut self) -> std::result::Result<(), String> {
        let c = &self.config;
        if c.tied_embeddings {
            if let Some(head) = self.tensors.remove("lm_head.weight") {
                let wte = &self.tensors.get("transformer.wte.weight");
                let same = wte.is_some_and(|w| {
                    w.dims() == head.dims() && max_abs_diff(w, &head).is_ok_and(|d| d == 0.0)
                });
                if !same {
                    return Err("lm_head.weight differs from transformer.wte.weight but the model ties them".into());
                }
            }
        }
        let want = c.param_shapes();
        for (name, shape) in &want {
            match self.tensors.get(name) {
                None => {
                    return Err(format!(
                        "no tensor {name}, which the model {} needs",
                        describe(c)
                    ))
                }
                Some(t) if t.dims() != shape.as_slice() => {
                    return Err(format!(
                        "{name} has shape {:?}, the model {} needs {shape:?}",
                        t.dims(),
                        describe(c)
                    ))
                }
                _ => {}
            }
        }
        let known: std::collections::HashSet<&String> = want.iter().map(|(n, _)| n).collect();
        let mut extra: Vec<&String> = self.tensors.keys().filter(|k| !known.contains(k)).collect();
        extra.sort();
        if !extra.is_empty() {
            return Err(format!(
                "unexpected tensors for the model {}: {extra:?}",
                describe(c)
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

    /// Writes one safetensors file with nanoGPT names and shapes (a tied table is written
    /// under both of its names, as PyTorch's state dict has it), and the config and the
    /// checksum of the tensors as metadata. Refuses an existing `out`: see
    /// [`Weights::export_to`].
    pub fn export(&self, out: &Path) -> Result<()> {
        self.export_to(out, false)
    }

    /// [`Weights::export`], replacing an existing file at `out` when `force`. The file is
    /// written through a unique temporary file next to it (`crate::export`'s docs).
    pub fn export_to(&self, out: &Path, force: bool) -> Result<()> {
        let mut map: Vec<(String, Tensor)> = self
            .tensors
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if self.config.tied_embeddings {
            map.push((
                "lm_head.weight".into(),
                self.tensors["transformer.wte.weight"].clone(),
            ));
        }
        map.sort_by(|a, b| a.0.cmp(&b.0));
        let views: Vec<(&str, &Tensor)> = map.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let meta = HashMap::from([
            ("format".to_string(), EXPORT_FORMAT.to_string()),
            ("config".to_string(), serde_json::to_string(&self.config)?),
            (CHECKSUM_KEY.to_string(), checksum(&views)),
        ]);
        let bytes = safetensors::serialize(views, Some(meta))
            .map_err(|e| anyhow!("cannot serialise the weights: {e}"))?;
        write_file(out, &bytes, force)
    }

    /// The whole model on this thread (no parallelism).
    pub fn model(&self) -> Result<GptStage> {
        let flat = LayerCosts::uniform(self.config.n_layer, 0.0, 1.0, 0.0);
        let plan = plan_stages(&flat, 1, &SplitSpec::Even)?;
        let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Full(self.tensors.clone()))?;
        Ok(GptStage::new(
            &self.config,
            &plan[0],
            &store,
            single_device(),
        )?)
    }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> candle_core::Result<f32> {
    (a - b)?.abs()?.max_all()?.to_scalar::<f32>()
}

fn describe(c: &GptConfig) -> String {
    format!(
        "(vocab {}, block {}, {} layers, d {}, {} heads{})",
        c.vocab_size,
        c.block_size,
        c.n_layer,
        c.d_model,
        c.n_head,
        if c.tied_embeddings { ", tied" } else { "" }
    )
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
pub fn evaluate(
    w: &Weights,
    data: &dyn Dataset,
    seq_len: usize,
    max_windows: Option<usize>,
) -> Result<EvalReport> {
    if seq_len == 0 || seq_len > w.config.block_size {
        bail!(
            "--seq-len {seq_len} must be between 1 and the model's block size {}",
            w.config.block_size
        );
    }
    let split = data.validation().unwrap_or(data.train());
    if let Some((id, at)) = split
        .largest
        .filter(|(id, _)| *id as usize >= w.config.vocab_size)
    {
        bail!(
            "the data {} has token id {id} at token offset {at}, but the model's vocabulary \
             has {} ids: evaluate on data made with the model's tokenizer",
            split.name,
            w.config.vocab_size
        );
    }
    let windows = data.eval_windows(seq_len, max_windows);
    if windows.is_empty() {
        bail!(
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

/// Continues `prompt` by `tokens` bytes, sampling at `temperature` (0: greedy) with a
/// seeded generator.
pub fn sample(
    w: &Weights,
    prompt: &str,
    tokens: usize,
    temperature: f64,
    seed: u64,
) -> Result<String> {
    let mut text = String::new();
    sample_with(w, prompt, tokens, temperature, seed, |piece| {
        text.push_str(piece);
        Ok(())
    })?;
    Ok(text)
}

/// [`sample`], handing the text to `on_text` piece by piece as it is generated (whole
/// UTF-8 characters; invalid bytes become U+FFFD as in [`String::from_utf8_lossy`]),
/// and keeping only the model's context in memory.
pub fn sample_with(
    w: &Weights,
    prompt: &str,
    tokens: usize,
    temperature: f64,
    seed: u64,
    mut on_text: impl FnMut(&str) -> Result<()>,
) -> Result<()> {
    if !(temperature.is_finite() && temperature >= 0.0) {
        bail!("--temperature must be a number ≥ 0 (0 samples greedily), got {temperature}");
    }
    if w.config.vocab_size != 256 {
        bail!(
            "sampling decodes bytes, but this model's vocabulary has {} ids (a tokenizer's): \
             sampling token models is not supported yet",
            w.config.vocab_size
        );
    }
    let model = w.model()?;
    let block = w.config.block_size;
    let mut ctx: Vec<u32> = prompt.bytes().map(u32::from).collect();
    if ctx.is_empty() {
        ctx.push(u32::from(b'\n'));
    }
    let mut state = seed ^ 0x5eed;
    let mut utf8 = Utf8Pieces::default();
    for _ in 0..tokens {
        if ctx.len() > 2 * block {
            ctx.drain(..ctx.len() - block);
        }
        let window = &ctx[ctx.len().saturating_sub(block)..];
        let x = Tensor::from_vec(window.to_vec(), (1, window.len()), &Device::Cpu)?;
        let logits = model.forward(&x)?;
        let last = logits.get(window.len() - 1)?;
        let next = if temperature <= 0.0 {
            last.argmax(D::Minus1)?.to_scalar::<u32>()?
        } else {
            let p = candle_core::Tensor::exp(
                &(&last / temperature)?
                    .broadcast_sub(&(&last / temperature)?.max_keepdim(D::Minus1)?)?,
            )?;
            let p = p.to_vec1::<f32>()?;
            let total: f32 = p.iter().sum();
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let mut r = ((state >> 11) as f64 / (1u64 << 53) as f64) as f32 * total;
            let mut pick = p.len() - 1;
            for (i, &pi) in p.iter().enumerate() {
                if r < pi {
                    pick = i;
                    break;
                }
                r -= pi;
            }
            pick as u32
        };
        ctx.push(next);
        let piece = utf8.push(next as u8);
        if !piece.is_empty() {
            on_text(&piece)?;
        }
    }
    let rest = utf8.finish();
    if !rest.is_empty() {
        on_text(&rest)?;
    }
    Ok(())
}

/// Decodes bytes arriving one at a time as [`String::from_utf8_lossy`] decodes them
/// all at once: a character is given out when its last byte arrives.
#[derive(Default)]
struct Utf8Pieces {
    pending: Vec<u8>,
}

impl Utf8Pieces {
    /// The text that `byte` completes (empty inside a multi-byte character).
    fn push(&mut self, byte: u8) -> String {
        self.pending.push(byte);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(s) => {
                    out.push_str(s);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // An invalid sequence: one replacement character, then go on.
                        Some(n) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            self.pending.drain(..valid + n);
                        }
                        // An unfinished character: wait for its next byte.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end (an unfinished character becomes U+FFFD).
    fn finish(self) -> String {
        String::from_utf8_lossy(&self.pending).into_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_given_out_piece_by_piece_is_the_lossy_decoding_of_all_bytes() {
        let cases: [&[u8]; 5] = [
            b"plain ascii",
            "Grüße, 世界 🙂".as_bytes(),
            b"bad \xff byte and a cut \xe4\xb8",
            b"\xf0\x9f\x99 then text \xc3",
            b"\xed\xa0\x80 surrogate, \xc3\x28 bad continuation",
        ];
        for bytes in cases {
            let mut d = Utf8Pieces::default();
            let mut text = String::new();
            for &b in bytes {
                text.push_str(&d.push(b));
            }
            text.push_str(&d.finish());
            assert_eq!(text, String::from_utf8_lossy(bytes), "{bytes:?}");
        }
        // A character comes out with its last byte, not before.
        let mut d = Utf8Pieces::default();
        assert_eq!(d.push(0xe4), "");
        assert_eq!(d.push(0xb8), "");
        assert_eq!(d.push(0x96), "世");
        assert_eq!(d.push(b'a'), "a");
    }
}
