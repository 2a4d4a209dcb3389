//! The machinery under the fused ops: element types, raw buffers, the matrix product,
//! vectorised math and parallel loops.
//!
//! * [`Float`]: `f32` or `f64`. `f32` uses fast, vectorisable `exp` and `tanh`
//!   (polynomial, within a few ulp); `f64` uses the standard library's exact functions.
//! * [`simd!`] compiles a kernel three times, for AVX-512, for AVX2 and FMA (each chosen
//!   at run time when the CPU has it) and for the baseline target, so the hot loops
//!   vectorise 16 or 8 lanes wide without asking the whole build for
//!   `-C target-cpu=native`.
//! * [`matmul`]: one product on raw slices with the `gemm` crate (AVX-512 through its
//!   `x86-v4` feature), writing or accumulating into its output, never zero-filling it.
//! * Output buffers are [`Uninit`]: no zero-fill. A kernel writes them as
//!   `MaybeUninit<T>` and the caller turns the buffer into a `Vec<T>` once every element
//!   is written ([`Uninit::assume_init`], an `unsafe` step with its reason beside it).

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use candle_core::{
    bail, CpuStorage, Layout, Result, Shape, Storage, StorageRef, Tensor, WithDType,
};

/// Whether this CPU runs the AVX-512 variants of the kernels (never under Miri, which
/// interprets the portable paths only; and never on a thread inside [`portable_only`] or
/// [`at_most_avx2`]).
pub(crate) fn avx512() -> bool {
    #[cfg(test)]
    if CEILING.with(|c| c.get()) < Ceiling::Best {
        return false;
    }
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        {
            std::is_x86_feature_detected!("avx512f")
                && std::is_x86_feature_detected!("avx512vl")
                && std::is_x86_feature_detected!("avx512dq")
                && std::is_x86_feature_detected!("avx512bw")
                && std::is_x86_feature_detected!("avx2")
                && std::is_x86_feature_detected!("fma")
        }
        #[cfg(any(not(target_arch = "x86_64"), miri))]
        {
            false
        }
    })
}

/// Whether this CPU has AVX2 and FMA for the kernels that have such a build: the
/// [`simd!`] kernels' (on CPUs without AVX-512, which run theirs) and the small products'
/// ([`small_products`]). True on AVX-512 CPUs too (ask [`avx512`] first); never under
/// Miri, and never inside [`portable_only`].
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn avx2() -> bool {
    #[cfg(test)]
    if CEILING.with(|c| c.get()) < Ceiling::Avx2 {
        return false;
    }
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        {
            std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")
        }
        #[cfg(any(not(target_arch = "x86_64"), miri))]
        {
            false
        }
    })
}

/// The fastest build a test lets this thread's kernels run (the CPU may allow less).
#[cfg(test)]
#[derive(Clone, Copy, PartialEq, PartialOrd)]
enum Ceiling {
    Portable,
    Avx2,
    Best,
}

#[cfg(test)]
thread_local! {
    static CEILING: std::cell::Cell<Ceiling> = const { std::cell::Cell::new(Ceiling::Best) };
}

/// Runs `f` under ceiling `c` on this thread, then puts back the one before (also when
/// `f` panics: a rayon thread goes on to other tests' tasks).
#[cfg(test)]
fn with_ceiling<R>(c: Ceiling, f: impl FnOnce() -> R) -> R {
    struct Restore(Ceiling);
    impl Drop for Restore {
        fn drop(&mut self) {
            CEILING.with(|p| p.set(self.0));
        }
    }
    let _restore = Restore(CEILING.with(|p| p.replace(c)));
    f()
}

/// The calling thread's kernel ceiling, carried to the tasks it hands to rayon's threads
/// ([`Inherited::run`]), so that a test's [`portable_only`] or [`at_most_avx2`] covers a
/// parallel op end to end. Outside tests it holds nothing and runs the task as it is.
#[derive(Clone, Copy)]
pub(crate) struct Inherited {
    #[cfg(test)]
    ceiling: Ceiling,
}

impl Inherited {
    /// This thread's ceiling.
    pub(crate) fn here() -> Self {
        Inherited {
            #[cfg(test)]
            ceiling: CEILING.with(|c| c.get()),
        }
    }

    /// Runs `f` (a task on any thread) under the ceiling taken by [`Inherited::here`].
    #[inline(always)]
    pub(crate) fn run<R>(self, f: impl FnOnce() -> R) -> R {
        #[cfg(test)]
        return with_ceiling(self.ceiling, f);
        #[cfg(not(test))]
        f()
    }
}

