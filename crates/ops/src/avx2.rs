//! AVX2 + FMA kernels for CPUs without AVX-512 (most AMD CPUs before Zen 4, Intel's
//! client cores): the attention's small products and transposes, 8 lanes at a time.
//!
//! The twins of [`crate::sgemm`] and of `crate::avx512::transpose`, for the same reason:
//! the attention's products (`16 × T × hd` per block of rows, a few hundred thousand
//! multiply-adds each) sit in L1 or L2, and the `gemm` crate's dispatch and packing cost
//! more than their arithmetic (the attention's forward ran at about 13 GFLOP/s through
//! it). With 16 `ymm` registers the register tile is `6 × 16` (12 accumulators, two
//! vectors of `B`, one broadcast of `A`). A tile whose columns fill its vectors loads and
//! stores whole vectors; one that does not uses `vmaskmovps`, which does not touch the
//! lanes it leaves out.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::sgemm::{Product, Tile};

/// Rows of the register tile.
const MR: usize = 6;
/// Columns of the register tile (two 8-lane vectors).
const NR: usize = 16;

/// A mask of the first `n` (at most 8) lanes, for `vmaskmovps`.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn lanes(n: usize) -> __m256i {
    let n = n.min(8) as i32;
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// A whole vector at `p` (`FULL`), or the lanes of `mask` (the others zero, untouched).
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn load<const FULL: bool>(p: *const f32, mask: __m256i) -> __m256 {
    match FULL {
        true => _mm256_loadu_ps(p),
        false => _mm256_maskload_ps(p, mask),
    }
}

/// `dst[m×n] = (accumulate ? dst : 0) + a · b` on one thread, `dst` row-major with row
/// stride `ld`, `b` with unit column stride (`b.cs == 1`).
///
/// # Safety
/// The CPU must support AVX2 and FMA; the caller has checked every operand's bounds for
/// these `m`, `n`, `k` and `ld` (as [`crate::kernel::matmul`] does), and `dst` does not
/// alias `a` or `b`.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn small_sgemm(product: Product) {
    product.each_tile((MR, NR), lanes, |t, rows, cols| {
        // Whole vectors when the columns fill them: every tile of the attention's
        // products but where `T` or a block is not a multiple of 8.
        let full = cols.is_multiple_of(8);
        macro_rules! go {
            ($($r:literal)*) => {
                match (rows, cols > 8, full) {
                    $(
                        ($r, false, true) => t.run::<$r, 1, true>(),
                        ($r, false, false) => t.run::<$r, 1, false>(),
                        ($r, true, true) => t.run::<$r, 2, true>(),
                        ($r, true, false) => t.run::<$r, 2, false>(),
                    )*
                    _ => unreachable!("rows ≤ MR"),
                }
            };
        }
        go!(1 2 3 4 5 6);
    });
}

impl Tile<__m256i> {
    /// `C[R × 8V] = (C or 0) + A[R × k] · B[k × 8V]`, masked to the tile's columns
    /// unless `FULL` (the columns fill the `V` vectors).
    ///
    /// # Safety
    /// AVX2 and FMA; the rows `R` and the tile's columns are inside the operands.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run<const R: usize, const V: usize, const FULL: bool>(&self) {
        let mut r = [[_mm256_setzero_ps(); V]; R];
        for p in 0..self.k {
            // Offsets from the tile's corners, never a pointer stepped past the last row
            // or column read (`ptr::add` beyond the allocation is undefined behaviour).
            let (a, b) = (self.a.add(p * self.cs), self.b.add(p * self.ldb));
            let mut bv = [_mm256_setzero_ps(); V];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = load::<FULL>(b.add(8 * v), self.mask[v]);
            }
            for (i, ri) in r.iter_mut().enumerate() {
                let ai = _mm256_set1_ps(*a.add(i * self.rs));
                for (x, acc) in bv.iter().zip(ri.iter_mut()) {
                    *acc = _mm256_fmadd_ps(ai, *x, *acc);
                }
            }
        }
        for (i, ri) in r.iter().enumerate() {
            let row = self.c.add(i * self.ldc);
            for (v, &x) in ri.iter().enumerate() {
                let p = row.add(8 * v);
                let x = match self.acc {
                    true => _mm256_add_ps(x, load::<FULL>(p, self.mask[v])),
                    false => x,
                };
                match FULL {
                    true => _mm256_storeu_ps(p, x),
                    false => _mm256_maskstore_ps(p, self.mask[v], x),
                }
            }
        }
    }
}

