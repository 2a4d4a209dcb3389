//! Hand-vectorised f32 kernels for AVX-512, for the element-wise loops where the compiler's
//! auto-vectorisation of [`crate::kernel::Float`] code leaves speed behind:
//!
//! * `exp` scales by `2ᵏ` with one `vscalefps` instead of building the exponent bits;
//! * `tanh` divides with `vrcp14ps` and one Newton step (a 16-lane `vdivps` costs as much
//!   as the rest of GELU together);
//! * tails are masked lanes, not scalar loops.
//!
//! Results agree with the portable kernels to a few ulp. The callers check
//! [`crate::kernel::avx512`] before calling in.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

const C: f32 = 0.797_884_6; // √(2/π)
const A: f32 = 0.044_715;

/// `eˣ` lane-wise, for `x ≤ 88`; below −87.3 the smallest normal (as `exp_f32`).
#[inline(always)]
unsafe fn exp(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(-87.336_54));
    let x = _mm512_min_ps(x, _mm512_set1_ps(88.0));
    let k = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let p = _mm512_fmadd_ps(
        _mm512_mul_ps(p, r),
        r,
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    _mm512_scalef_ps(p, k)
}

/// `1/d` lane-wise: `vrcp14ps` and one Newton step (relative error ≈ 2⁻²⁷).
#[inline(always)]
unsafe fn recip(d: __m512) -> __m512 {
    let r = _mm512_rcp14_ps(d);
    _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0)))
}

/// `tanh(y)` lane-wise: `(1 − e)/(1 + e)` with `e = exp(−2|y|)`, sign restored.
#[inline(always)]
unsafe fn tanh(y: __m512) -> __m512 {
    let sign = _mm512_set1_epi32(i32::MIN);
    let ay = _mm512_castsi512_ps(_mm512_andnot_si512(sign, _mm512_castps_si512(y)));
    let e = exp(_mm512_mul_ps(ay, _mm512_set1_ps(-2.0)));
    let one = _mm512_set1_ps(1.0);
    let t = _mm512_mul_ps(_mm512_sub_ps(one, e), recip(_mm512_add_ps(one, e)));
    let s = _mm512_and_si512(sign, _mm512_castps_si512(y));
    _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(t), s))
}

/// The mask of lanes `i..i+16` below `n`.
#[inline(always)]
fn tail(i: usize, n: usize) -> __mmask16 {
    let left = n - i;
    if left >= 16 {
        0xffff
    } else {
        ((1u32 << left) - 1) as __mmask16
    }
}

/// `y = gelu(x)` (tanh approximation) over the first `min(x.len(), y.len())` elements.
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
pub(crate) unsafe fn gelu(x: &[f32], y: &mut [MaybeUninit<f32>]) {
    let n = x.len().min(y.len());
    let yp = y.as_mut_ptr().cast::<f32>();
    let (c, a, half) = (_mm512_set1_ps(C), _mm512_set1_ps(A), _mm512_set1_ps(0.5));
    for i in (0..n).step_by(16) {
        let m = tail(i, n);
        let v = _mm512_maskz_loadu_ps(m, x.as_ptr().add(i));
        let v2 = _mm512_mul_ps(v, v);
        let inner = _mm512_mul_ps(
            _mm512_mul_ps(c, v),
            _mm512_fmadd_ps(a, v2, _mm512_set1_ps(1.0)),
        );
        let t = tanh(inner);
        let hv = _mm512_mul_ps(half, v);
        let out = _mm512_fmadd_ps(hv, t, hv);
        _mm512_mask_storeu_ps(yp.add(i), m, out);
    }
}

