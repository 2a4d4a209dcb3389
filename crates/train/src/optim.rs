//! AdamW with decoupled weight decay, and the learning-rate schedule (linear warm-up, then
//! cosine decay to a floor).
//!
//! The update is element-wise, so running it on each rank's shard of a parameter is
//! exactly the update of the whole parameter: a sharded run and a serial run take the
//! same step. It runs in place on the parameter's storage, one fused pass per parameter:
//!
//! ```text
//! p ← p − lr·wd·p                      (only for the parameters [`Decay`] selects)
//! m ← β₁·m + (1 − β₁)·g
//! v ← β₂·v + (1 − β₂)·g²
//! p ← p − lr · (m / (1 − β₁ᵗ)) / (√(v / (1 − β₂ᵗ)) + ε)
//! ```
//!
//! This is `torch.optim.AdamW`'s update, term for term (the decay first, then the
//! bias-corrected step, ε added after the square root); with [`Decay::All`] it is that
//! optimizer with its defaults for which parameters decay, and
//! `tests/pytorch_adamw.rs` holds five steps of a GPT to PyTorch's own numbers. The
//! arithmetic here is f64 (the moments are kept in f64), rounded to the parameter's dtype
//! once per step.

use candle_core::{CpuStorage, DType, Layout, Result, Storage, Tensor, Var};
use serde::{Deserialize, Serialize};

/// Which parameters weight decay applies to.
///
/// The two conventions users compare against: nanoGPT's optimizer groups decay only the
/// matrices (the embeddings, the attention and MLP weights, the head) and leave biases
/// and LayerNorm gains alone; `torch.optim.AdamW` over `model.parameters()` decays
/// everything it is given.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decay {
    /// Only parameters with two or more dims (nanoGPT).
    #[default]
    Matrices,
    /// Every parameter (`torch.optim.AdamW`'s default).
    All,
}

impl Decay {
    /// Whether a parameter with `rank` dims decays.
    pub fn applies_to(self, rank: usize) -> bool {
        match self {
            Decay::Matrices => rank >= 2,
            Decay::All => true,
        }
    }

    /// The name of the flag value and TOML string: `matrices` or `all`.
    pub fn name(self) -> &'static str {
        match self {
            Decay::Matrices => "matrices",
            Decay::All => "all",
        }
    }
}

impl std::fmt::Display for Decay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Decay {
    type Err = crate::TrainError;
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        match s.trim() {
            "matrices" => Ok(Decay::Matrices),
            "all" => Ok(Decay::All),
            other => Err(crate::error::err!(
                Config,
                "unknown decay rule {other:?}: use `matrices` (only weights with 2+ dims, as \
                 nanoGPT) or `all` (every parameter, as torch.optim.AdamW)"
            )),
        }
    }
}

/// AdamW hyper-parameters.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// Which parameters `weight_decay` applies to (absent in checkpoints written before
    /// it existed, which all decayed the matrices only).
    #[serde(default)]
    pub decay: Decay,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            decay: Decay::Matrices,
        }
    }
}

/// Linear warm-up for `warmup` steps to `max_lr`, then cosine decay to `min_lr` at `total`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub max_lr: f64,
    pub min_lr: f64,
    pub warmup: usize,
    pub total: usize,
}

impl LrSchedule {
    /// The learning rate of step `step` (counted from 0).
    pub fn at(&self, step: usize) -> f64 {
        if self.warmup > 0 && step < self.warmup {
            return self.max_lr * (step + 1) as f64 / self.warmup as f64;
        }
        if step >= self.total {
            return self.min_lr;
        }
        let span = (self.total - self.warmup).max(1) as f64;
        let progress = (step - self.warmup) as f64 / span;
        let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress).cos());
        self.min_lr + cosine * (self.max_lr - self.min_lr)
    }
}

/// The moments of one parameter.
#[derive(Debug, Clone, PartialEq)]
pub struct Moments {
    pub m: Vec<f64>,
    pub v: Vec<f64>,
}

/// AdamW over a fixed list of parameters (this rank's shards).
pub struct AdamW {
    pub config: AdamWConfig,
    /// Steps taken so far (`t` of the bias correction).
    pub t: u64,
    params: Vec<Var>,
    decay: Vec<bool>,
    pub moments: Vec<Moments>,
    /// [`AdamW::stage_through_host`].
    via_host: bool,
}