/// Runs `f` with the AVX-512 and AVX2 kernels switched off on this thread (and on the
/// tasks it hands to rayon through [`Inherited`]), so that a test can run a kernel's
/// portable twin on any CPU.
#[cfg(test)]
pub(crate) fn portable_only<R>(f: impl FnOnce() -> R) -> R {
    with_ceiling(Ceiling::Portable, f)
}

/// Runs `f` with the AVX-512 kernels switched off on this thread (and on the tasks it
/// hands to rayon through [`Inherited`]): the AVX2 builds of the [`simd!`] kernels and
/// the AVX2 small products run where the CPU has AVX2 and FMA.
#[cfg(test)]
pub(crate) fn at_most_avx2<R>(f: impl FnOnce() -> R) -> R {
    with_ceiling(Ceiling::Avx2, f)
}

/// Defines a kernel generic over [`Float`] that runs an AVX-512 build of its body when the
/// CPU supports it, else an AVX2 and FMA build (8 lanes: most x86 CPUs without AVX-512,
/// such as AMD's before Zen 4), else the baseline one. Everything the body calls must be
/// `#[inline(always)]` to share it. The builds round alike: element-wise code is not
/// reassociated, and an explicit `mul_add` is one rounding with or without FMA.
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
            #[target_feature(enable = "avx2,fma")]
            #[allow(clippy::too_many_arguments)]
            unsafe fn v3<$T: $crate::kernel::Float>($($arg: $ty),*) $(-> $ret)? {
                body::<$T>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::kernel::avx512() {
                // SAFETY: the CPU supports every feature `v4` is compiled for.
                return unsafe { v4::<$T>($($arg),*) };
            }
            #[cfg(target_arch = "x86_64")]
            if $crate::kernel::avx2() {
                // SAFETY: the CPU supports every feature `v3` is compiled for.
                return unsafe { v3::<$T>($($arg),*) };
            }
            body::<$T>($($arg),*)
        }
    };
}
pub(crate) use simd;

/// The float types the fused kernels support.
pub(crate) trait Float: WithDType + crate::bf16::Bf16Product {
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

/// `Σ (xᵢ − c)²`, vectorised like [`sum`] (the same sums as `dot(y, y)` for `y = x − c`).
#[inline(always)]
pub(crate) fn sum_sq_dev<T: Float>(x: &[T], c: T) -> T {
    let mut acc = [T::zero(); 16];
    let mut chunks = x.chunks_exact(16);
    for ch in &mut chunks {
        for i in 0..16 {
            let d = ch[i] - c;
            acc[i] += d * d;
        }
    }
    let mut s = T::zero();
    for &v in chunks.remainder() {
        let d = v - c;
        s += d * d;
    }
    for a in acc {
        s += a;
    }
    s
}

/// An output buffer of `n` elements that starts uninitialised (no zero-fill): kernels
/// write it through [`Uninit::as_mut`] (`MaybeUninit`) or [`Uninit::as_mut_ptr`], and
/// [`Uninit::assume_init`] turns it into a `Vec` once every element is written.
pub(crate) struct Uninit<T> {
    /// Capacity `n`, length 0 until [`Uninit::assume_init`].
    v: Vec<T>,
    n: usize,
}

impl<T: WithDType> Uninit<T> {
    /// Room for `n` elements; an error, not an abort, when it cannot be allocated.
    pub(crate) fn new(n: usize) -> Result<Self> {
        let mut v = Vec::new();
        if let Err(e) = v.try_reserve_exact(n) {
            bail!(
                "switchyard-ops: cannot allocate {n} elements of {:?}: {e}",
                T::DTYPE
            )
        }
        Ok(Uninit { v, n })
    }

    /// The `n` elements, for writing.
    pub(crate) fn as_mut(&mut self) -> &mut [MaybeUninit<T>] {
        &mut self.v.spare_capacity_mut()[..self.n]
    }

    /// The first element, for tasks that write disjoint parts of the buffer at once
    /// (through [`SharedMut`]); valid for `n` elements while `self` lives.
    pub(crate) fn as_mut_ptr(&mut self) -> *mut T {
        self.v.as_mut_ptr()
    }

