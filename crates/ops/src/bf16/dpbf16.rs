//! The AVX-512 BF16 micro-kernel: `VDPBF16PS` on an 8 × 32 register tile of `C`.
//!
//! A row of one of the packed `B` block's tiles is 16 pairs of bf16, one for each of 16
//! columns: exactly the vector `VDPBF16PS` pairs with a broadcast pair of `A`'s row
//! (`A[r][2p], A[r][2p+1]`), adding `A[r][2p]·B[2p][c] + A[r][2p+1]·B[2p+1][c]` to lane
//! `c`. Per pair of depths: two vector loads, eight broadcasts and sixteen `VDPBF16PS`
//! into sixteen accumulators. A 32 × 32 block is four such tiles, one after the other.
//!
//! On Sapphire Rapids `VDPBF16PS` issues at half the rate of an f32 FMA, so per cycle it
//! does what `VFMADD231PS` does (32 multiply-adds): AMX is the fast path there. It is the
//! fast path on CPUs with AVX-512 BF16 and no AMX (Zen 4, Cooper Lake).

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::{BLOCK, B_BLOCK};

/// Whether this CPU has AVX-512 F and BF16.
pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        std::is_x86_feature_detected!("avx512f") && std::is_x86_feature_detected!("avx512bf16")
    })
}

/// Rows of the register tile.
const MR: usize = 8;

/// `c` (32 × 32, row-major) = 32 packed rows of `A` (`depth` elements each, row stride
/// `lda`) times a panel of packed `B` (`depth / 32` blocks).
///
/// # Safety
/// [`available`] returned true.
pub(super) unsafe fn block(
    a: &[u16],
    lda: usize,
    depth: usize,
    panel: &[u16],
    c: &mut [f32; BLOCK * BLOCK],
) {
    assert!(
        depth.is_multiple_of(BLOCK)
            && depth <= lda
            && a.len() >= (BLOCK - 1) * lda + depth
            && panel.len() >= depth / BLOCK * B_BLOCK
    );
    for g in 0..BLOCK / MR {
        let rows = &a[g * MR * lda..][..(MR - 1) * lda + depth];
        let out = &mut c[g * MR * BLOCK..(g + 1) * MR * BLOCK];
        // SAFETY: the CPU has the features (the caller's contract); the slices' lengths
        // were asserted above.
        unsafe { tile(rows, lda, depth, panel, out) };
    }
}

/// `out` (8 × 32) = 8 rows of `A` (`rows`: `depth` elements each, row stride `lda`)
/// times the panel.
///
/// # Safety
/// AVX-512 F and BF16; `depth` a multiple of 32, at most `lda`;
/// `rows.len() ≥ 7 · lda + depth`, `panel.len() ≥ depth / 32 · B_BLOCK`,
/// `out.len() == 8 · 32`.
#[target_feature(enable = "avx512f,avx512bf16")]
unsafe fn tile(rows: &[u16], lda: usize, depth: usize, panel: &[u16], out: &mut [f32]) {
    let mut acc = [[_mm512_setzero_ps(); 2]; MR];
    let (ap, bp) = (rows.as_ptr(), panel.as_ptr());
    for q in 0..depth / BLOCK {
        for pair in 0..BLOCK / 2 {
            // SAFETY: block `q < depth / 32` of the panel: its two tiles' row `pair`, 64
            // bytes each, inside `panel`.
            let (v0, v1) = unsafe {
                let b = bp.add(q * B_BLOCK + pair * 32);
                (
                    _mm512_loadu_si512(b.cast()),
                    _mm512_loadu_si512(b.add(512).cast()),
                )
            };
            let (v0, v1): (__m512bh, __m512bh) = (m512bh(v0), m512bh(v1));
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: row `r < 8` (at `r · lda`), depths `32·q + 2·pair` and the next,
                // below `depth`: inside `rows`; two u16 read as one (unaligned) u32.
                let pair_bits = unsafe {
                    ap.add(r * lda + q * BLOCK + 2 * pair)
                        .cast::<u32>()
                        .read_unaligned()
                };
                let x = m512bh(_mm512_set1_epi32(pair_bits as i32));
                acc[0] = _mm512_dpbf16_ps(acc[0], x, v0);
                acc[1] = _mm512_dpbf16_ps(acc[1], x, v1);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: row `r < 8` of `out` (8 × 32 f32): 32 floats at `32·r`.
        unsafe {
            _mm512_storeu_ps(out.as_mut_ptr().add(r * BLOCK), acc[0]);
            _mm512_storeu_ps(out.as_mut_ptr().add(r * BLOCK + 16), acc[1]);
        }
    }
}

/// The same 512 bits seen as 32 bf16.
#[inline]
#[target_feature(enable = "avx512f,avx512bf16")]
fn m512bh(x: __m512i) -> __m512bh {
    // SAFETY: both are 64 bytes of plain data with no invalid bit patterns.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(x) }
}
