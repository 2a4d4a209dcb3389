//! One (batch, head) pair of the fused attention, forward and backward (see the parent
//! module for the math): its products in row blocks that skip the masked half, on a
//! scratch of the task's, writing the pair's own columns of a shared output.

use std::mem::MaybeUninit;

use super::{blocks, softmax_causal, softmax_causal_bwd, Geo};
use crate::kernel::{self, dot, matmul, matmul_raw, simd, Dst, Float, Mat, SharedMut};

/// `xᵀ` for the `t × hd` matrix `x`, as the products `q·kᵀ` and `dO·vᵀ` read their right
/// operand. Where a small-product kernel runs them (f32 on AVX-512 or AVX2), which needs
/// a unit column stride, it is copied into `dst` (row-major `hd × t`) by that CPU's
/// register transpose; elsewhere (f64, the portable build) it is a strided view of `x`
/// itself: `gemm` packs its operands anyway, so a copy would be pure cost (a scalar
/// transpose was 1.5 % of a pipeline step's cycles on an AVX2 AMD EPYC).
fn transposed<'a, T: Float>(x: Mat<'a, T>, t: usize, hd: usize, dst: &'a mut [T]) -> Mat<'a, T> {
    let src = &x.data[..(t - 1) * x.rs + hd];
    #[cfg(target_arch = "x86_64")]
    if kernel::small_products() {
        if let (Some(src), Some(out)) = (kernel::as_f32(src), kernel::as_f32_mut(dst)) {
            assert!(out.len() >= hd * t, "transpose: destination too small");
            // SAFETY: the CPU has AVX-512 (checked first), or else AVX2
            // (`small_products`); the sizes were checked.
            unsafe {
                match kernel::avx512() {
                    true => crate::avx512::transpose(src, x.rs, t, hd, out, t),
                    false => crate::avx2::transpose(src, x.rs, t, hd, out, t),
                }
            };
            return Mat::rows(&*dst, t);
        }
    }
    Mat { data: src, ..x }.t()
}

/// The portable twin of [`crate::avx512::transpose`]: `dst` (`cols × rows`, row stride
/// `rows`) `= srcᵀ` for `src` `rows × cols` of row stride `rs` (the twins' tests check
/// the AVX-512 and AVX2 kernels against it; where neither runs, the attention reads a
/// strided view instead).
#[cfg(test)]
pub(crate) fn transpose_portable<T: Float>(
    src: &[T],
    rs: usize,
    rows: usize,
    cols: usize,
    dst: &mut [T],
) {
    for (j, row) in src.chunks(rs).take(rows).enumerate() {
        for (d, &v) in row[..cols].iter().enumerate() {
            dst[d * rows + j] = v;
        }
    }
}

/// Forward of one (batch, head) pair: scores, causal softmax (recording the log-sum-exp),
/// and `O = P·v` into its columns of the output.
pub(super) fn forward_pair<T: Float>(
    qkv: &[T],
    g: Geo,
    pair: usize,
    scratch: &mut [T],
    lse: &mut [MaybeUninit<T>],
    out: SharedMut<T>,
) {
    let (t, hd, dl) = (g.t, g.hd, g.dl());
    let ld = 3 * dl;
    let (bi, hi) = (pair / g.h, pair % g.h);
    let [qm, km, vm] = g.qkv(qkv, bi, hi);
    let (s, kt) = scratch.split_at_mut(t * t);
    let kt = transposed(km, t, hd, kt);
    // Row blocks: rows r0..r1 only see keys 0..r1.
    for rows in blocks(t) {
        score_rows(qm, kt, rows, (ld, hd, t), s);
    }
    softmax_causal(s, t, t, g.scale, lse);
    for (r0, r1) in blocks(t) {
        let pb = Mat::rows(&s[r0 * t..], t);
        // SAFETY: the output holds `b·t` rows of `dl`, and this pair alone writes the
        // columns `hi·hd..(hi + 1)·hd` of its rows `bi·t..(bi + 1)·t` (here rows r0..r1),
        // through raw pointers only ([`SharedMut`]); nothing reads them until all pairs
        // are done, and the output is its own allocation.
        unsafe {
            let dst = out.ptr().add(g.out(bi, hi) + r0 * dl);
            matmul_raw(r1 - r0, hd, r1, dst, dl, false, pb, vm, false);
        }
    }
}

