//! The machinery under the fused ops: element types, raw buffers, the matrix product,
//! vectorised math and parallel loops.
//!
//! * [`Float`]: `f32` or `f64`. `f32` uses fast, vectorisable `exp` and `tanh`
//!   (polynomial, within a few ulp); `f64` uses the standard library's exact functions.
//! * [`simd!`] compiles a kernel twice, once for AVX-512 (chosen at run time when the CPU
//!   has it) and once for the baseline target, so the hot loops vectorise 16 lanes wide
//!   without asking the whole build for `-C target-cpu=native`.
//! * [`matmul`]: one product on raw slices with the `gemm` crate (AVX-512 through its
//!   `x86-v4` feature), writing or accumulating into its output, never zero-filling it.
//! * Buffers come from [`uninit`]: no zero-fill, since every kernel writes every element.

use std::sync::OnceLock;

use candle_core::backend::BackendDevice;
use candle_core::cpu_backend::CpuDevice;
use candle_core::{
    bail, CpuStorage, Layout, Result, Shape, Storage, StorageRef, Tensor, WithDType,
};

/// Whether this CPU runs the AVX-512 variants of the kernels.
pub(crate) fn avx512() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512dq")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// Defines a kernel generic over [`Float`] that runs an AVX-512 build of its body when the
/// CPU supports it. Everything the body calls must be `#[inline(always)]` to share it.
macro_rules! simd {
    ($(#[$m:meta])* $vis:vis fn $name:ident<$T:ident>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$m])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<$T: $crate::kernel::Float>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body<$T: $crate::kernel::Float>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn v4<$T: $crate::kernel::Float>($($arg: $ty),*) $(-> $ret)? {
                body::<$T>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::kernel::avx512() {
                // SAFETY: the CPU supports every feature `v4` is compiled for.
                return unsafe { v4::<$T>($($arg),*) };
            }
            body::<$T>($($arg),*)
        }
    };
}
pub(crate) use simd;

/// The float types the fused kernels support.
pub(crate) trait Float: WithDType {
    const NEG_INF: Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn sqrt(self) -> Self;
    fn tanh(self) -> Self;
    fn maxf(self, other: Self) -> Self;
}

impl Float for f32 {
    const NEG_INF: f32 = f32::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> f32 {
        exp_f32(self)
    }
    #[inline(always)]
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    #[inline(always)]
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn tanh(self) -> f32 {
        tanh_f32(self)
    }
    #[inline(always)]
    fn maxf(self, other: f32) -> f32 {
        if self > other {
            self
        } else {
            other
        }
    }
}

impl Float for f64 {
    const NEG_INF: f64 = f64::NEG_INFINITY;
    #[inline(always)]
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    #[inline(always)]
    fn ln(self) -> f64 {
        f64::ln(self)
    }
    #[inline(always)]
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn tanh(self) -> f64 {
        f64::tanh(self)
    }
    #[inline(always)]
    fn maxf(self, other: f64) -> f64 {
        if self > other {
            self
        } else {
            other
        }
    }
}

/// `eˣ` in f32 without a libm call (so loops of it vectorise): Cody–Waite range reduction
/// and the Cephes polynomial, within 2 ulp for arguments in `[-87.3, 88.0]`; below that
/// range it returns the smallest normal (≈1.2e-38) instead of 0 or a denormal, above it
/// `e⁸⁸` (every caller passes arguments ≤ 0: shifted scores, `−2|x|`).
#[inline(always)]
pub(crate) fn exp_f32(x: f32) -> f32 {
    let x = x.clamp(-87.336_54, 88.0);
    // Round to nearest with the 1.5·2²³ trick (vectorises, unlike `round`).
    let kf = (x * std::f32::consts::LOG2_E + 12_582_912.0) - 12_582_912.0;
    let r = x - kf * 0.693_359_4 + kf * 2.121_944_4e-4;
    let mut p = 1.987_569_1e-4f32;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 0.5;
    let p = p * r * r + r + 1.0;
    // 2^kf (kf in [-126, 127]) from the bits of `kf + 1.5·2²³ + 127`, whose low mantissa
    // bits hold `kf + 127`: no float-to-int conversion, so the loop vectorises.
    p * f32::from_bits((kf + 12_583_039.0).to_bits() << 23)
}

/// `tanh(x)` in f32 from [`exp_f32`]: `(1 − e)/(1 + e)` with `e = exp(−2|x|)`, sign
/// restored. Absolute error below 1e-7.
#[inline(always)]
pub(crate) fn tanh_f32(x: f32) -> f32 {
    let e = exp_f32(-2.0 * x.abs());
    let t = (1.0 - e) / (1.0 + e);
    if x < 0.0 {
        -t
    } else {
        t
    }
}

