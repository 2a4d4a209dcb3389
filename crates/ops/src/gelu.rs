//! GELU, tanh approximation, as a custom op with an exact hand-written backward.
//!
//! With `c = √(2/π)`, `a = 0.044715`, `u = c · (x + a·x³)` and `t = tanh(u)`:
//!
//! * `gelu(x)  = 0.5 · x · (1 + t)`
//! * `gelu'(x) = 0.5 · (1 + t) + 0.5 · x · (1 − t²) · c · (1 + 3a·x²)`

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor};

const C: f64 = 0.797_884_560_802_865_4; // √(2/π)
const A: f64 = 0.044_715;

/// GELU with the tanh approximation (GPT-2's `gelu_new`), element-wise:
/// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`.
///
/// For `f32` and `f64` this is one fused pass forward and one backward, with the exact
/// derivative. Other dtypes use a composite of candle primitives (also exact).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::F32 | DType::F64 => x.contiguous()?.apply_op1(Gelu),
        _ => {
            let inner = ((x.sqr()? * A)? + 1.0)?.mul(x)?;
            let t = (inner * C)?.tanh()?;
            ((t + 1.0)? * 0.5)?.mul(x)
        }
    }
}

#[inline]
fn gelu_f64(x: f64) -> f64 {
    0.5 * x * (1.0 + (C * (x + A * x * x * x)).tanh())
}

#[inline]
fn gelu_grad_f64(x: f64) -> f64 {
    let t = (C * (x + A * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * C * (1.0 + 3.0 * A * x * x)
}

#[inline]
fn gelu_f32(x: f32) -> f32 {
    let (c, a) = (C as f32, A as f32);
    0.5 * x * (1.0 + (c * (x + a * x * x * x)).tanh())
}

#[inline]
fn gelu_grad_f32(x: f32) -> f32 {
    let (c, a) = (C as f32, A as f32);
    let t = (c * (x + a * x * x * x)).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * a * x * x)
}

fn contiguous_range(l: &Layout, op: &str) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(r) => Ok(r),
        None => bail!("{op}: expected a contiguous input"),
    }
}

struct Gelu;

impl CustomOp1 for Gelu {
    fn name(&self) -> &'static str {
        "switchyard-gelu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (lo, hi) = contiguous_range(l, self.name())?;
        let out = match s {
            CpuStorage::F32(v) => CpuStorage::F32(v[lo..hi].iter().map(|&x| gelu_f32(x)).collect()),
            CpuStorage::F64(v) => CpuStorage::F64(v[lo..hi].iter().map(|&x| gelu_f64(x)).collect()),
            _ => bail!("{}: unsupported dtype {:?}", self.name(), s.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let g = arg
            .detach()
            .contiguous()?
            .apply_op2_no_bwd(&grad.contiguous()?, &GeluBackward)?;
        Ok(Some(g))
    }
}

/// `(x, g) ↦ g · gelu'(x)`, element-wise; only used inside [`Gelu`]'s backward.
struct GeluBackward;

impl CustomOp2 for GeluBackward {
    fn name(&self) -> &'static str {
        "switchyard-gelu-backward"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if l1.shape() != l2.shape() {
            bail!(
                "{}: shapes differ: {:?} vs {:?}",
                self.name(),
                l1.shape(),
                l2.shape()
            );
        }
        let (a0, a1) = contiguous_range(l1, self.name())?;
        let (b0, b1) = contiguous_range(l2, self.name())?;
        let out = match (s1, s2) {
            (CpuStorage::F32(x), CpuStorage::F32(g)) => CpuStorage::F32(
                x[a0..a1]
                    .iter()
                    .zip(&g[b0..b1])
                    .map(|(&x, &g)| g * gelu_grad_f32(x))
                    .collect(),
            ),
            (CpuStorage::F64(x), CpuStorage::F64(g)) => CpuStorage::F64(
                x[a0..a1]
                    .iter()
                    .zip(&g[b0..b1])
                    .map(|(&x, &g)| g * gelu_grad_f64(x))
                    .collect(),
            ),
            _ => bail!(
                "{}: unsupported dtypes {:?}, {:?}",
                self.name(),
                s1.dtype(),
                s2.dtype()
            ),
        };
        Ok((out, l1.shape().clone()))
    }
}
