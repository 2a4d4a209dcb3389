//! A small, plain, single-device GPT — the reference every parallel run is checked
//! against, in the spirit of llm.c.
//!
//! It shares nothing with the parallel code path but the parameter values: plain candle
//! tensor operations, written out in full (`x·Wᵀ + b`, LayerNorm from mean and variance,
//! a masked softmax, cross-entropy from log-sum-exp), one device, the whole batch at once.
//! If a pipeline, tensor or data-parallel layout disagrees with this, the layout is wrong.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor, Var, D};

use crate::{GptConfig, ModelError};

/// The reference GPT over full (unsharded) parameters, by nanoGPT name.
pub struct ReferenceGpt {
    cfg: GptConfig,
    params: HashMap<String, Var>,
}

fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.broadcast_matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let xn = xc.broadcast_div(&(var + crate::gpt::LN_EPS)?.sqrt()?)?;
    xn.broadcast_mul(w)?.broadcast_add(b)
}

fn softmax_last(x: &Tensor) -> Result<Tensor> {
    let e = x.broadcast_sub(&x.max_keepdim(D::Minus1)?)?.exp()?;
    e.broadcast_div(&e.sum_keepdim(D::Minus1)?)
}

impl ReferenceGpt {
    /// Wraps copies of `weights` (full tensors by nanoGPT name) as variables.
    pub fn new(cfg: &GptConfig, weights: &HashMap<String, Tensor>) -> Result<ReferenceGpt> {
        let params = weights
            .iter()
            .map(|(k, v)| Ok((k.clone(), Var::from_tensor(&v.copy()?)?)))
            .collect::<Result<_>>()?;
        Ok(ReferenceGpt {
            cfg: cfg.clone(),
            params,
        })
    }

    /// The variables, by name (with tied embeddings, `lm_head.weight` is absent: the
    /// head uses `transformer.wte.weight`).
    pub fn params(&self) -> &HashMap<String, Var> {
        &self.params
    }

    fn p(&self, name: &str) -> Result<&Tensor> {
        match self.params.get(name) {
            Some(v) => Ok(v.as_tensor()),
            None => Err(ModelError::MissingParam {
                model: "reference GPT",
                name: name.to_string(),
            }
            .into()),
        }
    }

    /// Logits `[B·T, V]` for token ids `[B, T]`.
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        let c = &self.cfg;
        let (b, t) = ids.dims2()?;
        let (d, nh) = (c.d_model, c.n_head);
        let hd = d / nh;
        let tok = self
            .p("transformer.wte.weight")?
            .index_select(&ids.flatten_all()?, 0)?;
        let pos = self.p("transformer.wpe.weight")?.narrow(0, 0, t)?;
        let mut x = tok.reshape((b, t, d))?.broadcast_add(&pos)?;
        let mask: Vec<f32> = (0..t * t)
            .map(|i| {
                if i % t > i / t {
                    f32::NEG_INFINITY
                } else {
                    0.0
                }
            })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)?.to_dtype(x.dtype())?;
        for l in 0..c.n_layer {
            let p = |n: &str| self.p(&format!("transformer.h.{l}.{n}"));
            let h = layer_norm(&x, p("ln_1.weight")?, p("ln_1.bias")?)?;
            let qkv = linear(&h, p("attn.c_attn.weight")?, Some(p("attn.c_attn.bias")?))?;
            let heads = |i: usize| {
                qkv.narrow(2, i * d, d)?
                    .reshape((b, t, nh, hd))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
            let att = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(&mask)?;
            let y = softmax_last(&att)?.matmul(&v)?;
            let y = y.transpose(1, 2)?.reshape((b, t, d))?;
            let y = linear(&y, p("attn.c_proj.weight")?, Some(p("attn.c_proj.bias")?))?;
            x = (x + y)?;
            let h = layer_norm(&x, p("ln_2.weight")?, p("ln_2.bias")?)?;
            let h = linear(&h, p("mlp.c_fc.weight")?, Some(p("mlp.c_fc.bias")?))?.gelu()?;
            let h = linear(&h, p("mlp.c_proj.weight")?, Some(p("mlp.c_proj.bias")?))?;
            x = (x + h)?;
        }
        let x = layer_norm(
            &x,
            self.p("transformer.ln_f.weight")?,
            self.p("transformer.ln_f.bias")?,
        )?;
        let head = if c.tied_embeddings {
            "transformer.wte.weight"
        } else {
            "lm_head.weight"
        };
        linear(&x, self.p(head)?, None)?.reshape((b * t, c.vocab_size))
    }

    /// The mean cross-entropy of predicting `targets` `[B, T]` from `ids` `[B, T]`.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = self.logits(ids)?;
        let lse = {
            let m = logits.max_keepdim(D::Minus1)?;
            (logits
                .broadcast_sub(&m)?
                .exp()?
                .sum_keepdim(D::Minus1)?
                .log()?
                + m)?
        };
        let picked = logits.gather(&targets.flatten_all()?.unsqueeze(1)?, 1)?;
        (lse - picked)?.mean_all()
    }

    /// The loss and every parameter's gradient, by name, for one batch.
    pub fn loss_and_grads(
        &self,
        ids: &Tensor,
        targets: &Tensor,
    ) -> Result<(f64, HashMap<String, Tensor>)> {
        let loss = self.loss(ids, targets)?;
        let grads = loss.backward()?;
        let mut out = HashMap::new();
        for (name, v) in &self.params {
            let g = match grads.get(v.as_tensor()) {
                Some(g) => g.clone(),
                None => v.zeros_like()?,
            };
            out.insert(name.clone(), g);
        }
        Ok((loss.to_dtype(DType::F64)?.to_scalar::<f64>()?, out))
    }
}