/// `Σ xᵢ` with 16 independent partial sums, so the loop vectorises.
#[inline(always)]
pub(crate) fn sum<T: Float>(x: &[T]) -> T {
    let mut acc = [T::zero(); 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            acc[i] += c[i];
        }
    }
    let mut s = T::zero();
    for &v in chunks.remainder() {
        s += v;
    }
    for a in acc {
        s += a;
    }
    s
}

/// `Σ xᵢ·yᵢ`, vectorised like [`sum`].
#[inline(always)]
pub(crate) fn dot<T: Float>(x: &[T], y: &[T]) -> T {
    let mut acc = [T::zero(); 16];
    let n = x.len().min(y.len());
    let (x, y) = (&x[..n], &y[..n]);
    let mut cx = x.chunks_exact(16);
    let mut cy = y.chunks_exact(16);
    for (a, b) in (&mut cx).zip(&mut cy) {
        for i in 0..16 {
            acc[i] += a[i] * b[i];
        }
    }
    let mut s = T::zero();
    for (&a, &b) in cx.remainder().iter().zip(cy.remainder()) {
        s += a * b;
    }
    for a in acc {
        s += a;
    }
    s
}

/// `max xᵢ` (−∞ for an empty slice), vectorised like [`sum`].
#[inline(always)]
pub(crate) fn max<T: Float>(x: &[T]) -> T {
    let mut acc = [T::NEG_INF; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for i in 0..16 {
            acc[i] = acc[i].maxf(c[i]);
        }
    }
    let mut m = T::NEG_INF;
    for &v in chunks.remainder() {
        m = m.maxf(v);
    }
    for a in acc {
        m = m.maxf(a);
    }
    m
}

/// A buffer of `n` elements whose contents are unspecified: the caller writes every
/// element before anything reads it.
pub(crate) fn uninit<T: Float>(n: usize) -> Result<Vec<T>> {
    // SAFETY: f32 and f64 have no invalid bit patterns, and every caller overwrites the
    // whole buffer before reading it.
    let s = unsafe { CpuDevice.alloc_uninit(&Shape::from(n), T::DTYPE)? };
    T::cpu_storage_data(s)
}

/// The elements of a contiguous CPU storage, seen through `l`.
pub(crate) fn slice<'a, T: Float>(s: &'a CpuStorage, l: &Layout, op: &str) -> Result<&'a [T]> {
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!(
            "{op}: expected a contiguous input, got strides {:?}",
            l.stride()
        )
    };
    Ok(&T::cpu_storage_as_slice(s)?[a..b])
}

/// `x` as `&[f32]` when `T` is f32 and the CPU runs the AVX-512 kernels of
/// [`crate::avx512`]; `None` otherwise (the caller takes its portable path).
pub(crate) fn avx512_f32<T: Float>(x: &[T]) -> Option<&[f32]> {
    (cfg!(target_arch = "x86_64") && T::DTYPE == candle_core::DType::F32 && avx512())
        // SAFETY: T is f32 (its dtype says so): the cast is the identity.
        .then(|| unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) })
}

/// [`avx512_f32`] for a mutable slice.
pub(crate) fn avx512_f32_mut<T: Float>(x: &mut [T]) -> Option<&mut [f32]> {
    (cfg!(target_arch = "x86_64") && T::DTYPE == candle_core::DType::F32 && avx512())
        // SAFETY: as above.
        .then(|| unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<f32>(), x.len()) })
}

/// A read-locked view of a contiguous CPU tensor, for backward passes.
pub(crate) struct View<'a> {
    guard: StorageRef<'a>,
    lo: usize,
    hi: usize,
}

pub(crate) fn view<'a>(t: &'a Tensor, op: &str) -> Result<View<'a>> {
    let (guard, l) = t.storage_and_layout();
    let Some((lo, hi)) = l.contiguous_offsets() else {
        bail!(
            "{op}: expected a contiguous tensor, got strides {:?}",
            l.stride()
        )
    };
    Ok(View { guard, lo, hi })
}

impl View<'_> {
    pub(crate) fn get<T: Float>(&self) -> Result<&[T]> {
        match &*self.guard {
            Storage::Cpu(c) => Ok(&T::cpu_storage_as_slice(c)?[self.lo..self.hi]),
            _ => bail!("switchyard-ops: only CPU tensors are supported"),
        }
    }
}

/// A tensor owning `v`.
pub(crate) fn tensor<T: Float>(v: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
    Tensor::from_vec(v, shape.into(), &candle_core::Device::Cpu)
}

