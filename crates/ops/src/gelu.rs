//! GELU, tanh approximation, as a custom op with an exact hand-written backward.
//!
//! With `c = √(2/π)`, `a = 0.044715`, `u = c · (x + a·x³)` and `t = tanh(u)`:
//!
//! * `gelu(x)  = 0.5 · x · (1 + t)`
//! * `gelu'(x) = 0.5 · (1 + t) + 0.5 · x · (1 − t²) · c · (1 + 3a·x²)`

use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::kernel::{self, simd, Float, Uninit};
use crate::OpsBackend;

const C: f64 = 0.797_884_560_802_865_4; // √(2/π)
const A: f64 = 0.044_715;

/// GELU with the tanh approximation (GPT-2's `gelu_new`), element-wise:
/// `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`.
///
/// For `f32` and `f64` this is one fused pass forward and one backward, with the exact
/// derivative. Other dtypes use a composite of candle primitives (also exact).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    gelu_on(OpsBackend::Fused, x)
}

pub(crate) fn gelu_on(backend: OpsBackend, x: &Tensor) -> Result<Tensor> {
    match backend.fuses(x) {
        true => x.contiguous()?.apply_op1(Gelu),
        false => crate::composed::gelu(x),
    }
}

simd! {
    /// `y = gelu(x)`, element-wise.
    fn gelu_kernel<T>(x: &[T], y: &mut [MaybeUninit<T>]) {
        let (c, a, half) = (T::from_f64(C), T::from_f64(A), T::from_f64(0.5));
        for (y, &x) in y.iter_mut().zip(x) {
            y.write(half * x * (T::one() + (c * (x + a * x * x * x)).tanh()));
        }
    }
}

simd! {
    /// `dx = g · gelu'(x)`, element-wise.
    fn gelu_grad_kernel<T>(x: &[T], g: &[T], dx: &mut [MaybeUninit<T>]) {
        let (c, a, half) = (T::from_f64(C), T::from_f64(A), T::from_f64(0.5));
        let three_a = T::from_f64(3.0 * A);
        for ((d, &x), &g) in dx.iter_mut().zip(x).zip(g) {
            let t = (c * (x + a * x * x * x)).tanh();
            let dt = (T::one() - t * t) * c * (T::one() + three_a * x * x);
            d.write(g * (half * (T::one() + t) + half * x * dt));
        }
    }
}

/// The portable kernels on one thread, for comparison with [`crate::avx512`]'s:
/// `(gelu(x), g · gelu′(x))`.
#[cfg(test)]
pub(crate) fn portable<T: Float>(x: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
    assert_eq!(g.len(), x.len());
    let (mut y, mut dx) = (Uninit::new(x.len()).unwrap(), Uninit::new(x.len()).unwrap());
    kernel::portable_only(|| {
        gelu_kernel(x, y.as_mut());
        gelu_grad_kernel(x, g, dx.as_mut());
    });
    // SAFETY: both kernels wrote every element (`x`, `g` and the outputs have one length).
    unsafe { (y.assume_init(), dx.assume_init()) }
}

/// Elements per parallel task of an element-wise kernel over `n` elements.
fn chunk(n: usize) -> usize {
    let t = rayon::current_num_threads();
    if t <= 1 {
        n.max(1)
    } else {
        n.div_ceil(4 * t).next_multiple_of(64).max(64)
    }
}

/// `gelu(x)`, split over the pool's threads.
pub(crate) fn gelu_forward<T: Float>(x: &[T]) -> Result<Vec<T>> {
    let mut y = Uninit::new(x.len())?;
    let c = chunk(x.len());
    y.as_mut()
        .par_chunks_mut(c)
        .zip(x.par_chunks(c))
        .for_each(|(y, x)| {
            #[cfg(target_arch = "x86_64")]
            if let (Some(x), Some(y)) = (kernel::avx512_f32(x), kernel::avx512_f32_out(y)) {
                // SAFETY: `avx512_f32` only answers on CPUs with AVX-512.
                return unsafe { crate::avx512::gelu(x, y) };
            }
            gelu_kernel(x, y)
        });
    // SAFETY: the chunks of `y` and `x` pair up one to one, and each kernel writes all
    // of its chunk of `y`.
    Ok(unsafe { y.assume_init() })
}

/// `g · gelu'(x)` (`g` of `x`'s length), split over the pool's threads.
pub(crate) fn gelu_backward<T: Float>(x: &[T], g: &[T]) -> Result<Vec<T>> {
    if g.len() != x.len() {
        bail!(
            "gelu backward: {} gradients for {} inputs",
            g.len(),
            x.len()
        )
    }
    let mut dx = Uninit::new(x.len())?;
    let c = chunk(x.len());
    dx.as_mut()
        .par_chunks_mut(c)
        .zip(x.par_chunks(c).zip(g.par_chunks(c)))
        .for_each(|(d, (x, g))| {
            #[cfg(target_arch = "x86_64")]
            if let (Some(x), Some(g), Some(d)) = (
                kernel::avx512_f32(x),
                kernel::avx512_f32(g),
                kernel::avx512_f32_out(d),
            ) {
                // SAFETY: `avx512_f32` only answers on CPUs with AVX-512.
                return unsafe { crate::avx512::gelu_grad(x, g, d) };
            }
            gelu_grad_kernel(x, g, d)
        });
    // SAFETY: the chunks of `dx`, `x` and `g` (all of one length) pair up one to one,
    // and each kernel writes all of its chunk of `dx`.
    Ok(unsafe { dx.assume_init() })
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
            CpuStorage::F32(v) => CpuStorage::F32(gelu_forward(&v[lo..hi])?),
            CpuStorage::F64(v) => CpuStorage::F64(gelu_forward(&v[lo..hi])?),
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
            (CpuStorage::F32(x), CpuStorage::F32(g)) => {
                CpuStorage::F32(gelu_backward(&x[a0..a1], &g[b0..b1])?)
            }
            (CpuStorage::F64(x), CpuStorage::F64(g)) => {
                CpuStorage::F64(gelu_backward(&x[a0..a1], &g[b0..b1])?)
            }
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
