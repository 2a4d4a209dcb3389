//! [`matmul`]: one product on raw slices (or strided views, [`Mat`]), writing or
//! accumulating into its output ([`Dst`]) and never zero-filling it: the `gemm` crate
//! (AVX-512 through its `x86-v4` feature), or the small-product kernels of
//! [`crate::sgemm`] (AVX-512) and [`crate::avx2`] for the attention's products.

use std::mem::MaybeUninit;

#[cfg(target_arch = "x86_64")]
use super::{as_f32, avx512};
use super::{small_products, Float};

/// A matrix operand of [`matmul`]: element `(i, j)` is at `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(crate) struct Mat<'a, T> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<'a, T> Mat<'a, T> {
    /// A row-major matrix with row stride `ld`.
    pub(crate) fn rows(data: &'a [T], ld: usize) -> Self {
        Mat {
            data,
            rs: ld,
            cs: 1,
        }
    }
    /// The transpose (no copy).
    pub(crate) fn t(self) -> Self {
        Mat {
            data: self.data,
            rs: self.cs,
            cs: self.rs,
        }
    }
    /// Whether every element `(i, j)`, `i < rows`, `j < cols`, lies inside `data`.
    pub(crate) fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * self.rs + (cols - 1) * self.cs < self.data.len()
    }
}

/// f32 products of at most this many multiply-adds whose `b` has unit column stride go
/// to a small-product kernel (no packing; [`crate::sgemm::small_sgemm`] on AVX-512 CPUs,
/// [`crate::avx2::small_sgemm`] on AVX2 ones): the attention's.
const SMALL_MAX: usize = 1 << 19;

/// Products below this many multiply-adds run on one thread.
pub(crate) const PARALLEL_MIN: usize = 1 << 21;

/// Whether the fused ops compute an f32 product of `mnk` multiply-adds through the
/// `gemm` crate on this CPU (which keeps an L2-sized packing buffer on each thread that
/// runs one) rather than the small-product kernel (none), and whether it splits it over
/// the threads of a compute pool: `(gemm, split)`. For memory estimates.
pub fn product_path(mnk: usize) -> (bool, bool) {
    let small = small_products() && mnk <= SMALL_MAX;
    (!small, !small && mnk >= PARALLEL_MIN)
}

/// The destination of [`matmul`]: written (`Uninit`: it may be uninitialised; `Set`:
/// initialised, overwritten) or accumulated onto (`Add`).
pub(crate) enum Dst<'a, T> {
    Uninit(&'a mut [MaybeUninit<T>]),
    Set(&'a mut [T]),
    Add(&'a mut [T]),
}

/// `dst[m×n] = (Add ? dst : 0) + a[m×k] · b[k×n]`, with `dst` row-major of row stride
/// `ld`. On more than one thread of the current rayon pool, large products are split
/// over them when `parallel` is set.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: Dst<T>,
    ld: usize,
    a: Mat<T>,
    b: Mat<T>,
    parallel: bool,
) {
    let (ptr, len, accumulate) = match dst {
        Dst::Uninit(d) => (d.as_mut_ptr().cast::<T>(), d.len(), false),
        Dst::Set(d) => (d.as_mut_ptr(), d.len(), false),
        Dst::Add(d) => (d.as_mut_ptr(), d.len(), true),
    };
    assert!(
        m == 0 || n == 0 || ((m - 1) * ld + n <= len && n <= ld),
        "matmul: destination out of bounds"
    );
    // SAFETY: the destination's bounds were checked above; it is exclusively borrowed
    // (so it overlaps neither `a` nor `b`, shared borrows), and with `Add` initialised.
    unsafe { matmul_raw(m, n, k, ptr, ld, accumulate, a, b, parallel) }
}

/// [`matmul`] into a raw destination, for tasks that write disjoint blocks of one buffer
/// at once (no task may hold a `&mut` covering another task's elements).
///
/// # Safety
/// The elements `dst + r·ld + c` for `r < m`, `c < n` (and `n ≤ ld`) lie in one
/// allocation and are valid for writes (and reads, initialised, when `accumulate`); no
/// other thread accesses them during the call, and they overlap neither `a` nor `b`.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn matmul_raw<T: Float>(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut T,
    ld: usize,
    accumulate: bool,
    a: Mat<T>,
    b: Mat<T>,
    parallel: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        a.fits(m, k) && b.fits(k, n) && n <= ld,
        "matmul: operands out of bounds"
    );
    if k == 0 {
        if !accumulate {
            for r in 0..m {
                for c in 0..n {
                    // SAFETY: (r, c) is inside the destination (the caller's contract).
                    unsafe { dst.add(r * ld + c).write(T::zero()) };
                }
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if b.cs == 1 && m * n * k <= SMALL_MAX && small_products() {
        if let (Some(ad), Some(bd)) = (as_f32(a.data), as_f32(b.data)) {
            let product = crate::sgemm::Product {
                m,
                n,
                k,
                dst: dst.cast(),
                ld,
                accumulate,
                a: Mat {
                    data: ad,
                    rs: a.rs,
                    cs: a.cs,
                },
                b: Mat::rows(bd, b.rs),
            };
            // SAFETY: the CPU has AVX-512 (checked first), or else AVX2 and FMA
            // (`small_products`); `T` is f32; the operands' bounds were checked above, the
            // destination's by the caller.
            unsafe {
                match avx512() {
                    true => crate::sgemm::small_sgemm(product),
                    false => crate::avx2::small_sgemm(product),
                }
            };
            return;
        }
    }
    let threads = rayon::current_num_threads();
    let par = if parallel && threads > 1 && m * n * k >= PARALLEL_MIN {
        gemm::Parallelism::Rayon(threads)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: the bounds of `a` and `b` were checked above, the destination's by the
    // caller; `gemm` reads the destination only when `accumulate` (`read_dst`).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            ld as isize,
            accumulate,
            a.data.as_ptr(),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr(),
            b.cs as isize,
            b.rs as isize,
            T::one(),
            T::one(),
            false,
            false,
            false,
            par,
        )
    }
}
