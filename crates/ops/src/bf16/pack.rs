//! Packing the operands of the bf16 products (see the module docs of `bf16`): `A` into
//! rows of `Kp` bf16, `B` into panels of 32 × 32 VNNI blocks, each converted from f32 (or
//! copied from bf16) along the source's unit stride.

use std::borrow::Cow;

use super::{round_up, ToBf16, BLOCK};
use crate::kernel::Mat;

/// `a` (`m × k`) packed: `Mp` rows of `Kp` bf16 bits, zero-padded; or, for bf16 rows
/// that already have that form, the rows themselves.
pub(crate) struct PackedA<'a> {
    pub(crate) data: Cow<'a, [u16]>,
    /// `Kp`: the row length.
    pub(crate) kp: usize,
}

pub(crate) fn pack_a<T: ToBf16>(a: Mat<'_, T>, m: usize, k: usize) -> PackedA<'_> {
    let (mp, kp) = (round_up(m), round_up(k));
    if let (Some(bits), true) = (T::as_bits(a.data), (mp, kp, a.rs, a.cs) == (m, k, k, 1)) {
        // Contiguous bf16 rows whose sizes need no padding are their own packing.
        if bits.len() >= m * k {
            return PackedA {
                data: Cow::Borrowed(&bits[..m * k]),
                kp,
            };
        }
    }
    let mut data = vec![0u16; mp * kp];
    if a.cs == 1 {
        // Rows of the source are contiguous: one converting copy a row.
        for (i, row) in data.chunks_exact_mut(kp).take(m).enumerate() {
            T::row_bits(&a.data[i * a.rs..][..k], &mut row[..k]);
        }
    } else if a.rs == 1 {
        // A transposed operand (columns contiguous): 32 × 32 blocks, each converted
        // along the source's columns into a tile, then written out a row (64 bytes) at a
        // time.
        // The blocks go in squares of 256 × 256, whose source and destination rows
        // (a few hundred pages) stay in L2 and the TLB.
        const SQUARE: usize = 8 * BLOCK;
        let mut tile = [0u16; BLOCK * BLOCK];
        for (si, sp) in (0..m)
            .step_by(SQUARE)
            .flat_map(|si| (0..k).step_by(SQUARE).map(move |sp| (si, sp)))
        {
            for i0 in (si..(si + SQUARE).min(m)).step_by(BLOCK) {
                let ih = (m - i0).min(BLOCK);
                for p0 in (sp..(sp + SQUARE).min(k)).step_by(BLOCK) {
                    let pw = (k - p0).min(BLOCK);
                    // The block's source (bf16 as it is, f32 converted into `tile`),
                    // with the stride from one depth to the next.
                    let (block, stride) = match T::as_bits(a.data) {
                        Some(bits) => (&bits[p0 * a.cs + i0..], a.cs),
                        None => {
                            for p in 0..pw {
                                let src = &a.data[(p0 + p) * a.cs + i0..][..ih];
                                T::row_bits(src, &mut tile[p * BLOCK..][..ih]);
                            }
                            (&tile[..], BLOCK)
                        }
                    };
                    transpose_block(block, stride, pw, ih, &mut data[i0 * kp + p0..], kp);
                }
            }
        }
    } else {
        for (i, row) in data.chunks_exact_mut(kp).take(m).enumerate() {
            for (p, x) in row[..k].iter_mut().enumerate() {
                *x = a.data[i * a.rs + p * a.cs].bits();
            }
        }
    }
    PackedA {
        data: Cow::Owned(data),
        kp,
    }
}

/// `dst[i·ld + p] = src[p·stride + i]` for `p < pw`, `i < ih` (both at most 32): one
/// block of a transposed operand, by five butterfly stages of `VPERMT2W` on AVX-512
/// CPUs (a fifth of a cycle an element against four for the scalar loop).
fn transpose_block(src: &[u16], stride: usize, pw: usize, ih: usize, dst: &mut [u16], ld: usize) {
    assert!(pw <= BLOCK && ih <= BLOCK, "a block is at most 32 × 32");
    if pw == 0 || ih == 0 {
        return;
    }
    assert!(
        src.len() >= (pw - 1) * stride + ih && dst.len() >= (ih - 1) * ld + pw,
        "transpose_block: operands out of bounds"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::kernel::avx512() {
        // SAFETY: the CPU has AVX-512 F and BW (`avx512` checks both); the bounds of
        // every row read (`pw` rows of `ih` at `stride`) and written (`ih` rows of `pw`
        // at `ld`) were checked above.
        return unsafe {
            transpose_block_avx512(src.as_ptr(), stride, pw, ih, dst.as_mut_ptr(), ld)
        };
    }
    for i in 0..ih {
        for (p, x) in dst[i * ld..][..pw].iter_mut().enumerate() {
            *x = src[p * stride + i];
        }
    }
}

/// [`transpose_block`] on AVX-512: the 32 rows in 32 registers, then for each bit `h`
/// of the index (16, 8, 4, 2, 1), rows `j` and `j + h` exchange the halves that swap
/// that bit of row and column.
///
/// # Safety
/// The CPU has AVX-512 F and BW; `src + p·stride + i` is readable for `p < pw`,
/// `i < ih`, and `dst + i·ld + p` writable for `i < ih`, `p < pw` (both ≤ 32).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn transpose_block_avx512(
    src: *const u16,
    stride: usize,
    pw: usize,
    ih: usize,
    dst: *mut u16,
    ld: usize,
) {
    use std::arch::x86_64::*;
    let mask = |n: usize| if n >= 32 { u32::MAX } else { (1u32 << n) - 1 };
    let mut r = [_mm512_setzero_si512(); BLOCK];
    for (p, row) in r.iter_mut().enumerate().take(pw) {
        // SAFETY: `ih` elements of source row `p < pw` (the caller's contract).
        *row = unsafe { _mm512_maskz_loadu_epi16(mask(ih), src.add(p * stride).cast()) };
    }
    let mut h = 16;
    while h > 0 {
        // Row `j` (bit `h` clear) keeps its columns with bit `h` clear and takes row
        // `j + h`'s other ones; row `j + h` the reverse.
        let (mut lo, mut hi) = ([0u16; 32], [0u16; 32]);
        for c in 0..32 {
            (lo[c], hi[c]) = match c & h {
                0 => (c as u16, (c + h) as u16),
                _ => ((32 + c - h) as u16, (32 + c) as u16),
            };
        }
        // SAFETY: 32 u16 each, unaligned loads.
        let (lo, hi) = unsafe {
            (
                _mm512_loadu_si512(lo.as_ptr().cast()),
                _mm512_loadu_si512(hi.as_ptr().cast()),
            )
        };
        for j in (0..BLOCK).filter(|j| j & h == 0) {
            let (a, b) = (r[j], r[j + h]);
            r[j] = _mm512_permutex2var_epi16(a, lo, b);
            r[j + h] = _mm512_permutex2var_epi16(a, hi, b);
        }
        h /= 2;
    }
    for (i, row) in r.iter().enumerate().take(ih) {
        // SAFETY: `pw` elements of destination row `i < ih` (the caller's contract).
        unsafe { _mm512_mask_storeu_epi16(dst.add(i * ld).cast(), mask(pw), *row) };
    }
}

/// `b` (`k × n`) packed in panels of 32 columns and blocks of 32 depths, each block two
/// 16-column tiles of 16 pair-rows (see the module docs).
pub(crate) struct PackedB {
    pub(crate) data: Vec<u16>,
    /// Blocks of 32 depths per panel: `Kp / 32`.
    pub(crate) kb: usize,
}

/// u16s in one 32 × 32 block of packed `B` (two 16 × 32 tiles).
pub(crate) const B_BLOCK: usize = BLOCK * BLOCK;

pub(crate) fn pack_b<T: ToBf16>(b: Mat<T>, k: usize, n: usize) -> PackedB {
    let (kp, np) = (round_up(k), round_up(n));
    let kb = kp / BLOCK;
    let mut data = vec![0u16; kp * np];
    // One 32 × 32 block at a time, each row (or column, for a transposed operand such
    // as a weight stored `[out, in]`) of the source converted along its unit stride.
    let mut line = [0u16; BLOCK];
    // Blocks in the order that reads the source along its rows (row-major `B`: 32 whole
    // rows, then every panel of them) or its columns (a transposed `B`).
    let panels = np / BLOCK;
    for index in 0..panels * kb {
        let (panel, blk) = match b.cs <= b.rs {
            true => (index % panels, index / panels),
            false => (index / kb, index % kb),
        };
        let (c0, cw) = (panel * BLOCK, (n - panel * BLOCK).min(BLOCK));
        {
            let (p0, pw) = (blk * BLOCK, (k - blk * BLOCK).min(BLOCK));
            let dst = &mut data[(panel * kb + blk) * B_BLOCK..][..B_BLOCK];
            let at = |p: usize, c: usize| (c / 16) * 512 + (p / 2) * 32 + (c % 16) * 2 + p % 2;
            let src = &b.data[p0 * b.rs + c0 * b.cs..];
            if b.cs == 1 {
                // Two rows (depths `p`, `p + 1`) at a time, interleaved into row `p / 2`
                // of each 16-column tile.
                let mut next = [0u16; BLOCK];
                for p in (0..pw).step_by(2) {
                    T::row_bits(&src[p * b.rs..][..cw], &mut line[..cw]);
                    match p + 1 < pw {
                        true => T::row_bits(&src[(p + 1) * b.rs..][..cw], &mut next[..cw]),
                        false => next[..cw].fill(0),
                    }
                    for half in 0..2 {
                        let row = &mut dst[half * 512 + (p / 2) * 32..][..32];
                        let cols =
                            (half * 16..(half * 16 + 16).min(cw)).map(|c| (line[c], next[c]));
                        for (pair, (x, y)) in row.chunks_exact_mut(2).zip(cols) {
                            pair[0] = x;
                            pair[1] = y;
                        }
                    }
                }
            } else if b.rs == 1 {
                for c in 0..cw {
                    T::row_bits(&src[c * b.cs..][..pw], &mut line[..pw]);
                    for (p, &x) in line[..pw].iter().enumerate() {
                        dst[at(p, c)] = x;
                    }
                }
            } else {
                for p in 0..pw {
                    for c in 0..cw {
                        dst[at(p, c)] = src[p * b.rs + c * b.cs].bits();
                    }
                }
            }
        }
    }
    PackedB { data, kb }
}

/// Where `B[p][c]` goes in packed `B` of `kb` depth blocks per panel.
#[inline]
pub(crate) fn b_index(kb: usize, p: usize, c: usize) -> usize {
    let (block, pair, e) = (p / BLOCK, (p % BLOCK) / 2, p % 2);
    let (panel, half, col) = (c / BLOCK, (c % BLOCK) / 16, c % 16);
    (panel * kb + block) * B_BLOCK + half * 512 + pair * 32 + col * 2 + e
}