impl AdamW {
    /// `config.decay` decides, from each parameter's rank, which ones decay: with
    /// [`Decay::Matrices`] weights with two or more dims do and biases, norms and gains
    /// do not; with [`Decay::All`] every parameter does.
    pub fn new(params: Vec<Var>, config: AdamWConfig) -> AdamW {
        let decay = params
            .iter()
            .map(|p| config.decay.applies_to(p.rank()))
            .collect();
        let moments = params
            .iter()
            .map(|p| {
                let n = p.elem_count();
                Moments {
                    m: vec![0.0; n],
                    v: vec![0.0; n],
                }
            })
            .collect();
        AdamW {
            config,
            t: 0,
            params,
            decay,
            moments,
            via_host: false,
        }
    }

    pub fn params(&self) -> &[Var] {
        &self.params
    }

    /// One step: `grads[i]` is the (already averaged and clipped) gradient of parameter
    /// `i`, or `None` to leave it untouched.
    pub fn step(&mut self, grads: &[Option<Tensor>], lr: f64) -> Result<()> {
        if grads.len() != self.params.len() {
            candle_core::bail!(
                "AdamW: {} gradients for {} parameters",
                grads.len(),
                self.params.len()
            );
        }
        self.t += 1;
        let c = self.config;
        let bc1 = 1.0 - c.beta1.powi(self.t as i32);
        let bc2 = 1.0 - c.beta2.powi(self.t as i32);
        let items = self
            .params
            .iter()
            .zip(&self.decay)
            .zip(&mut self.moments)
            .zip(grads);
        for (((param, &decay), moments), g) in items {
            let Some(g) = g else { continue };
            let g = g.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?;
            let wd = if decay { c.weight_decay } else { 0.0 };
            let op = Update {
                g: &g,
                mom: std::cell::RefCell::new(moments),
                lr,
                wd,
                c,
                bc1,
                bc2,
            };
            match self.via_host || !param.device().is_cpu() {
                false => param.as_tensor().inplace_op1(&op)?,
                true => update_via_host(param, &op)?,
            }
        }
        Ok(())
    }

    /// Every parameter takes [`update_via_host`], as a parameter on another device does:
    /// for testing that path on the host.
    #[cfg(test)]
    pub(crate) fn stage_through_host(mut self) -> AdamW {
        self.via_host = true;
        self
    }
}

/// The update of a parameter outside host memory (a GPU's): the same element-wise pass on
/// a host copy, written back. The moments live in host memory whatever the device, as
/// with an offloaded optimizer, so the arithmetic is the host's, bit for bit.
fn update_via_host(param: &Var, op: &Update) -> Result<()> {
    let host = param
        .as_tensor()
        .to_device(&candle_core::Device::Cpu)?
        .copy()?;
    host.inplace_op1(op)?;
    param.set(&host.to_device(param.device())?)
}

struct Update<'a> {
    g: &'a [f64],
    mom: std::cell::RefCell<&'a mut Moments>,
    lr: f64,
    wd: f64,
    c: AdamWConfig,
    bc1: f64,
    bc2: f64,
}

impl Update<'_> {
    fn apply<T: candle_core::WithDType>(&self, p: &mut [T]) {
        let mut mom = self.mom.borrow_mut();
        let Moments { m, v } = &mut **mom;
        let step = StepScalars {
            lr: self.lr,
            wd: self.wd,
            c: self.c,
            bc1: self.bc1,
            bc2: self.bc2,
        };
        update_slice(p, self.g, m, v, &step);
    }
}

/// The scalars of one AdamW step of one parameter: the learning rate, its weight decay
/// (0 for a parameter that does not decay), the hyper-parameters and the bias
/// corrections `1 − β₁ᵗ`, `1 − β₂ᵗ`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct StepScalars {
    pub lr: f64,
    pub wd: f64,
    pub c: AdamWConfig,
    pub bc1: f64,
    pub bc2: f64,
}

