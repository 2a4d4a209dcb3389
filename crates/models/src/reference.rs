//! A small, plain, single-device GPT — the reference every parallel run is checked
//! against, in the spirit of llm.c.
//!
//! It shares nothing with the parallel code path but the parameter values: plain candle
//! tensor operations, written out in full (`x·Wᵀ + b`, LayerNorm from mean and variance,
//! a masked softmax, cross-entropy from log-sum-exp), one device, the whole batch at once.
//! If a pipeline, tensor or data-parallel layout disagrees with this, the layout is wrong.
//!
//! With hidden dropout it multiplies each dropped-out tensor by its mask
//! ([`switchyard_ops::DropoutMask::tensor`] of the whole batch: the one thing it shares
//! with the model besides the weights, since the masks are what make a layout reproduce
//! one device).

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor, Var, D};

use crate::{GptConfig, ModelError};

/// The reference GPT over full (unsharded) parameters, by nanoGPT name.
pub struct ReferenceGpt {
    cfg: GptConfig,
    params: HashMap<String, Var>,
    /// The training step its dropouts draw for, `(seed, step)`; none: nothing dropped.
    dropout_step: Option<(u64, u64)>,
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
            dropout_step: None,
        })
    }

    /// Forwards from now on are step `step` of a run seeded `seed`, whose batch they
    /// compute whole: with hidden dropout they drop what the trainer drops on that step.
    pub fn set_dropout_step(&mut self, seed: u64, step: u64) {
        self.dropout_step = Some((seed, step));
    }

    /// `x` `[B, T, d]` dropped out at `site`: times its mask, or `x` with no dropout.
    fn dropout(&self, x: &Tensor, site: u64) -> Result<Tensor> {
        let (Some((seed, step)), p) = (self.dropout_step, self.cfg.hidden_dropout) else {
            return Ok(x.clone());
        };
        if p == 0.0 {
            return Ok(x.clone());
        }
        let mask = switchyard_ops::DropoutMask {
            p,
            key: switchyard_ops::DropoutMask::step_key(seed, step),
            site,
            first_row: 0,
            first_position: 0,
        };
        x * mask.tensor(x.dims3()?, x.dtype(), x.device())?
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

    /// Logits `[B·T, V]` for token ids `[B, T]`, and the mixtures of experts'
    /// balancing loss (a scalar; zero for a dense model).
    pub fn forward(&self, ids: &Tensor) -> Result<(Tensor, Tensor)> {
        let c = &self.cfg;
        let (b, t) = ids.dims2()?;
        let (d, nh) = (c.d_model, c.n_head);
        let hd = d / nh;
        let tok = self
            .p("transformer.wte.weight")?
            .index_select(&ids.flatten_all()?, 0)?;
        let pos = self.p("transformer.wpe.weight")?.narrow(0, 0, t)?;
        // Dropout sites: 0 after the embeddings, 2l + 1 and 2l + 2 on block l's branches.
        let mut x = self.dropout(&tok.reshape((b, t, d))?.broadcast_add(&pos)?, 0)?;
        let mut aux = Tensor::zeros((), x.dtype(), x.device())?;
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
            x = (x + self.dropout(&y, 2 * l as u64 + 1)?)?;
            let h = layer_norm(&x, p("ln_2.weight")?, p("ln_2.bias")?)?;
            let h = match c.moe.is_moe_layer(l) {
                false => self.mlp(&h, &format!("transformer.h.{l}.mlp"))?,
                true => {
                    let (h, a) = self.moe(&h, l)?;
                    aux = (aux + a)?;
                    h
                }
            };
            x = (x + self.dropout(&h, 2 * l as u64 + 2)?)?;
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
        let logits = linear(&x, self.p(head)?, None)?.reshape((b * t, c.vocab_size))?;
        Ok((logits, aux))
    }

    /// Logits `[B·T, V]` for token ids `[B, T]`.
    pub fn logits(&self, ids: &Tensor) -> Result<Tensor> {
        Ok(self.forward(ids)?.0)
    }

    /// A dense MLP whose parameters are under `prefix`.
    fn mlp(&self, h: &Tensor, prefix: &str) -> Result<Tensor> {
        let p = |n: &str| self.p(&format!("{prefix}.{n}"));
        let h = linear(h, p("c_fc.weight")?, Some(p("c_fc.bias")?))?.gelu()?;
        linear(&h, p("c_proj.weight")?, Some(p("c_proj.bias")?))
    }

    /// Block `l`'s mixture of experts on `h` `[B, T, d]`, and its balancing loss
    /// (`α` times the mean over the sequences of `E · Σ_e f_e · P_e`). Every expert
    /// runs on every token, weighted by a gate that is zero where the token does not
    /// reach it.
    fn moe(&self, h: &Tensor, l: usize) -> Result<(Tensor, Tensor)> {
        let m = &self.cfg.moe;
        let (b, t, _) = h.dims3()?;
        let (e_n, k) = (m.experts, m.top_k);
        let prefix = format!("transformer.h.{l}.mlp");
        let router = self.p(&format!("{prefix}.router.weight"))?;
        let probs = softmax_last(&linear(h, router, None)?)?; // [B, T, E]
        let pv = probs.to_dtype(DType::F32)?.to_vec3::<f32>()?;
        let cap = match m.capacity_factor > 0.0 {
            true => (m.capacity_factor * (k * t) as f64 / e_n as f64).ceil() as usize,
            false => usize::MAX,
        };
        let (mut chosen, mut kept) = (vec![0f32; b * t * e_n], vec![0f32; b * t * e_n]);
        let mut f = vec![0f32; b * e_n];
        for (row, seq) in pv.iter().enumerate() {
            // Each token's top k: repeated arg-max, the lower index winning a tie.
            let tops: Vec<Vec<usize>> = seq
                .iter()
                .map(|p| {
                    let mut top: Vec<usize> = Vec::new();
                    for _ in 0..k {
                        let best = (0..e_n).filter(|e| !top.contains(e)).fold(
                            None,
                            |best: Option<usize>, e| match best {
                                Some(j) if p[j] >= p[e] => Some(j),
                                _ => Some(e),
                            },
                        );
                        top.extend(best);
                    }
                    top
                })
                .collect();
            let mut load = vec![0; e_n];
            for (pos, top) in tops.iter().enumerate() {
                // In position order, a token's first choice before its second.
                for &e in top {
                    let at = (row * t + pos) * e_n + e;
                    chosen[at] = 1.0;
                    f[row * e_n + e] += 1.0 / (t * k) as f32;
                    if load[e] < cap {
                        load[e] += 1;
                        kept[at] = 1.0;
                    }
                }
            }
        }
        let dev = h.device();
        let mask = |v: Vec<f32>| Tensor::from_vec(v, (b, t, e_n), dev)?.to_dtype(h.dtype());
        let picked = (&probs * mask(chosen)?)?;
        let gates = match k {
            1 => picked,
            _ => picked.broadcast_div(&picked.sum_keepdim(D::Minus1)?)?,
        };
        let gates = (gates * mask(kept)?)?;
        let mut out = h.zeros_like()?;
        for e in 0..e_n {
            let y = self.mlp(h, &format!("{prefix}.experts.{e}"))?;
            out = (out + y.broadcast_mul(&gates.narrow(2, e, 1)?)?)?;
        }
        let f = Tensor::from_vec(f, (b, e_n), dev)?.to_dtype(h.dtype())?;
        let p_mean = probs.mean(1)?;
        let mut aux = ((p_mean * f)?.sum_all()? * (e_n as f64 * m.aux_loss_coef / b as f64))?;
        if m.z_loss_coef > 0.0 {
            // The router z-loss: per token (log Σ_e exp z_e)², its mean over the
            // sequence, the mean over the sequences.
            let z = linear(h, router, None)?;
            let lse = z.exp()?.sum_keepdim(D::Minus1)?.log()?;
            aux = (aux + (lse.sqr()?.mean_all()? * m.z_loss_coef)?)?;
        }
        Ok((out, aux))
    }

    /// The mean cross-entropy of predicting `targets` `[B, T]` from `ids` `[B, T]`.
    pub fn loss(&self, ids: &Tensor, targets: &Tensor) -> Result<Tensor> {
        Ok(self.objective(ids, targets)?.0)
    }

    /// The mean cross-entropy, and what training minimises: it plus the mixtures of
    /// experts' balancing loss (the same tensor for a dense model).
    pub fn objective(&self, ids: &Tensor, targets: &Tensor) -> Result<(Tensor, Tensor)> {
        let (logits, aux) = self.forward(ids)?;
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
        let ce = (lse - picked)?.mean_all()?;
        match self.cfg.moe.is_dense() {
            true => Ok((ce.clone(), ce)),
            false => Ok((ce.clone(), (ce + aux)?)),
        }
    }

    /// The loss (the cross-entropy) and every parameter's gradient (of the objective),
    /// by name, for one batch.
    pub fn loss_and_grads(
        &self,
        ids: &Tensor,
        targets: &Tensor,
    ) -> Result<(f64, HashMap<String, Tensor>)> {
        let (loss, objective) = self.objective(ids, targets)?;
        let grads = objective.backward()?;
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