    /// The written buffer.
    ///
    /// # Safety
    /// Every one of the `n` elements has been written.
    pub(crate) unsafe fn assume_init(mut self) -> Vec<T> {
        // SAFETY: the capacity is `n` and the caller guarantees all `n` are initialised.
        unsafe { self.v.set_len(self.n) };
        self.v
    }
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
    as_f32(x).filter(|_| cfg!(target_arch = "x86_64") && avx512())
}

/// Whether this CPU has a register-tile kernel for small f32 products and the attention's
/// transposes: AVX-512's ([`crate::sgemm`], chosen first) or AVX2's ([`crate::avx2`]).
/// [`matmul`], `product_path` and the attention's `transposed` decide alike by it.
pub(crate) fn small_products() -> bool {
    cfg!(target_arch = "x86_64") && (avx512() || avx2())
}

/// `x` as f32, when `T` is f32 (the bf16 paths of the fused ops, which run on f32 only).
pub(crate) fn as_f32<T: Float>(x: &[T]) -> Option<&[f32]> {
    (T::DTYPE == candle_core::DType::F32)
        // SAFETY: T is f32 (its dtype says so): the cast is the identity.
        .then(|| unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<f32>(), x.len()) })
}

/// [`as_f32`] for a mutable slice.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn as_f32_mut<T: Float>(x: &mut [T]) -> Option<&mut [f32]> {
    (T::DTYPE == candle_core::DType::F32)
        // SAFETY: T is f32 (its dtype says so): the cast is the identity.
        .then(|| unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<f32>(), x.len()) })
}

/// [`avx512_f32`] for a mutable slice.
pub(crate) fn avx512_f32_mut<T: Float>(x: &mut [T]) -> Option<&mut [f32]> {
    (cfg!(target_arch = "x86_64") && T::DTYPE == candle_core::DType::F32 && avx512())
        // SAFETY: as above.
        .then(|| unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<f32>(), x.len()) })
}

/// [`avx512_f32`] for an output slice that may be uninitialised.
pub(crate) fn avx512_f32_out<T: Float>(
    x: &mut [MaybeUninit<T>],
) -> Option<&mut [MaybeUninit<f32>]> {
    (cfg!(target_arch = "x86_64") && T::DTYPE == candle_core::DType::F32 && avx512())
        // SAFETY: T is f32, so `MaybeUninit<T>` is `MaybeUninit<f32>`.
        .then(|| unsafe {
            std::slice::from_raw_parts_mut(x.as_mut_ptr().cast::<MaybeUninit<f32>>(), x.len())
        })
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

    /// The elements as a fused op's products read them: bf16 (an activation at
    /// `Precision::Bf16`, [`crate::bf16`]'s `act`) as it is, else as `T`.
    pub(crate) fn held<T: Float>(&self) -> Result<crate::bf16::Held<'_, T>> {
        match &*self.guard {
            Storage::Cpu(CpuStorage::BF16(v)) => Ok(crate::bf16::Held::Half(&v[self.lo..self.hi])),
            _ => Ok(crate::bf16::Held::Full(self.get::<T>()?)),
        }
    }
}

/// A tensor owning `v`.
pub(crate) fn tensor<T: Float>(v: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
    Tensor::from_vec(v, shape.into(), &candle_core::Device::Cpu)
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
///
/// The contract of every user: each task writes only its own elements, through raw
/// pointers derived from this one (never through a `&mut` slice that could cover another
/// task's elements), and nothing reads the buffer until all tasks have finished.
#[derive(Clone, Copy)]
pub(crate) struct SharedMut<T>(pub *mut T);
impl<T> SharedMut<T> {
    /// The pointer (a method, so closures capture the whole `Send + Sync` wrapper).
    pub(crate) fn ptr(&self) -> *mut T {
        self.0
    }
}

// SAFETY: the pointer is only written through, at disjoint elements per task (the
// contract above), and `T` is plain data (f32 or f64), so moving it between threads
// cannot race.
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above: shared use only ever writes disjoint elements.
unsafe impl<T: Send> Sync for SharedMut<T> {}

/// `n` values in `[-scale, scale)` from a seeded generator (splitmix64), for tests.
#[cfg(test)]
pub(crate) fn test_data(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x2545_f491_4f6c_dd1d;
    (0..n)
        .map(|_| {
            state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = state;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            ((z >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect()
}

mod matmul;
#[cfg(test)]
mod tests;

pub use matmul::product_path;
pub(crate) use matmul::{matmul, matmul_raw, Dst, Mat, PARALLEL_MIN};
