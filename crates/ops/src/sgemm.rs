//! Small single-precision matrix products for AVX-512, without packing: `C = (C or 0) +
//! A·B` for `A` `[m, k]` of any strides, `B` `[k, n]` row-major (unit column stride) and
//! `C` row-major.
//!
//! These are the products inside the fused attention (`T × T × hd` per head, in blocks
//! of 16 rows), a few hundred thousand multiply-adds each, where the `gemm` crate's
//! dispatch and packing cost more than the arithmetic. Everything such a product touches
//! already sits in L1 or L2, so the micro-kernel reads its operands in place:
//!
//! * an `R × 32` tile of `C` (`R ≤ 8`, 16 of the 32 `zmm` registers) accumulates, for
//!   each `p` of the depth, two vectors of `B`'s row `p` times `R` broadcast elements of
//!   `A`'s column `p`: 16 fused multiply-adds against 2 vector loads and `R` broadcasts;
//! * the last tile column uses AVX-512 masks (a masked load never faults on the lanes it
//!   leaves out), and a tile of at most 16 columns uses one vector;
//! * `R` and the vector count are compile-time constants, so the tile lives in registers.
//!
//! Large products keep going to the `gemm` crate, whose cache blocking wins there.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use crate::kernel::Mat;

/// Rows of the register tile.
const MR: usize = 8;
/// Columns of the register tile (two 16-lane vectors).
const NR: usize = 32;

/// `dst[m×n] = (accumulate ? dst : 0) + a · b` on one thread, `dst` row-major with row
/// stride `ld`, `b` with unit column stride (`b.cs == 1`).
///
/// # Safety
/// The CPU must support AVX-512F; the caller has checked every operand's bounds for
/// these `m`, `n`, `k` and `ld` (as [`crate::kernel::matmul`] does), and `dst` does not
/// alias `a` or `b`.
pub(crate) unsafe fn small_sgemm(product: Product) {
    product.each_tile((MR, NR), lanes, |t, rows, cols| {
        macro_rules! go {
            ($($r:literal)*) => {
                match (rows, cols > 16) {
                    $(($r, false) => t.run::<$r, 1>(), ($r, true) => t.run::<$r, 2>(),)*
                    _ => unreachable!("rows ≤ MR"),
                }
            };
        }
        go!(1 2 3 4 5 6 7 8);
    });
}

/// One small product, `dst[m×n] = (accumulate ? dst : 0) + a · b`, as the register-tile
/// kernels (this module's, [`crate::avx2`]'s) take it.
pub(crate) struct Product<'a> {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub dst: *mut f32,
    pub ld: usize,
    pub accumulate: bool,
    pub a: Mat<'a, f32>,
    pub b: Mat<'a, f32>,
}

impl Product<'_> {
    /// Runs `run(tile, rows, cols)` on each `mr × nr` tile of `C` in turn (`rows ≤ mr`,
    /// `cols ≤ nr` at the edges), the tile's two vectors of `nr / 2` lanes masked by
    /// `mask(lanes)`.
    ///
    /// # Safety
    /// As the kernel's: the operands' bounds were checked for `m`, `n`, `k` and `ld`, and
    /// `b` has unit column stride.
    pub(crate) unsafe fn each_tile<M>(
        &self,
        (mr, nr): (usize, usize),
        mask: unsafe fn(usize) -> M,
        mut run: impl FnMut(&Tile<M>, usize, usize),
    ) {
        debug_assert_eq!(self.b.cs, 1);
        let (a, b) = (self.a, self.b);
        let (ap, bp) = (a.data.as_ptr(), b.data.as_ptr());
        for i in (0..self.m).step_by(mr) {
            let rows = (self.m - i).min(mr);
            for j in (0..self.n).step_by(nr) {
                let cols = (self.n - j).min(nr);
                let t = Tile {
                    k: self.k,
                    a: ap.add(i * a.rs),
                    rs: a.rs,
                    cs: a.cs,
                    b: bp.add(j),
                    ldb: b.rs,
                    c: self.dst.add(i * self.ld + j),
                    ldc: self.ld,
                    mask: [mask(cols), mask(cols.saturating_sub(nr / 2))],
                    acc: self.accumulate,
                };
                run(&t, rows, cols);
            }
        }
    }
}

/// A mask of the first `n` (at most 16) lanes.
unsafe fn lanes(n: usize) -> __mmask16 {
    if n >= 16 {
        0xffff
    } else {
        ((1u32 << n) - 1) as __mmask16
    }
}

/// One tile of `C`: its rows of `A`, its columns of `B`, where it goes, and the masks of
/// its vectors' lanes (`M`: the CPU's kind of mask).
pub(crate) struct Tile<M> {
    pub k: usize,
    pub a: *const f32,
    pub rs: usize,
    pub cs: usize,
    pub b: *const f32,
    pub ldb: usize,
    pub c: *mut f32,
    pub ldc: usize,
    pub mask: [M; 2],
    pub acc: bool,
}

