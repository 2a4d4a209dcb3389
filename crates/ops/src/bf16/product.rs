//! What the fused ops hand the bf16 products: their operands as they hold them
//! ([`Held`], [`HeldMat`]: their own element type, or bf16 rounded once already) and,
//! per element type, what happens at `Precision::Bf16` ([`Bf16Product`]: f32 multiplies
//! through [`super::gemm`] and keeps bf16; f64 never runs at bf16).

use std::borrow::Cow;
use std::mem::MaybeUninit;

use candle_core::{CpuStorage, WithDType};
use half::bf16;

use super::{gemm_bias, round_and_halve, to_bf16_vec, widen, Bf16Kernel};
use crate::kernel::{Dst, Mat};
#[cfg(doc)]
use crate::Precision;

/// Rows of an operand as a fused op holds them: in its own element type, or as bf16
/// values rounded once already (at [`Precision::Bf16`], an operand that two products
/// read, or one kept as bf16 for the backward), which the products pack by copying.
#[derive(Clone, Copy)]
pub(crate) enum Held<'a, T> {
    Full(&'a [T]),
    Half(&'a [bf16]),
}

impl<'a, T> Held<'a, T> {
    /// `half` when there is one, else `full`.
    pub(crate) fn of(full: &'a [T], half: Option<&'a [bf16]>) -> Self {
        match half {
            Some(h) => Held::Half(h),
            None => Held::Full(full),
        }
    }

    /// `half` (this operand rounded once) when there is one, else this.
    pub(crate) fn or_half(self, half: Option<&'a [bf16]>) -> Self {
        match half {
            Some(h) => Held::Half(h),
            None => self,
        }
    }

    pub(crate) fn len(&self) -> usize {
        match self {
            Held::Full(x) => x.len(),
            Held::Half(x) => x.len(),
        }
    }

    /// As a row-major matrix of row stride `ld`.
    pub(crate) fn rows(self, ld: usize) -> HeldMat<'a, T> {
        match self {
            Held::Full(x) => HeldMat::Full(Mat::rows(x, ld)),
            Held::Half(x) => HeldMat::Half(Mat::rows(x, ld)),
        }
    }
}

/// A matrix operand of [`crate::linear::product`]: see [`Held`].
#[derive(Clone, Copy)]
pub(crate) enum HeldMat<'a, T> {
    Full(Mat<'a, T>),
    Half(Mat<'a, bf16>),
}

impl<T> HeldMat<'_, T> {
    /// The transpose (no copy).
    pub(crate) fn t(self) -> Self {
        match self {
            HeldMat::Full(m) => HeldMat::Full(m.t()),
            HeldMat::Half(m) => HeldMat::Half(m.t()),
        }
    }
}

impl<'a, T> From<Mat<'a, T>> for HeldMat<'a, T> {
    fn from(m: Mat<'a, T>) -> Self {
        HeldMat::Full(m)
    }
}

/// What the fused ops do at [`Precision::Bf16`], for each of their element types: f32
/// rounds the operands of its products to bf16 as it packs them (or takes them rounded
/// already, [`Held::Half`]) and sums in f32 (on [`Bf16Kernel::best`]), and keeps its
/// saved activations as bf16. f64 never runs at bf16 (the ops refuse bf16 precision for
/// anything but f32): its products stay f64, what it keeps stays f64, and it never
/// holds bf16 operands.
pub(crate) trait Bf16Product: Sized + Copy {
    #[allow(clippy::too_many_arguments)]
    fn product_bf16(
        m: usize,
        n: usize,
        k: usize,
        dst: Dst<Self>,
        ld: usize,
        a: HeldMat<Self>,
        b: HeldMat<Self>,
    );

    /// `dst = bias + a · b` (`dst` `m × n`, row stride `n`), bf16 products adding the
    /// bias block by block ([`gemm_bias`]); whether it did (f32), or left `dst` alone
    /// (f64, which never runs at bf16).
    #[allow(clippy::too_many_arguments)]
    fn product_bf16_bias(
        m: usize,
        n: usize,
        k: usize,
        dst: &mut [MaybeUninit<Self>],
        a: HeldMat<Self>,
        b: HeldMat<Self>,
        bias: &[Self],
    ) -> bool;

    /// `x` rounded to bf16 once, for the products that read it at [`Precision::Bf16`]
    /// (f32); `None` for f64, whose products read it as it is.
    fn halve(x: &[Self]) -> Option<Vec<bf16>>;

    /// `x` rounded to bf16 in place and [`Bf16Product::halve`], in one pass (f32);
    /// `None`, `x` left alone, for f64.
    fn round_halve(x: &mut [Self]) -> Option<Vec<bf16>>;

    /// What [`keep`] made, back in this type (bf16 widened, exactly).
    fn kept(s: &CpuStorage) -> candle_core::Result<Cow<'_, [Self]>>;

