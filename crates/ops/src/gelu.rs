//! GELU, tanh approximation, as a custom op with an exact hand-written backward.
//!
//! With `c = √(2/π)`, `a = 0.044715`, `u = c · (x + a·x³)` and `t = tanh(u)`:
//!
//! * `gelu(x)  = 0.5 · x · (1 + t)`
//! * `gelu'(x) = 0.5 · (1 + t) + 0.5 · x · (1 − t²) · c · (1 + 3a·x²)`

use std::mem::MaybeUninit;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor};
use half::bf16;
use rayon::prelude::*;

use crate::bf16::{round_into, widen_into};
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
    kernel::portable_only(|| simd_build(x, g))
}

/// [`gelu_kernel`] and [`gelu_grad_kernel`] on one thread, in the build this thread
/// allows (see [`kernel::portable_only`]): `(gelu(x), g · gelu′(x))`.
#[cfg(test)]
pub(crate) fn simd_build<T: Float>(x: &[T], g: &[T]) -> (Vec<T>, Vec<T>) {
    assert_eq!(g.len(), x.len());
    let (mut y, mut dx) = (Uninit::new(x.len()).unwrap(), Uninit::new(x.len()).unwrap());
    gelu_kernel(x, y.as_mut());
    gelu_grad_kernel(x, g, dx.as_mut());
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

/// f32 elements per block of the fused bf16 passes below: 16 KiB, which stays in L1
/// with the block's other buffers (64 under Miri, so that its small tests span blocks).
const BF16_BLOCK: usize = if cfg!(miri) { 64 } else { 4096 };

/// `y = gelu(x)` on one block (AVX-512 where the CPU has it).
fn gelu_block(x: &[f32], y: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    if kernel::avx512() {
        // SAFETY: the CPU has AVX-512 (checked just above).
        return unsafe { crate::avx512::gelu(x, y) };
    }
    gelu_kernel::<f32>(x, y)
}

/// `d = g · gelu′(x)` on one block (AVX-512 where the CPU has it).
fn gelu_grad_block(x: &[f32], g: &[f32], d: &mut [MaybeUninit<f32>]) {
    #[cfg(target_arch = "x86_64")]
    if kernel::avx512() {
        // SAFETY: the CPU has AVX-512 (checked just above).
        return unsafe { crate::avx512::gelu_grad(x, g, d) };
    }
    gelu_grad_kernel::<f32>(x, g, d)
}

/// The first `n` elements of `y`, all written.
///
/// # Safety
/// `y[..n]` is initialised.
pub(crate) unsafe fn written(y: &[MaybeUninit<f32>], n: usize) -> &[f32] {
    // SAFETY: `MaybeUninit<f32>` has f32's layout, and the caller vouches for the values.
    unsafe { std::slice::from_raw_parts(y.as_ptr().cast::<f32>(), n) }
}

/// Room for `n` bf16 values, written through `spare_capacity_mut`.
fn bf16_buffer(n: usize) -> Result<Vec<bf16>> {
    let mut v = Vec::new();
    if let Err(e) = v.try_reserve_exact(n) {
        bail!("switchyard-ops: cannot allocate {n} bf16 elements: {e}")
    }
    Ok(v)
}

/// The MLP's middle at bf16 precision, in one pass over its pre-activation `pre` (the
/// f32 output of the first product): `(pre, gelu(pre))`, each rounded to bf16, GELU
/// taken of the rounded values. What the op keeps for its backward and what its second
/// product reads: the same numbers as rounding `pre` in place, [`gelu_forward`] and
/// rounding its output, without writing and reading `pre` and the GELU output in f32
/// (each block of 4,096 elements goes through L1).
pub(crate) fn gelu_forward_bf16(pre: &[f32]) -> Result<(Vec<bf16>, Vec<bf16>)> {
    let n = pre.len();
    let (mut p, mut h) = (bf16_buffer(n)?, bf16_buffer(n)?);
    let c = chunk(n);
    p.spare_capacity_mut()[..n]
        .par_chunks_mut(c)
        .zip(h.spare_capacity_mut()[..n].par_chunks_mut(c))
        .zip(pre.par_chunks(c))
        .for_each(|((p, h), x)| {
            let mut wide = vec![0f32; BF16_BLOCK.min(x.len())];
            let mut out = vec![MaybeUninit::<f32>::uninit(); wide.len()];
            for ((p, h), x) in p
                .chunks_mut(BF16_BLOCK)
                .zip(h.chunks_mut(BF16_BLOCK))
                .zip(x.chunks(BF16_BLOCK))
            {
                let b = x.len();
                round_into::<f32>(x, p);
                // SAFETY: `round_into` wrote all `b` elements of `p`.
                let rounded = unsafe { std::slice::from_raw_parts(p.as_ptr().cast::<bf16>(), b) };
                widen_into::<f32>(rounded, &mut wide[..b]);
                gelu_block(&wide[..b], &mut out[..b]);
                // SAFETY: `gelu_block` wrote all `b` elements of `out`.
                round_into::<f32>(unsafe { written(&out, b) }, h);
            }
        });
    // SAFETY: the chunks of `p`, `h` and `pre` pair up one to one, and each block wrote
    // every element of its chunk of `p` and `h`.
    unsafe {
        p.set_len(n);
        h.set_len(n);
    }
    Ok((p, h))
}

/// The MLP's middle backward at bf16 precision: `g · gelu′(pre)` for the kept bf16
/// `pre`, rounded to bf16 (what the first product's two backward products read), and,
/// with `width`, its column sums over rows of `width` before rounding (the first bias's
/// gradient, summed as [`crate::linear::column_sums`] sums). One pass, a block of
/// rows in L1 at a time: no f32 `pre` or gradient is written.
pub(crate) fn gelu_backward_bf16(
    pre: &[bf16],
    g: &[f32],
    width: Option<usize>,
) -> Result<(Vec<bf16>, Option<Vec<f32>>)> {
    let n = pre.len();
    if g.len() != n {
        bail!("gelu backward: {} gradients for {n} inputs", g.len())
    }
    let w = width.unwrap_or(1).max(1);
    if !n.is_multiple_of(w) {
        bail!("gelu backward: {n} elements are not rows of {w}")
    }
    let mut d = bf16_buffer(n)?;
    // Tasks and blocks of whole rows; the tasks' rows as `column_sums` splits them.
    let per = kernel::rows_per_task(n / w) * w;
    let block = (BF16_BLOCK / w).max(1) * w;
    let parts: Vec<Option<Vec<f32>>> = d.spare_capacity_mut()[..n]
        .par_chunks_mut(per.max(1))
        .zip(pre.par_chunks(per.max(1)).zip(g.par_chunks(per.max(1))))
        .map(|(d, (x, g))| {
            let mut acc = width.map(|w| vec![0f32; w]);
            let mut wide = vec![0f32; block.min(x.len())];
            let mut out = vec![MaybeUninit::<f32>::uninit(); wide.len()];
            for ((d, x), g) in d
                .chunks_mut(block)
                .zip(x.chunks(block))
                .zip(g.chunks(block))
            {
                let b = x.len();
                widen_into::<f32>(x, &mut wide[..b]);
                gelu_grad_block(&wide[..b], g, &mut out[..b]);
                // SAFETY: `gelu_grad_block` wrote all `b` elements of `out`.
                let out = unsafe { written(&out, b) };
                if let Some(acc) = &mut acc {
                    crate::linear::col_sums::<f32>(out, acc);
                }
                round_into::<f32>(out, d);
            }
            acc
        })
        .collect();
    // SAFETY: the chunks of `d`, `pre` and `g` pair up one to one, and each block wrote
    // every element of its chunk of `d`.
    unsafe { d.set_len(n) };
    let sums = width.map(|w| {
        let mut total = vec![0f32; w];
        for p in parts.into_iter().flatten() {
            for (t, v) in total.iter_mut().zip(p) {
                *t += v;
            }
        }
        total
    });
    Ok((d, sums))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bf16::{to_bf16_vec, widen, Bf16Product};
    use crate::linear::column_sums;

    /// Pseudo-random values in [-6, 6), with zeros, a tiny and a large one (not so large
    /// that the derivative makes a NaN, whose sign is not defined).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        let mut v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 12.0 - 6.0
            })
            .collect();
        v[..4].copy_from_slice(&[0.0, -0.0, 1e-39, 1e4]);
        v
    }

    fn bits(v: &[bf16]) -> Vec<u16> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Panics at the first element where `a` and `b` differ, naming it.
    fn same<T: PartialEq + std::fmt::Debug>(a: &[T], b: &[T], what: &str) {
        assert_eq!(a.len(), b.len(), "{what}: lengths");
        if let Some(i) = (0..a.len()).find(|&i| a[i] != b[i]) {
            panic!("{what}: element {i} is {:?}, expected {:?}", a[i], b[i]);
        }
    }

    /// The fused bf16 passes give bit for bit what rounding around the f32 kernels
    /// gives, on both kernels (AVX-512 where the CPU has it, on one thread and two;
    /// portable), over several blocks and a width that does not divide a block.
    #[test]
    fn fused_bf16_gelu_matches_rounding_around_the_f32_kernels() {
        let (rows, width) = if cfg!(miri) { (40, 12) } else { (3000, 12) };
        let n = rows * width;
        let (pre, dh) = (values(n, 1), values(n, 2));
        // `portable_only` holds on its own thread: the portable kernels run on one.
        // Under Miri every case runs the portable kernels: one thread (a task of several
        // blocks and a short last one) and two (one block a task, at once).
        let cases: &[(usize, bool)] = match cfg!(miri) {
            true => &[(1, false), (2, false)],
            false => &[(1, false), (2, false), (1, true)],
        };
        for &(threads, portable) in cases {
            {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let run = || {
                    let go = || {
                        let (p, h) = gelu_forward_bf16(&pre).unwrap();
                        let mut rounded = pre.clone();
                        f32::round_halve(&mut rounded);
                        same(&bits(&p), &bits(&to_bf16_vec(&rounded)), "pre");
                        let h_ref = gelu_forward(&rounded).unwrap();
                        same(&bits(&h), &bits(&to_bf16_vec(&h_ref)), "gelu");

                        let (d, sums) = gelu_backward_bf16(&p, &dh, Some(width)).unwrap();
                        let d_ref = gelu_backward(&widen(&p), &dh).unwrap();
                        same(&bits(&d), &bits(&to_bf16_vec(&d_ref)), "gradient");
                        let f32_bits =
                            |v: Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        same(
                            &f32_bits(sums.unwrap()),
                            &f32_bits(column_sums(&d_ref, width)),
                            "column sums",
                        );
                        let (d2, none) = gelu_backward_bf16(&p, &dh, None).unwrap();
                        same(&bits(&d2), &bits(&d), "gradient without sums");
                        assert!(none.is_none());
                    };
                    match portable {
                        true => kernel::portable_only(go),
                        false => go(),
                    }
                };
                pool.install(run);
            }
        }
    }

    #[test]
    fn fused_bf16_gelu_backward_refuses_mismatched_inputs() {
        let p = to_bf16_vec(&values(24, 3));
        let e = gelu_backward_bf16(&p, &values(23, 4), None).unwrap_err();
        assert!(e.to_string().contains("23 gradients for 24 inputs"), "{e}");
        let e = gelu_backward_bf16(&p, &values(24, 4), Some(5)).unwrap_err();
        assert!(e.to_string().contains("not rows of 5"), "{e}");
    }
}