/// `dx = g · gelu′(x)` over the first `min` of the three lengths.
///
/// # Safety
/// The CPU must support AVX-512F and FMA.
#[target_feature(enable = "avx512f,fma")]
pub(crate) unsafe fn gelu_grad(x: &[f32], g: &[f32], dx: &mut [MaybeUninit<f32>]) {
    let n = x.len().min(g.len()).min(dx.len());
    let dp = dx.as_mut_ptr().cast::<f32>();
    let (c, a, half) = (_mm512_set1_ps(C), _mm512_set1_ps(A), _mm512_set1_ps(0.5));
    let (one, three_a) = (_mm512_set1_ps(1.0), _mm512_set1_ps(3.0 * A));
    for i in (0..n).step_by(16) {
        let m = tail(i, n);
        let v = _mm512_maskz_loadu_ps(m, x.as_ptr().add(i));
        let gv = _mm512_maskz_loadu_ps(m, g.as_ptr().add(i));
        let v2 = _mm512_mul_ps(v, v);
        let cv = _mm512_mul_ps(c, v);
        let t = tanh(_mm512_mul_ps(cv, _mm512_fmadd_ps(a, v2, one)));
        // gelu′ = ½(1 + t) + ½x·(1 − t²)·c·(1 + 3a·x²)
        let dt = _mm512_mul_ps(
            _mm512_fnmadd_ps(t, t, one),
            _mm512_fmadd_ps(three_a, v2, one),
        );
        let d = _mm512_fmadd_ps(
            _mm512_mul_ps(half, cv),
            dt,
            _mm512_mul_ps(half, _mm512_add_ps(one, t)),
        );
        _mm512_mask_storeu_ps(dp.add(i), m, _mm512_mul_ps(gv, d));
    }
}

/// One row of the causal softmax: `row[j] = exp(scale·row[j] − m) / z` for `j < live`,
/// 0 for `live ≤ j < row.len()`, where `m` is the scaled maximum of the live part and `z`
/// the sum; returns the log-sum-exp `m + ln z`.
///
/// # Safety
/// The CPU must support AVX-512F and FMA; `1 ≤ live ≤ row.len()`.
#[target_feature(enable = "avx512f,fma")]
pub(crate) unsafe fn softmax_row(row: &mut [f32], live: usize, scale: f32) -> f32 {
    let p = row.as_mut_ptr();
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    for j in (0..live).step_by(16) {
        let v = _mm512_mask_loadu_ps(mx, tail(j, live), p.add(j));
        mx = _mm512_max_ps(mx, v);
    }
    let m = _mm512_reduce_max_ps(mx) * scale;
    let (sc, neg_m) = (_mm512_set1_ps(scale), _mm512_set1_ps(-m));
    let mut z = _mm512_setzero_ps();
    for j in (0..row.len()).step_by(16) {
        let lanes = tail(j, live.max(j));
        let v = _mm512_maskz_loadu_ps(lanes, p.add(j));
        let e = _mm512_maskz_mov_ps(lanes, exp(_mm512_fmadd_ps(v, sc, neg_m)));
        z = _mm512_add_ps(z, e);
        _mm512_mask_storeu_ps(p.add(j), tail(j, row.len()), e);
    }
    let z = _mm512_reduce_add_ps(z);
    let inv = _mm512_set1_ps(1.0 / z);
    for j in (0..live).step_by(16) {
        let lanes = tail(j, live);
        let v = _mm512_maskz_loadu_ps(lanes, p.add(j));
        _mm512_mask_storeu_ps(p.add(j), lanes, _mm512_mul_ps(v, inv));
    }
    m + z.ln()
}

/// One row of the causal softmax's backward: `row` holds the scores and becomes
/// `P = exp(scale·s − lse)`, `drow` holds `dP` and becomes `dS = scale·P ⊙ (dP − D)`, for
/// `j < live`; both 0 for `live ≤ j < row.len()`.
///
/// # Safety
/// The CPU must support AVX-512F and FMA; `live ≤ row.len() ≤ drow.len()`.
#[target_feature(enable = "avx512f,fma")]
pub(crate) unsafe fn softmax_row_bwd(
    row: &mut [f32],
    drow: &mut [f32],
    live: usize,
    scale: f32,
    lse: f32,
    dsum: f32,
) {
    let (p, dp) = (row.as_mut_ptr(), drow.as_mut_ptr());
    let (sc, neg_l, d) = (
        _mm512_set1_ps(scale),
        _mm512_set1_ps(-lse),
        _mm512_set1_ps(dsum),
    );
    for j in (0..row.len()).step_by(16) {
        let lanes = tail(j, live.max(j));
        let all = tail(j, row.len());
        let v = _mm512_maskz_loadu_ps(lanes, p.add(j));
        let e = _mm512_maskz_mov_ps(lanes, exp(_mm512_fmadd_ps(v, sc, neg_l)));
        let g = _mm512_maskz_loadu_ps(lanes, dp.add(j));
        let ds = _mm512_mul_ps(_mm512_mul_ps(e, _mm512_sub_ps(g, d)), sc);
        _mm512_mask_storeu_ps(p.add(j), all, e);
        _mm512_mask_storeu_ps(dp.add(j), all, ds);
    }
}