    /// What [`keep`] made, as the products read it (bf16 not widened).
    fn held(s: &CpuStorage) -> candle_core::Result<Held<'_, Self>>;

    /// bf16 values (a bf16 activation) widened to this type, exactly (f32); f64 never
    /// meets bf16 activations and refuses.
    fn widen_half(x: &[bf16]) -> candle_core::Result<Vec<Self>>;
}

impl Bf16Product for f32 {
    fn product_bf16(
        m: usize,
        n: usize,
        k: usize,
        dst: Dst<f32>,
        ld: usize,
        a: HeldMat<f32>,
        b: HeldMat<f32>,
    ) {
        gemm_held(m, n, k, dst, ld, a, b, None)
    }

    fn product_bf16_bias(
        m: usize,
        n: usize,
        k: usize,
        dst: &mut [MaybeUninit<f32>],
        a: HeldMat<f32>,
        b: HeldMat<f32>,
        bias: &[f32],
    ) -> bool {
        gemm_held(m, n, k, Dst::Uninit(dst), n, a, b, Some(bias));
        true
    }

    fn halve(x: &[f32]) -> Option<Vec<bf16>> {
        Some(to_bf16_vec(x))
    }

    fn round_halve(x: &mut [f32]) -> Option<Vec<bf16>> {
        Some(round_and_halve(x))
    }

    fn kept(s: &CpuStorage) -> candle_core::Result<Cow<'_, [f32]>> {
        Ok(match s {
            CpuStorage::BF16(v) => Cow::Owned(widen(v)),
            s => Cow::Borrowed(s.as_slice::<f32>()?),
        })
    }

    fn held(s: &CpuStorage) -> candle_core::Result<Held<'_, f32>> {
        Ok(match s {
            CpuStorage::BF16(v) => Held::Half(v),
            s => Held::Full(s.as_slice::<f32>()?),
        })
    }

    fn widen_half(x: &[bf16]) -> candle_core::Result<Vec<f32>> {
        Ok(widen(x))
    }
}

impl Bf16Product for f64 {
    fn product_bf16(
        m: usize,
        n: usize,
        k: usize,
        dst: Dst<f64>,
        ld: usize,
        a: HeldMat<f64>,
        b: HeldMat<f64>,
    ) {
        match (a, b) {
            (HeldMat::Full(a), HeldMat::Full(b)) => {
                crate::kernel::matmul(m, n, k, dst, ld, a, b, true)
            }
            _ => unreachable!("f64 operands are never held as bf16 (`halve` gives none)"),
        }
    }

    fn product_bf16_bias(
        _: usize,
        _: usize,
        _: usize,
        _: &mut [MaybeUninit<f64>],
        _: HeldMat<f64>,
        _: HeldMat<f64>,
        _: &[f64],
    ) -> bool {
        false
    }

    fn halve(_: &[f64]) -> Option<Vec<bf16>> {
        None
    }

    fn round_halve(_: &mut [f64]) -> Option<Vec<bf16>> {
        None
    }

    fn kept(s: &CpuStorage) -> candle_core::Result<Cow<'_, [f64]>> {
        Ok(Cow::Borrowed(s.as_slice::<f64>()?))
    }

    fn held(s: &CpuStorage) -> candle_core::Result<Held<'_, f64>> {
        Ok(Held::Full(s.as_slice::<f64>()?))
    }

    fn widen_half(_: &[bf16]) -> candle_core::Result<Vec<f64>> {
        candle_core::bail!("bf16 activations are computed in f32, not f64")
    }
}

/// [`gemm_bias`] on [`Bf16Kernel::best`] for operands as the ops hold them.
#[allow(clippy::too_many_arguments)]
fn gemm_held(
    m: usize,
    n: usize,
    k: usize,
    dst: Dst<f32>,
    ld: usize,
    a: HeldMat<f32>,
    b: HeldMat<f32>,
    bias: Option<&[f32]>,
) {
    let kernel = Bf16Kernel::best();
    match (a, b) {
        (HeldMat::Full(a), HeldMat::Full(b)) => gemm_bias(kernel, m, n, k, dst, ld, a, b, bias),
        (HeldMat::Full(a), HeldMat::Half(b)) => gemm_bias(kernel, m, n, k, dst, ld, a, b, bias),
        (HeldMat::Half(a), HeldMat::Full(b)) => gemm_bias(kernel, m, n, k, dst, ld, a, b, bias),
        (HeldMat::Half(a), HeldMat::Half(b)) => gemm_bias(kernel, m, n, k, dst, ld, a, b, bias),
    }
}

/// What an op keeps of `x` for its backward: `half`, its values rounded to bf16, when
/// there is one ([`Precision::Bf16`]), else `x` itself.
pub(crate) fn keep<T: WithDType>(x: Vec<T>, half: Option<Vec<bf16>>) -> CpuStorage {
    match half {
        Some(h) => CpuStorage::BF16(h),
        None => T::to_cpu_storage_owned(x),
    }
}
