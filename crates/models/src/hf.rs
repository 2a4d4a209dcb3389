//! Hugging Face `transformers` interop for the GPT: `GPT2LMHeadModel`'s directory
//! format (`config.json` + `model.safetensors`), both ways.
//!
//! GPT-2's state dict uses the same names as switchyard's (nanoGPT's), with two
//! differences:
//!
//! * its linear layers are `Conv1D`s whose weights are stored `[in, out]`, the transpose
//!   of `nn.Linear`'s `[out, in]`: the weights of `attn.c_attn`, `attn.c_proj`,
//!   `mlp.c_fc` and `mlp.c_proj` are transposed on the way out and back;
//! * a checkpoint saved from the base `GPT2Model` (the Hub's `gpt2`) has no
//!   `transformer.` prefix; one saved from `GPT2LMHeadModel` has it. Both are read.
//!
//! The activation is `gelu_new` (GELU with the tanh approximation, switchyard's), the
//! LayerNorm epsilon 1e-5, every linear layer has a bias, and dropout is off. A tied head
//! is written once (as `save_pretrained` does: `transformers` ties `lm_head.weight` to
//! `transformer.wte.weight` on load, because `tie_word_embeddings` is true); an untied
//! head is written as `lm_head.weight` with `tie_word_embeddings: false`, which
//! `GPT2LMHeadModel` then loads as its own matrix.

use std::collections::HashMap;

use candle_core::Tensor;
use serde_json::{json, Value};

use crate::gpt_model::{is_buffer, LM_HEAD};
use crate::{GptConfig, ModelError, LN_EPS};

/// The weights whose layout is `[in, out]` in GPT-2's `Conv1D`.
const CONV1D: [&str; 4] = [
    ".attn.c_attn.weight",
    ".attn.c_proj.weight",
    ".mlp.c_fc.weight",
    ".mlp.c_proj.weight",
];
/// GPT-2's `<|endoftext|>` token id.
const GPT2_EOT: usize = 50256;

fn is_conv1d(name: &str) -> bool {
    CONV1D.iter().any(|s| name.ends_with(s))
}

fn weights_err(e: candle_core::Error) -> ModelError {
    ModelError::Weights(e.to_string())
}

/// `config.json` of a `GPT2LMHeadModel` with `cfg`'s shape.
pub fn config_json(cfg: &GptConfig) -> Value {
    let eot = (cfg.vocab_size > GPT2_EOT).then_some(GPT2_EOT);
    json!({
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": cfg.vocab_size,
        "n_positions": cfg.block_size,
        "n_ctx": cfg.block_size,
        "n_embd": cfg.d_model,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": null,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": LN_EPS,
        // Hidden dropout is GPT-2's residual and embedding dropout; its attention has none.
        "resid_pdrop": cfg.hidden_dropout,
        "embd_pdrop": cfg.hidden_dropout,
        "attn_pdrop": 0.0,
        "tie_word_embeddings": cfg.tied_embeddings,
        "scale_attn_weights": true,
        "scale_attn_by_inverse_layer_idx": false,
        // GPT-2's <|endoftext|> where the vocabulary has it; none for a smaller one.
        "bos_token_id": eot,
        "eos_token_id": eot,
        "torch_dtype": "float32",
    })
}