/// `dst = srcᵀ` for the `rows × cols` matrix `src` (row stride `rs`), `dst` row-major
/// `cols × rows` with row stride `ld`: 16 × 16 blocks transposed in registers (unpacks
/// of 32- and 64-bit lanes, then two rounds of 128-bit lane shuffles), edges masked.
///
/// # Safety
/// The CPU must support AVX-512F; `src` holds `(rows − 1)·rs + cols` elements and `dst`
/// `(cols − 1)·ld + rows`.
#[target_feature(enable = "avx512f")]
pub(crate) unsafe fn transpose(
    src: &[f32],
    rs: usize,
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    ld: usize,
) {
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    for j0 in (0..rows).step_by(16) {
        let row_lanes = tail(j0, rows);
        for c0 in (0..cols).step_by(16) {
            let col_lanes = tail(c0, cols);
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, x) in r.iter_mut().enumerate().take(rows - j0) {
                *x = _mm512_maskz_loadu_ps(col_lanes, s.add((j0 + i) * rs + c0));
            }
            let r = transpose16(r);
            for (i, x) in r.iter().enumerate().take(cols - c0) {
                _mm512_mask_storeu_ps(d.add((c0 + i) * ld + j0), row_lanes, *x);
            }
        }
    }
}

/// The transpose of a 16 × 16 block held as 16 row vectors.
#[inline(always)]
unsafe fn transpose16(r: [__m512; 16]) -> [__m512; 16] {
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let pd = |x: __m512| _mm512_castps_pd(x);
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let (a, b, c, e) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a), pd(c)));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a), pd(c)));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b), pd(e)));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b), pd(e)));
    }
    for h in 0..2 {
        let o = 8 * h;
        for i in 0..4 {
            t[o + i] = _mm512_shuffle_f32x4::<0x88>(u[o + i], u[o + 4 + i]);
            t[o + 4 + i] = _mm512_shuffle_f32x4::<0xdd>(u[o + i], u[o + 4 + i]);
        }
    }
    let mut out = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        out[i] = _mm512_shuffle_f32x4::<0x88>(t[i], t[8 + i]);
        out[8 + i] = _mm512_shuffle_f32x4::<0xdd>(t[i], t[8 + i]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the kernels run here (AVX-512 and FMA, not under Miri). The twins of
    /// GELU, the softmax rows and the transposes are in `crate::twins`.
    fn has() -> bool {
        let on = crate::kernel::avx512();
        if !on {
            eprintln!("note: no AVX-512 here (or under Miri): skipped");
        }
        on
    }

    #[test]
    fn exp_is_accurate_over_its_range() {
        if !has() {
            return;
        }
        let mut worst = 0f64;
        let mut x = -87.0f32;
        while x < 88.0 {
            let mut out = [0f32; 16];
            // SAFETY: AVX-512F was detected.
            unsafe { _mm512_storeu_ps(out.as_mut_ptr(), exp(_mm512_set1_ps(x))) };
            let want = (x as f64).exp();
            worst = worst.max((out[0] as f64 - want).abs() / want);
            // Its portable twin: the same polynomial, within an ulp or two.
            let twin = crate::kernel::exp_f32(x);
            assert!(
                (out[0] - twin).abs() <= 4e-7 * twin,
                "exp({x}): {} vs {twin}",
                out[0]
            );
            x += 0.0137;
        }
        assert!(worst < 4e-7, "exp relative error {worst:e}");
    }

    #[test]
    fn transpose_matches_the_definition_on_edges() {
        if !has() {
            return;
        }
        for (rows, cols) in [(1, 1), (16, 16), (128, 32), (70, 3), (5, 40), (33, 17)] {
            let rs = cols + 2;
            let src: Vec<f32> = (0..rows * rs).map(|i| i as f32).collect();
            let ld = rows + 1;
            let mut dst = vec![-1f32; cols * ld];
            // SAFETY: AVX-512F was detected; the buffers have the documented sizes.
            unsafe { transpose(&src, rs, rows, cols, &mut dst, ld) };
            for c in 0..cols {
                for j in 0..ld {
                    let want = if j < rows { src[j * rs + c] } else { -1.0 };
                    assert_eq!(dst[c * ld + j], want, "{rows}×{cols}: [{c}][{j}]");
                }
            }
        }
    }
}