impl StepScalars {
    /// The bias corrections of step `t` (counted from 1).
    pub fn new(c: AdamWConfig, t: u64, lr: f64, wd: f64) -> StepScalars {
        StepScalars {
            lr,
            wd,
            c,
            bc1: 1.0 - c.beta1.powi(t as i32),
            bc2: 1.0 - c.beta2.powi(t as i32),
        }
    }
}

/// The element-wise AdamW update of `p` (any slice of a parameter) with its gradient `g`
/// and moments `m`, `v`: the one definition both the full optimizer and the ZeRO shards
/// ([`crate::zero`]) run, so that a sharded step is the same arithmetic element by element.
pub(crate) fn update_slice<T: candle_core::WithDType, G: candle_core::WithDType>(
    p: &mut [T],
    g: &[G],
    m: &mut [f64],
    v: &mut [f64],
    s: &StepScalars,
) {
    let c = s.c;
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let g = g.to_f64();
        let mut x = p.to_f64();
        x -= s.lr * s.wd * x;
        *m = c.beta1 * *m + (1.0 - c.beta1) * g;
        *v = c.beta2 * *v + (1.0 - c.beta2) * g * g;
        let mhat = *m / s.bc1;
        let vhat = *v / s.bc2;
        x -= s.lr * mhat / (vhat.sqrt() + c.eps);
        *p = T::from_f64(x);
    }
}

impl candle_core::InplaceOp1 for Update<'_> {
    fn name(&self) -> &'static str {
        "adamw"
    }

    fn cpu_fwd(&self, s: &mut CpuStorage, l: &Layout) -> Result<()> {
        if !l.is_contiguous() {
            candle_core::bail!("AdamW: parameter is not contiguous");
        }
        let (a, b) = (l.start_offset(), l.start_offset() + l.shape().elem_count());
        match s {
            CpuStorage::F32(p) => self.apply(&mut p[a..b]),
            CpuStorage::F64(p) => self.apply(&mut p[a..b]),
            _ => candle_core::bail!("AdamW: only f32 and f64 parameters are supported"),
        }
        Ok(())
    }
}