/// `dst = srcᵀ` for the `rows × cols` matrix `src` (row stride `rs`), `dst` row-major
/// `cols × rows` with row stride `ld`: 8 × 8 blocks transposed in registers (unpacks of
/// 32-bit lanes, shuffles of 64-bit pairs, then swaps of 128-bit halves), edges masked.
///
/// # Safety
/// The CPU must support AVX2; `src` holds `(rows − 1)·rs + cols` elements and `dst`
/// `(cols − 1)·ld + rows`.
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn transpose(
    src: &[f32],
    rs: usize,
    rows: usize,
    cols: usize,
    dst: &mut [f32],
    ld: usize,
) {
    let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
    for j0 in (0..rows).step_by(8) {
        let row_lanes = lanes(rows - j0);
        for c0 in (0..cols).step_by(8) {
            let col_lanes = lanes(cols - c0);
            let mut r = [_mm256_setzero_ps(); 8];
            // Whole blocks with plain loads and stores (`vmaskmovps` stores are
            // microcoded on AMD's cores: masked, the transposes took a third of the
            // attention products' time).
            let full = rows - j0 >= 8 && cols - c0 >= 8;
            for (i, x) in r.iter_mut().enumerate().take(rows - j0) {
                let p = s.add((j0 + i) * rs + c0);
                *x = match full {
                    true => _mm256_loadu_ps(p),
                    false => _mm256_maskload_ps(p, col_lanes),
                };
            }
            let r = transpose8(r);
            for (i, &x) in r.iter().enumerate().take(cols - c0) {
                let p = d.add((c0 + i) * ld + j0);
                match full {
                    true => _mm256_storeu_ps(p, x),
                    false => _mm256_maskstore_ps(p, row_lanes, x),
                }
            }
        }
    }
}

/// The transpose of an 8 × 8 block held as 8 row vectors.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved: t[2i] = (r[2i]₀ r[2i+1]₀ r[2i]₁ r[2i+1]₁ | same for 4, 5).
    let mut t = [_mm256_setzero_ps(); 8];
    for i in 0..4 {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // Four rows' elements of one column per 128-bit half: u[4h + c] holds rows 4h..4h+4
    // of columns c and c + 4.
    let mut u = [_mm256_setzero_ps(); 8];
    for h in 0..2 {
        let (a, b, c, e) = (t[4 * h], t[4 * h + 1], t[4 * h + 2], t[4 * h + 3]);
        u[4 * h] = _mm256_shuffle_ps::<0x44>(a, c);
        u[4 * h + 1] = _mm256_shuffle_ps::<0xee>(a, c);
        u[4 * h + 2] = _mm256_shuffle_ps::<0x44>(b, e);
        u[4 * h + 3] = _mm256_shuffle_ps::<0xee>(b, e);
    }
    // Rows 0–3 and 4–7 joined: the low halves give columns 0–3, the high ones 4–7.
    let mut out = [_mm256_setzero_ps(); 8];
    for i in 0..4 {
        out[i] = _mm256_permute2f128_ps::<0x20>(u[i], u[4 + i]);
        out[4 + i] = _mm256_permute2f128_ps::<0x31>(u[i], u[4 + i]);
    }
    out
}

#[cfg(test)]
mod tests {
    /// The register-tile kernel against the naive product and the `gemm` crate's, on
    /// shapes that cross its `6 × 16` tile's every edge (the attention's 16-row blocks
    /// end in a 4-row tile; 8 or 24 columns end in one whole vector).
    #[test]
    fn the_small_product_matches_the_naive_product_and_its_twin() {
        if !crate::kernel::avx2() {
            eprintln!("note: no AVX2 and FMA here (or under Miri): skipped");
            return;
        }
        crate::sgemm::tests::check(super::small_sgemm);
    }
}