/// Switchyard's parameters (nanoGPT names, `[out, in]` linear weights, a tied table under
/// `transformer.wte.weight` only) as `GPT2LMHeadModel`'s state dict, sorted by name.
pub fn to_hf(
    cfg: &GptConfig,
    params: &HashMap<String, Tensor>,
) -> Result<(Value, Vec<(String, Tensor)>), ModelError> {
    if !cfg.moe.is_dense() {
        return Err(ModelError::Config(format!(
            "GPT2LMHeadModel has no mixture of experts (this model has {} experts in {} blocks): \
             export it in nanoGPT's format instead (without --hf)",
            cfg.moe.experts,
            cfg.moe.moe_layers(cfg.n_layer)
        )));
    }
    let mut out = Vec::with_capacity(params.len());
    for (name, t) in params {
        let t = match is_conv1d(name) {
            true => t.t().and_then(|t| t.contiguous()).map_err(weights_err)?,
            false => t.clone(),
        };
        out.push((name.clone(), t));
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((config_json(cfg), out))
}

fn field(config: &Value, key: &str) -> Result<usize, ModelError> {
    config
        .get(key)
        .and_then(Value::as_u64)
        .map(|v| v as usize)
        .ok_or_else(|| {
            ModelError::Weights(format!(
                "config.json has no whole number {key:?}, which a GPT-2 config has"
            ))
        })
}

/// A `GPT2LMHeadModel` directory's `config.json` and tensors as a GPT: its config and its
/// parameters under switchyard's names and layouts. Refuses what switchyard's GPT does not
/// compute the same way (another activation, LayerNorm epsilon, `n_inner`, model type).
pub fn from_hf(
    config: &Value,
    tensors: HashMap<String, Tensor>,
) -> Result<(GptConfig, HashMap<String, Tensor>), ModelError> {
    let refuse = |what: String| {
        Err(ModelError::Weights(format!(
            "{what}: switchyard's GPT computes GPT-2 with gelu_new, LayerNorm epsilon 1e-5, \
             attention scaled by 1/√(head dim) and a 4·n_embd MLP"
        )))
    };
    if let Some(t) = config.get("model_type").and_then(Value::as_str) {
        if t != "gpt2" {
            return refuse(format!("config.json describes a {t:?} model, not \"gpt2\""));
        }
    }
    if let Some(a) = config.get("activation_function").and_then(Value::as_str) {
        if a != "gelu_new" && a != "gelu_pytorch_tanh" {
            return refuse(format!("config.json asks for the activation {a:?}"));
        }
    }
    if let Some(eps) = config.get("layer_norm_epsilon").and_then(Value::as_f64) {
        if (eps - LN_EPS).abs() > 1e-12 {
            return refuse(format!("config.json asks for layer_norm_epsilon {eps}"));
        }
    }
    if config.get("scale_attn_weights").and_then(Value::as_bool) == Some(false) {
        return refuse("config.json turns scale_attn_weights off".into());
    }
    if config
        .get("scale_attn_by_inverse_layer_idx")
        .and_then(Value::as_bool)
        == Some(true)
    {
        return refuse("config.json asks for scale_attn_by_inverse_layer_idx".into());
    }
    let d_model = field(config, "n_embd")?;
    if let Some(inner) = config.get("n_inner").and_then(Value::as_u64) {
        if inner as usize != 4 * d_model {
            return refuse(format!("config.json asks for n_inner {inner}"));
        }
    }
    let cfg = GptConfig {
        vocab_size: field(config, "vocab_size")?,
        block_size: field(config, "n_positions")?,
        n_layer: field(config, "n_layer")?,
        n_head: field(config, "n_head")?,
        d_model,
        // transformers' default.
        tied_embeddings: config
            .get("tie_word_embeddings")
            .and_then(Value::as_bool)
            .unwrap_or(true),
        ..GptConfig::default()
    };
    cfg.validate()?;
    let mut params = HashMap::with_capacity(tensors.len());
    for (name, t) in tensors {
        // Causal-mask buffers of older transformers versions are not parameters.
        if is_buffer(&name) {
            continue;
        }
        let name = match name.starts_with("transformer.") || name == LM_HEAD {
            true => name,
            false => format!("transformer.{name}"),
        };
        let t = match is_conv1d(&name) {
            true => t.t().and_then(|t| t.contiguous()).map_err(weights_err)?,
            false => t,
        };
        params.insert(name, t);
    }
    if cfg.tied_embeddings {
        // save_pretrained writes a tied head once; a file that has both holds equal copies.
        params.remove(LM_HEAD);
    }
    Ok((cfg, params))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn weights(cfg: &GptConfig) -> HashMap<String, Tensor> {
        cfg.param_shapes()
            .into_iter()
            .enumerate()
            .map(|(i, (n, s))| {
                let len: usize = s.iter().product();
                let v: Vec<f32> = (0..len).map(|j| (i * 1000 + j) as f32).collect();
                (n, Tensor::from_vec(v, s, &Device::Cpu).unwrap())
            })
            .collect()
    }

    fn equal(a: &Tensor, b: &Tensor) -> bool {
        a.dims() == b.dims()
            && a.flatten_all().unwrap().to_vec1::<f32>().unwrap()
                == b.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    }

    #[test]
    fn the_round_trip_is_exact_and_conv1d_weights_are_transposed() {
        for tied in [true, false] {
            let cfg = GptConfig {
                tied_embeddings: tied,
                ..GptConfig::tiny(2)
            };
            let w = weights(&cfg);
            let (json, hf) = to_hf(&cfg, &w).unwrap();
            let c_fc = &hf
                .iter()
                .find(|(n, _)| n == "transformer.h.0.mlp.c_fc.weight")
                .unwrap()
                .1;
            assert_eq!(c_fc.dims(), &[cfg.d_model, 4 * cfg.d_model], "[in, out]");
            assert_eq!(
                hf.iter().any(|(n, _)| n == "lm_head.weight"),
                !tied,
                "a tied head is written once"
            );
            assert_eq!(json["tie_word_embeddings"], tied);
            let (back_cfg, back) = from_hf(&json, hf.into_iter().collect()).unwrap();
            assert_eq!(back_cfg, cfg);
            assert_eq!(back.len(), w.len());
            for (n, t) in &w {
                assert!(equal(&back[n], t), "{n}");
            }
        }
    }

    #[test]
    fn base_model_names_and_mask_buffers_are_read() {
        let cfg = GptConfig::tiny(2);
        let (json, hf) = to_hf(&cfg, &weights(&cfg)).unwrap();
        let mut base: HashMap<String, Tensor> = hf
            .into_iter()
            .map(|(n, t)| (n.trim_start_matches("transformer.").to_string(), t))
            .collect();
        base.insert(
            "h.0.attn.bias".into(),
            Tensor::zeros((1, 1, 4, 4), DType::F32, &Device::Cpu).unwrap(),
        );
        let (c, params) = from_hf(&json, base).unwrap();
        assert_eq!(c, cfg);
        assert!(params.contains_key("transformer.wte.weight"));
        assert!(!params.contains_key("transformer.h.0.attn.bias"));
        assert!(params.contains_key("transformer.h.0.attn.c_attn.bias"));
    }

    #[test]
    fn other_computations_are_refused_naming_the_setting() {
        let cfg = GptConfig::tiny(2);
        let mut json = config_json(&cfg);
        json["activation_function"] = "relu".into();
        let e = from_hf(&json, HashMap::new()).unwrap_err().to_string();
        assert!(e.contains("the activation \"relu\""), "{e}");
        let mut json = config_json(&cfg);
        json["model_type"] = "llama".into();
        let e = from_hf(&json, HashMap::new()).unwrap_err().to_string();
        assert!(e.contains("\"llama\" model"), "{e}");
        let mut json = config_json(&cfg);
        json.as_object_mut().unwrap().remove("n_embd");
        let e = from_hf(&json, HashMap::new()).unwrap_err().to_string();
        assert!(e.contains("no whole number \"n_embd\""), "{e}");
    }
}