impl Tile<__mmask16> {
    /// `C[R × 16V] = (C or 0) + A[R × k] · B[k × 16V]`, masked to the tile's columns.
    ///
    /// # Safety
    /// AVX-512F; the rows `R` and the unmasked columns are inside the operands.
    #[target_feature(enable = "avx512f,fma")]
    unsafe fn run<const R: usize, const V: usize>(&self) {
        let mut r = [[_mm512_setzero_ps(); V]; R];
        for p in 0..self.k {
            // Offsets from the tile's corners, never a pointer stepped past the last row
            // or column read (`ptr::add` beyond the allocation is undefined behaviour).
            let (a, b) = (self.a.add(p * self.cs), self.b.add(p * self.ldb));
            let mut bv = [_mm512_setzero_ps(); V];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm512_maskz_loadu_ps(self.mask[v], b.add(16 * v));
            }
            for (i, ri) in r.iter_mut().enumerate() {
                let ai = _mm512_set1_ps(*a.add(i * self.rs));
                for (x, acc) in bv.iter().zip(ri.iter_mut()) {
                    *acc = _mm512_fmadd_ps(ai, *x, *acc);
                }
            }
        }
        for (i, ri) in r.iter().enumerate() {
            let row = self.c.add(i * self.ldc);
            for (v, &x) in ri.iter().enumerate() {
                let (p, mask) = (row.add(16 * v), self.mask[v]);
                let x = match self.acc {
                    true => _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, p)),
                    false => x,
                };
                _mm512_mask_storeu_ps(p, mask, x);
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The product in f64, element by element.
    fn naive(m: usize, n: usize, k: usize, a: Mat<f32>, b: Mat<f32>) -> Vec<f64> {
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    c[i * n + j] +=
                        a.data[i * a.rs + p * a.cs] as f64 * b.data[p * b.rs + j * b.cs] as f64;
                }
            }
        }
        c
    }

    fn data(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32)
            .map(|v| v / (1 << 24) as f32 - 0.5)
            .collect()
    }

    /// A small-product kernel's signature ([`small_sgemm`], `crate::avx2::small_sgemm`).
    pub(crate) type Kernel = unsafe fn(Product);

    /// The register-tile kernel against the naive product, and against its portable
    /// twin (the `gemm` crate's product through `kernel::matmul`).
    #[test]
    fn matches_the_naive_product_and_its_twin_on_every_layout_and_edge() {
        if !crate::kernel::avx512() {
            // `kernel::tests::portable_matmul_matches_the_naive_product` covers the twin.
            eprintln!("note: no AVX-512 here (or under Miri): skipped");
            return;
        }
        // SAFETY: AVX-512F was detected.
        check(small_sgemm);
    }

    /// `kernel` (whose CPU features the caller has checked) on shapes that cross every
    /// tile edge, with one and two vectors per tile row, `A` either way round, written
    /// and accumulated, into a destination wider than `n`.
    pub(crate) fn check(kernel: Kernel) {
        for &(m, n, k) in &[
            (1, 1, 1),
            (14, 32, 1),
            (9, 16, 5),
            (8, 48, 33),
            (13, 31, 7),
            (15, 33, 257),
            (17, 70, 300),
            (30, 160, 20),
            (3, 5, 600),
            (16, 40, 32),
            (10, 24, 9),
            (4, 8, 128),
        ] {
            for ta in [false, true] {
                for accumulate in [false, true] {
                    let av = data(m * k, 1);
                    let bv = data(k * n, 2);
                    let a = match ta {
                        false => Mat::rows(&av, k),
                        true => Mat::rows(&av, m).t(),
                    };
                    let b = Mat::rows(&bv, n);
                    // A destination wider than n, to check the row stride.
                    let ld = n + 3;
                    let init = data(m * ld, 3);
                    let mut c = init.clone();
                    // SAFETY: the caller checked the CPU; the operands are exactly sized.
                    unsafe {
                        kernel(Product {
                            m,
                            n,
                            k,
                            dst: c.as_mut_ptr(),
                            ld,
                            accumulate,
                            a,
                            b,
                        })
                    };
                    let want = naive(m, n, k, a, b);
                    let mut twin = init.clone();
                    let dst = match accumulate {
                        true => crate::kernel::Dst::Add(&mut twin),
                        false => crate::kernel::Dst::Set(&mut twin),
                    };
                    crate::kernel::portable_only(|| {
                        crate::kernel::matmul(m, n, k, dst, ld, a, b, false)
                    });
                    for i in 0..m {
                        for j in 0..ld {
                            let got = c[i * ld + j] as f64;
                            if j >= n {
                                assert_eq!(c[i * ld + j], init[i * ld + j], "wrote past n");
                                continue;
                            }
                            let base = if accumulate {
                                init[i * ld + j] as f64
                            } else {
                                0.0
                            };
                            let w = base + want[i * n + j];
                            let tw = twin[i * ld + j] as f64;
                            assert!(
                                (got - tw).abs() <= 1e-5 * (1.0 + w.abs()) * (k as f64).sqrt(),
                                "twin: m {m} n {n} k {k} ta {ta} acc {accumulate}: \
                                 [{i},{j}] {got} vs {tw}"
                            );
                            assert!(
                                (got - w).abs() <= 1e-5 * (1.0 + w.abs()) * (k as f64).sqrt(),
                                "m {m} n {n} k {k} ta {ta} acc {accumulate}: \
                                 [{i},{j}] {got} vs {w}"
                            );
                        }
                    }
                }
            }
        }
    }
}
