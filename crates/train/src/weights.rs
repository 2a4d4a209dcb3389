//! Whole-model weights outside training: export to one nanoGPT-named safetensors file,
//! load such a file (ours, or one saved from PyTorch), evaluate and sample.
//!
//! ## `switchyard eval` — exactly what it computes
//!
//! The mean cross-entropy, in nats per byte, of predicting each byte from the bytes
//! before it, over consecutive non-overlapping windows of `L + 1` bytes starting at byte
//! 0 of the file: window `k` is bytes `[k(L+1), (k+1)(L+1))`, its inputs are its first `L`
//! bytes and its targets its last `L`. A trailing partial window is skipped; with
//! `--max-windows N` only the first `N` windows count. Every target byte weighs the same:
//! the result is the sum of all `N·L` losses divided by `N·L`.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Module, Tensor, D};
use switchyard_models::{plan_stages, GptConfig, GptStage, LayerCosts, SplitSpec};
use switchyard_shard::{single_device, ParamSource, ParamStore};

use crate::checkpoint::{write_atomic, Checkpoint};
use crate::data::Corpus;

pub const EXPORT_FORMAT: &str = "switchyard-export/1";

/// Buffers of nanoGPT state dicts that are not parameters (causal masks), ignored on load.
fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
}

/// A model's full weights by nanoGPT name and its config.
pub struct Weights {
    pub config: GptConfig,
    pub tensors: HashMap<String, Tensor>,
}

impl Weights {
    /// From a checkpoint directory (its newest complete checkpoint, or a `step-N`
    /// directory) or a `.safetensors` file. A file without switchyard metadata (for
    /// example one saved from PyTorch) takes its shapes from the tensors and the number
    /// of heads from `n_head`.
    pub fn load(path: &Path, n_head: usize) -> Result<Weights> {
        if path.is_dir() {
            let ckpt = Checkpoint::find(path, None)?;
            let full = ckpt.load_full()?;
            return Ok(Weights {
                config: ckpt.manifest.config.model.clone(),
                tensors: full.params,
            });
        }
        let bytes =
            std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
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
        let mut w = Weights { config, tensors };
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

    /// Writes one safetensors file with nanoGPT names and shapes (a tied table is written
    /// under both of its names, as PyTorch's state dict has it), and the config as
    /// metadata.
    pub fn export(&self, out: &Path) -> Result<()> {
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
        let meta = HashMap::from([
            ("format".to_string(), EXPORT_FORMAT.to_string()),
            ("config".to_string(), serde_json::to_string(&self.config)?),
        ]);
        let bytes = safetensors::serialize(map.iter().map(|(k, v)| (k.as_str(), v)), Some(meta))
            .map_err(|e| anyhow!("cannot serialise the weights: {e}"))?;
        write_atomic(out, &bytes)
    }

    /// The whole model on this thread (no parallelism).
    pub fn model(&self) -> Result<GptStage> {
        let flat = LayerCosts {
            embed: 0.0,
            block: 1.0,
            head: 0.0,
        };
        let plan = plan_stages(self.config.n_layer, 1, &SplitSpec::Even, &flat)
            .map_err(anyhow::Error::msg)?;
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
    corpus: &Corpus,
    seq_len: usize,
    max_windows: Option<usize>,
) -> Result<EvalReport> {
    if seq_len == 0 || seq_len > w.config.block_size {
        bail!(
            "--seq-len {seq_len} must be between 1 and the model's block size {}",
            w.config.block_size
        );
    }
    let windows = corpus.eval_windows(seq_len, max_windows);
    if windows.is_empty() {
        bail!(
            "{} is shorter than one window of {} bytes",
            corpus.name,
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
    let model = w.model()?;
    let mut ctx: Vec<u32> = prompt.bytes().map(u32::from).collect();
    if ctx.is_empty() {
        ctx.push(u32::from(b'\n'));
    }
    let mut state = seed ^ 0x5eed;
    let start = ctx.len();
    for _ in 0..tokens {
        let window = &ctx[ctx.len().saturating_sub(w.config.block_size)..];
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
    }
    let bytes: Vec<u8> = ctx[start..].iter().map(|&b| b as u8).collect();
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}
