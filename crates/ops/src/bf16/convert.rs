//! Conversions between f32 and bf16: round to nearest even without branches (so that
//! loops of it vectorise), and the element loops compiled by `simd!` (AVX-512 or AVX2
//! chosen at run time).

use std::mem::MaybeUninit;

use half::bf16;

use crate::kernel::simd;

/// An element a bf16 product reads: bf16 itself, or f32 rounded to the nearest bf16
/// (ties to even) as it is packed.
pub(crate) trait ToBf16: Copy + Send + Sync {
    fn bits(self) -> u16;
    /// `dst[i] = src[i].bits()` (vectorised for f32 on AVX-512 CPUs).
    fn row_bits(src: &[Self], dst: &mut [u16]) {
        dst.iter_mut().zip(src).for_each(|(d, s)| *d = s.bits());
    }
    /// The value itself, in f32 (exact).
    fn f32(self) -> f32;
    /// `x`'s bf16 bits, when it is bf16 already.
    fn as_bits(_x: &[Self]) -> Option<&[u16]> {
        None
    }
}

impl ToBf16 for bf16 {
    fn bits(self) -> u16 {
        self.to_bits()
    }
    fn as_bits(x: &[bf16]) -> Option<&[u16]> {
        // SAFETY: `half::bf16` is `#[repr(transparent)]` over its `u16` bits.
        Some(unsafe { std::slice::from_raw_parts(x.as_ptr().cast::<u16>(), x.len()) })
    }
    /// A copy; the packing's rows of 32 as one fixed-size move (no `memcpy` call).
    fn row_bits(src: &[bf16], dst: &mut [u16]) {
        let src = &Self::as_bits(src).expect("bf16 is its bits")[..dst.len()];
        match (
            <&mut [u16; 32]>::try_from(&mut *dst),
            <&[u16; 32]>::try_from(src),
        ) {
            (Ok(d), Ok(s)) => *d = *s,
            _ => dst.copy_from_slice(src),
        }
    }
    fn f32(self) -> f32 {
        self.to_f32()
    }
}

impl ToBf16 for f32 {
    fn bits(self) -> u16 {
        round_to_bf16(self)
    }
    fn row_bits(src: &[f32], dst: &mut [u16]) {
        round_row::<f32>(src, dst)
    }
    fn f32(self) -> f32 {
        self
    }
}

/// `x` rounded to the nearest bf16, ties to even (`half::bf16::from_f32`'s result,
/// tested), without branches so that loops over it vectorise: add `0x7fff` plus the
/// lowest kept bit and keep the high half; a NaN stays a (quiet) NaN.
#[inline]
pub(crate) fn round_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    let rounded = (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16;
    let nan = ((b >> 16) | 0x0040) as u16;
    if x.is_nan() {
        nan
    } else {
        rounded
    }
}

/// `x` rounded to bf16, element by element ([`round_to_bf16`]; vectorised on AVX-512).
pub(crate) fn to_bf16_vec(x: &[f32]) -> Vec<bf16> {
    rounded::<f32>(x)
}

/// `x` widened to f32 (exact; vectorised on AVX-512).
pub(crate) fn widen(x: &[bf16]) -> Vec<f32> {
    widened::<f32>(x)
}

// The element loops of the conversions, compiled by `simd!` (AVX-512 or AVX2 chosen at
// run time);
// `T` is unused (the `simd!` macro's functions are generic over the float type).
simd! {
    /// `dst[i] = round_to_bf16(src[i])`, sixteen at a time (one AVX-512 vector: the
    /// packing calls it on rows of 32).
    fn round_row<T>(src: &[f32], dst: &mut [u16]) {
        let mut d16 = dst.chunks_exact_mut(16);
        let mut s16 = src.chunks_exact(16);
        for (d, s) in (&mut d16).zip(&mut s16) {
            for i in 0..16 {
                d[i] = round_to_bf16(s[i]);
            }
        }
        let (d, s) = (d16.into_remainder(), s16.remainder());
        d.iter_mut().zip(s).for_each(|(d, &s)| *d = round_to_bf16(s));
    }
}

// Collected, not filled: no zeroing pass over a fresh buffer first.
simd! {
    /// `x` widened to f32 (exact).
    fn widened<T>(x: &[bf16]) -> Vec<f32> {
        x.iter()
            .map(|b| f32::from_bits((b.to_bits() as u32) << 16))
            .collect()
    }
}

simd! {
    /// `x` rounded to the nearest bf16.
    fn rounded<T>(x: &[f32]) -> Vec<bf16> {
        x.iter()
            .map(|&v| bf16::from_bits(round_to_bf16(v)))
            .collect()
    }
}

simd! {
    /// `dst[i] = src[i]` rounded to the nearest bf16, into a buffer being filled.
    pub(crate) fn round_into<T>(src: &[f32], dst: &mut [MaybeUninit<bf16>]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            d.write(bf16::from_bits(round_to_bf16(s)));
        }
    }
}

simd! {
    /// `dst[i] = src[i]` widened to f32 (exact).
    pub(crate) fn widen_into<T>(src: &[bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
}

simd! {
    /// `x` rounded to bf16 in place, and the bits of the rounded values into `dst`.
    pub(crate) fn round_both<T>(x: &mut [f32], dst: &mut [MaybeUninit<bf16>]) {
        for (v, d) in x.iter_mut().zip(dst.iter_mut()) {
            let b = round_to_bf16(*v);
            *v = f32::from_bits((b as u32) << 16);
            d.write(bf16::from_bits(b));
        }
    }
}

/// `x` rounded to bf16 in place, and the same values as bf16, in one pass.
pub(crate) fn round_and_halve(x: &mut [f32]) -> Vec<bf16> {
    let mut out = Vec::with_capacity(x.len());
    round_both::<f32>(x, &mut out.spare_capacity_mut()[..x.len()]);
    // SAFETY: `round_both` wrote all `x.len()` elements.
    unsafe { out.set_len(x.len()) };
    out
}