simd! {
    /// `out[i] = Σ_d a[i·ld + d]·b[i·ld + d]` over the first `hd` columns of each row.
    fn row_dots<T>(a: &[T], b: &[T], ld: usize, hd: usize, out: &mut [T]) {
        for (i, v) in out.iter_mut().enumerate() {
            let r = i * ld;
            *v = dot(&a[r..r + hd], &b[r..r + hd]);
        }
    }
}

/// Backward of one (batch, head) pair into its q, k and v columns of `dx`.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward_pair<T: Float>(
    x: &[T],
    o: &[T],
    d_o: &[T],
    lse: &[T],
    g: Geo,
    pair: usize,
    scratch: &mut [T],
    dst: SharedMut<T>,
) {
    let (t, hd, dl) = (g.t, g.hd, g.dl());
    let ld = 3 * dl;
    let (bi, hi) = (pair / g.h, pair % g.h);
    let (s, rest) = scratch.split_at_mut(t * t);
    let (dp, rest) = rest.split_at_mut(t * t);
    let (dsum, rest) = rest.split_at_mut(t);
    let (kt, vt) = rest.split_at_mut(hd * t);
    let [q, k, v] = g.offsets(bi, hi);
    let [qm, km, vm] = g.qkv(x, bi, hi);
    let (kt, vt) = (transposed(km, t, hd, kt), transposed(vm, t, hd, vt));
    let oo = g.out(bi, hi);
    let dom = Mat {
        data: &d_o[oo..],
        rs: dl,
        cs: 1,
    };
    row_dots(&d_o[oo..], &o[oo..], dl, hd, dsum);
    for (r0, r1) in blocks(t) {
        let db = Mat {
            data: &dom.data[r0 * dl..],
            ..dom
        };
        score_rows(qm, kt, (r0, r1), (ld, hd, t), s);
        matmul(
            r1 - r0,
            r1,
            hd,
            Dst::Set(&mut dp[r0 * t..]),
            t,
            db,
            vt,
            false,
        );
    }
    softmax_causal_bwd(s, dp, t, t, g.scale, &lse[pair * t..(pair + 1) * t], dsum);
    let (s, dp) = (&*s, &*dp);
    for (c0, c1) in blocks(t) {
        // Keys c0..c1 are seen by queries c0..t only.
        let p_t = Mat::rows(&s[c0 * t + c0..], t).t();
        let ds_t = Mat::rows(&dp[c0 * t + c0..], t).t();
        let do_b = Mat {
            data: &dom.data[c0 * dl..],
            ..dom
        };
        let q_b = Mat {
            data: &qm.data[c0 * ld..],
            ..qm
        };
        let ds_r = Mat::rows(&dp[c0 * t..], t);
        let (w, n) = (c1 - c0, t - c0);
        // SAFETY: `dx` has the packed input's `b·t` rows of `3·dl`, and this pair alone
        // writes its q, k and v columns (`hd` each at offsets q, k, v) of its rows
        // `bi·t..(bi + 1)·t` (here rows c0..c1), through raw pointers only
        // ([`SharedMut`]); nothing reads them until all pairs are done, and `dx` is its
        // own allocation.
        unsafe {
            let d = dst.ptr();
            matmul_raw(w, hd, n, d.add(v + c0 * ld), ld, false, p_t, do_b, false);
            matmul_raw(w, hd, n, d.add(k + c0 * ld), ld, false, ds_t, q_b, false);
            // Queries c0..c1 (a row block) see keys 0..c1.
            matmul_raw(w, hd, c1, d.add(q + c0 * ld), ld, false, ds_r, km, false);
        }
    }
}

/// Rows `r0..r1` of the causal scores `q·kᵀ` (only keys `0..r1`: the rows see no later
/// key), written into `s` of row stride `t`; `q` has row stride `ld` and `hd` columns.
/// The forward computes them, and the backward again.
fn score_rows<T: Float>(
    qm: Mat<T>,
    kt: Mat<T>,
    (r0, r1): (usize, usize),
    (ld, hd, t): (usize, usize, usize),
    s: &mut [T],
) {
    let qb = Mat {
        data: &qm.data[r0 * ld..],
        ..qm
    };
    matmul(
        r1 - r0,
        r1,
        hd,
        Dst::Set(&mut s[r0 * t..]),
        t,
        qb,
        kt,
        false,
    );
}