/// A matrix operand of [`matmul`]: element `(i, j)` is at `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major matrix with row stride `ld`.
    pub(crate) fn rows(data: &'a [T], ld: usize) -> Self {
        Mat {
            data,
            rs: ld,
            cs: 1,
        }
    }
    /// The transpose (no copy).
    pub(crate) fn t(self) -> Self {
        Mat {
            data: self.data,
            rs: self.cs,
            cs: self.rs,
        }
    }
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// f32 products of at most this many multiply-adds whose `b` has unit column stride go
/// to [`crate::sgemm::small_sgemm`] (no packing) on AVX-512 CPUs: the attention's.
const SMALL_MAX: usize = 1 << 19;

/// Products below this many multiply-adds run on one thread.
const PARALLEL_MIN: usize = 1 << 21;

/// `dst[m×n] = (accumulate ? dst : 0) + a[m×k] · b[k×n]`, with `dst` row-major of row
/// stride `ld`. On more than one thread of the current rayon pool, large products are
/// split over them when `parallel` is set.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [T],
    ld: usize,
    accumulate: bool,
    a: Mat<T>,
    b: Mat<T>,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        a.fits(m, k) && b.fits(k, n) && (m - 1) * ld + n <= dst.len() && n <= ld,
        "matmul: operands out of bounds"
    );
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                dst[r * ld..r * ld + n].fill(T::zero());
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if b.cs == 1 && m * n * k <= SMALL_MAX {
        if let (Some(ad), Some(bd), Some(d)) =
            (avx512_f32(a.data), avx512_f32(b.data), avx512_f32_mut(dst))
        {
            let (rs, cs) = (a.rs, a.cs);
            let a = Mat { data: ad, rs, cs };
            let b = Mat::rows(bd, b.rs);
            // SAFETY: `avx512_f32` only answers on CPUs with AVX-512; the bounds were
            // checked above and `dst` is exclusively borrowed.
            unsafe { crate::sgemm::small_sgemm(m, n, k, d.as_mut_ptr(), ld, accumulate, a, b) };
            return;
        }
    }
    let threads = rayon::current_num_threads();
    let par = if parallel && threads > 1 && m * n * k >= PARALLEL_MIN {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the bounds of every operand were checked above; `dst` is exclusively
    // borrowed and does not alias `a` or `b` (they are shared borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            ld as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            par,
        )
    }
}

/// How many rows each parallel task takes so that `rows` spread over the pool's threads
/// (one task per thread on one thread: no splitting).
pub(crate) fn rows_per_task(rows: usize) -> usize {
    let t = rayon::current_num_threads();
    if t <= 1 {
        rows.max(1)
    } else {
        rows.div_ceil(4 * t).max(1)
    }
}

/// A raw pointer that parallel tasks share to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub *mut T);
impl<T> SharedMut<T> {
    /// The pointer (a method, so closures capture the whole `Send + Sync` wrapper).
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }
}

// SAFETY: every user writes disjoint elements from each task.
unsafe impl<T> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for SharedMut<T> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fast_exp_and_tanh_are_accurate() {
        let mut worst_exp = 0.0f64;
        let mut worst_tanh = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let e = (exp_f32(x) as f64 - (x as f64).exp()).abs() / (x as f64).exp();
            worst_exp = worst_exp.max(e);
            x += 0.0137;
        }
        let mut x = -12.0f32;
        while x < 12.0 {
            let e = (tanh_f32(x) as f64 - (x as f64).tanh()).abs();
            worst_tanh = worst_tanh.max(e);
            x += 0.00113;
        }
        assert!(worst_exp < 4e-7, "exp relative error {worst_exp:e}");
        assert!(worst_tanh < 2e-7, "tanh absolute error {worst_tanh:e}");
        let tiny = exp_f32(-1000.0);
        assert!(tiny > 0.0 && tiny < 1.2e-38, "{tiny:e}");
        assert!(exp_f32(88.7).is_finite());
    }

    #[test]
    fn reductions_match_plain_loops() {
        let v: Vec<f64> = (0..37).map(|i| (i as f64 * 0.7).sin()).collect();
        let w: Vec<f64> = (0..37).map(|i| (i as f64 * 0.3).cos()).collect();
        assert!((sum(&v) - v.iter().sum::<f64>()).abs() < 1e-12);
        let d: f64 = v.iter().zip(&w).map(|(a, b)| a * b).sum();
        assert!((dot(&v, &w) - d).abs() < 1e-12);
        assert_eq!(max(&v), v.iter().cloned().fold(f64::NEG_INFINITY, f64::max));
    }
}
