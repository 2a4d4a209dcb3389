//! Packing the operands of the bf16 products (see the module docs of `bf16`): `A` into
//! rows of `Kp` bf16, `B` into panels of 32 × 32 VNNI blocks, each converted from f32 (or
//! copied from bf16) along the source's unit stride.

use super::{round_up, ToBf16, BLOCK};
use crate::kernel::Mat;

/// `a` (`m × k`) packed: `Mp` rows of `Kp` bf16 bits, zero-padded.
pub(crate) struct PackedA {
    pub(crate) data: Vec<u16>,
    /// `Kp`: the row length.
    pub(crate) kp: usize,
}

pub(crate) fn pack_a<T: ToBf16>(a: Mat<T>, m: usize, k: usize) -> PackedA {
    let (mp, kp) = (round_up(m), round_up(k));
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
                    for p in 0..pw {
                        let src = &a.data[(p0 + p) * a.cs + i0..][..ih];
                        T::row_bits(src, &mut tile[p * BLOCK..][..ih]);
                    }
                    for i in 0..ih {
                        let row = &mut data[(i0 + i) * kp + p0..][..pw];
                        for (p, x) in row.iter_mut().enumerate() {
                            *x = tile[p * BLOCK + i];
                        }
                    }
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
    PackedA { data, kp }
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