/// Sum of squares of `t` in f64.
pub fn sum_sq(t: &Tensor) -> Result<f64> {
    let (s, l) = t.storage_and_layout();
    if let (Storage::Cpu(CpuStorage::F32(v)), true) = (&*s, l.is_contiguous()) {
        let (a, b) = (l.start_offset(), l.start_offset() + l.shape().elem_count());
        return Ok(v[a..b].iter().map(|&x| (x as f64) * (x as f64)).sum());
    }
    drop(s);
    t.to_dtype(DType::F64)?.sqr()?.sum_all()?.to_scalar::<f64>()
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn schedule_warms_up_then_decays_to_the_floor() {
        let s = LrSchedule {
            max_lr: 1.0,
            min_lr: 0.1,
            warmup: 4,
            total: 14,
        };
        assert_eq!(s.at(0), 0.25);
        assert_eq!(s.at(3), 1.0);
        assert!((s.at(4) - 1.0).abs() < 1e-12);
        assert!((s.at(9) - 0.55).abs() < 1e-12);
        assert!((s.at(14) - 0.1).abs() < 1e-12);
        assert!((s.at(100) - 0.1).abs() < 1e-12);
    }

    #[test]
    fn adamw_matches_the_formula() -> Result<()> {
        let p = Var::new(&[[1.0f64, -2.0], [0.5, 3.0]], &Device::Cpu)?;
        let b = Var::new(&[1.0f64, 1.0], &Device::Cpu)?;
        let cfg = AdamWConfig::default();
        let mut opt = AdamW::new(vec![p.clone(), b.clone()], cfg);
        let g = Tensor::new(&[[0.1f64, 0.2], [-0.3, 0.0]], &Device::Cpu)?;
        let gb = Tensor::new(&[1.0f64, -1.0], &Device::Cpu)?;
        opt.step(&[Some(g.clone()), Some(gb)], 0.01)?;
        // First step: m̂ = g, v̂ = g², so the update is lr·g/(|g|+ε) = lr·sign(g).
        let want = |x: f64, g: f64| {
            let x = x - 0.01 * 0.1 * x;
            x - 0.01 * g / (g.abs() + 1e-8)
        };
        let got = p.as_tensor().to_vec2::<f64>()?;
        assert!((got[0][0] - want(1.0, 0.1)).abs() < 1e-12);
        assert!((got[1][1] - want(3.0, 0.0)).abs() < 1e-12);
        // Biases are not decayed.
        let got = b.as_tensor().to_vec1::<f64>()?;
        assert!((got[0] - (1.0 - 0.01)).abs() < 1e-9);
        assert!((got[1] - (1.0 + 0.01)).abs() < 1e-9);
        assert_eq!(opt.t, 1);
        Ok(())
    }

    /// A parameter outside host memory is updated on a host copy (the path a GPU's
    /// parameters take): over several steps it is bit-identical to the in-place update.
    #[test]
    fn the_host_staged_update_is_the_in_place_update_bit_for_bit() -> Result<()> {
        let run = |via_host: bool| -> Result<Vec<f32>> {
            let w = Var::new(&[[0.3f32, -1.2, 2.5], [0.01, -0.7, 1.9]], &Device::Cpu)?;
            let b = Var::new(&[0.5f32, -0.25], &Device::Cpu)?;
            let mut opt = AdamW::new(vec![w.clone(), b.clone()], AdamWConfig::default());
            if via_host {
                opt = opt.stage_through_host();
            }
            for k in 0..5 {
                let s = 1.0 + k as f32;
                let gw = Tensor::new(
                    &[[0.1f32 * s, -0.2, 0.3], [0.0, 0.05 * s, -1.0]],
                    &Device::Cpu,
                )?;
                let gb = Tensor::new(&[-0.4f32 * s, 0.9], &Device::Cpu)?;
                opt.step(&[Some(gw), Some(gb)], 0.01)?;
            }
            let mut out = w.as_tensor().flatten_all()?.to_vec1::<f32>()?;
            out.extend(b.as_tensor().to_vec1::<f32>()?);
            Ok(out)
        };
        let (in_place, staged) = (run(false)?, run(true)?);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&in_place), bits(&staged));
        // And the update did something.
        assert_ne!(in_place[0], 0.3);
        Ok(())
    }

    #[test]
    fn decay_all_decays_biases_too() -> Result<()> {
        let b = Var::new(&[1.0f64, 1.0], &Device::Cpu)?;
        let cfg = AdamWConfig {
            decay: Decay::All,
            ..AdamWConfig::default()
        };
        let mut opt = AdamW::new(vec![b.clone()], cfg);
        opt.step(&[Some(Tensor::new(&[1.0f64, -1.0], &Device::Cpu)?)], 0.01)?;
        let got = b.as_tensor().to_vec1::<f64>()?;
        let decayed = 1.0 - 0.01 * 0.1;
        assert!((got[0] - (decayed - 0.01)).abs() < 1e-9, "{got:?}");
        assert!((got[1] - (decayed + 0.01)).abs() < 1e-9, "{got:?}");
        Ok(())
    }

    #[test]
    fn decay_rules_parse_and_serialise_by_name() {
        for d in [Decay::Matrices, Decay::All] {
            assert_eq!(d.name().parse::<Decay>().unwrap(), d);
            assert_eq!(
                serde_json::to_string(&d).unwrap(),
                format!("\"{}\"", d.name())
            );
        }
        let e = "weights".parse::<Decay>().unwrap_err().to_string();
        assert!(
            e.contains("use `matrices`") && e.contains("or `all`"),
            "{e}"
        );
        assert!(!Decay::Matrices.applies_to(1) && Decay::Matrices.applies_to(2));
        assert!(Decay::All.applies_to(1) && Decay::All.applies_to(0));
        // A manifest written before the rule existed decayed the matrices only.
        let old = r#"{"beta1":0.9,"beta2":0.95,"eps":1e-8,"weight_decay":0.1}"#;
        let c: AdamWConfig = serde_json::from_str(old).unwrap();
        assert_eq!(c, AdamWConfig::default());
    }

    /// Seven steps of [`AdamW`] with the [`LrSchedule`] against a plain scalar
    /// implementation written here from the definitions (PyTorch's `AdamW`): the
    /// moments and the bias correction at t ≥ 2, decoupled weight decay on the matrix
    /// only (or, with [`Decay::All`], on the bias too), and the learning rate of each step.
    #[test]
    fn adamw_over_several_steps_matches_an_independent_implementation() -> Result<()> {
        for decay in [Decay::Matrices, Decay::All] {
            several_steps(decay)?;
        }
        Ok(())
    }

    fn several_steps(decay: Decay) -> Result<()> {
        let (b1, b2, eps, wd) = (0.8, 0.99, 1e-6, 0.05);
        let (max_lr, min_lr, warmup, total) = (0.1, 0.01, 2usize, 6usize);
        let lr_at = |step: usize| -> f64 {
            if step < warmup {
                max_lr * (step as f64 + 1.0) / warmup as f64
            } else if step >= total {
                min_lr
            } else {
                let progress = (step - warmup) as f64 / (total - warmup) as f64;
                min_lr + (max_lr - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos()) / 2.0
            }
        };
        // The gradient of element i of parameter k at step s: varied signs and sizes.
        let grad = |k: usize, i: usize, s: usize| -> f64 {
            (((k * 7 + i * 3 + s * 5) % 11) as f64 - 5.0) / 4.0 + 0.01 * s as f64
        };
        let init: [Vec<f64>; 2] = [vec![1.0, -2.0, 0.5, 3.0, -0.25, 0.75], vec![0.3, -0.7]];

        let w = Var::from_vec(init[0].clone(), (2, 3), &Device::Cpu)?;
        let b = Var::from_vec(init[1].clone(), 2, &Device::Cpu)?;
        let cfg = AdamWConfig {
            beta1: b1,
            beta2: b2,
            eps,
            weight_decay: wd,
            decay,
        };
        let mut opt = AdamW::new(vec![w.clone(), b.clone()], cfg);
        let schedule = LrSchedule {
            max_lr,
            min_lr,
            warmup,
            total,
        };

        // The reference: one f64 per element, plain loops.
        let mut x = init.clone();
        let mut m = [vec![0.0; 6], vec![0.0; 2]];
        let mut v = [vec![0.0; 6], vec![0.0; 2]];
        let decayed = [true, decay == Decay::All];

        for step in 0..7 {
            let lr = lr_at(step);
            assert!((schedule.at(step) - lr).abs() < 1e-15, "lr at step {step}");
            let g: Vec<Vec<f64>> = (0..2)
                .map(|k| (0..x[k].len()).map(|i| grad(k, i, step)).collect())
                .collect();
            opt.step(
                &[
                    Some(Tensor::from_vec(g[0].clone(), (2, 3), &Device::Cpu)?),
                    Some(Tensor::from_vec(g[1].clone(), 2, &Device::Cpu)?),
                ],
                schedule.at(step),
            )?;
            let t = (step + 1) as i32;
            for k in 0..2 {
                for i in 0..x[k].len() {
                    if decayed[k] {
                        x[k][i] *= 1.0 - lr * wd;
                    }
                    m[k][i] = b1 * m[k][i] + (1.0 - b1) * g[k][i];
                    v[k][i] = b2 * v[k][i] + (1.0 - b2) * g[k][i] * g[k][i];
                    let m_hat = m[k][i] / (1.0 - b1.powi(t));
                    let v_hat = v[k][i] / (1.0 - b2.powi(t));
                    x[k][i] -= lr * m_hat / (v_hat.sqrt() + eps);
                }
            }
            let got = [
                w.as_tensor().flatten_all()?.to_vec1::<f64>()?,
                b.as_tensor().to_vec1::<f64>()?,
            ];
            for k in 0..2 {
                for i in 0..x[k].len() {
                    let (a, e) = (got[k][i], x[k][i]);
                    assert!(
                        (a - e).abs() <= 1e-12 * e.abs().max(1.0),
                        "step {step}, parameter {k}, element {i}: {a} vs {e}"
                    );
                    assert!((opt.moments[k].m[i] - m[k][i]).abs() < 1e-15);
                    assert!((opt.moments[k].v[i] - v[k][i]).abs() < 1e-15);
                }
            }
        }
        assert_eq!(opt.t, 7);
        // The parameters moved well away from where they started.
        assert!((x[0][3] - init[0][3]).abs() > 0.1 && (x[1][1] - init[1][1]).abs() > 0.1);
        Ok(())
    }
}
