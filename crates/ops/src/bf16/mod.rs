//! bf16 matrix products with f32 accumulation: `C = (C or 0) + A·B` for `A` `[m, k]` and
//! `B` `[k, n]` in bf16 (or f32, rounded to bf16 as they are packed), `C` f32.
//!
//! Three kernels, chosen at run time by what the CPU has ([`Bf16Kernel`]):
//!
//! * **AMX** (`amx_bf16`, Intel Sapphire Rapids and later, on Linux once the process was
//!   granted the tile state): `TDPBF16PS` multiplies a 16 × 32 tile of `A` by a 32 × 16
//!   tile of `B` into a 16 × 16 f32 tile, 8,192 multiply-adds an instruction. The
//!   micro-kernel keeps a 32 × 32 block of `C` in four tile registers
//!   ([`amx`](self::amx)).
//! * **AVX-512 BF16** (`avx512_bf16`, AMD Zen 4, Intel Cooper Lake and Sapphire Rapids):
//!   `VDPBF16PS` adds the products of 16 pairs of bf16 into 16 f32 lanes; an 8 × 32
//!   register tile of `C`, like the f32 small kernel in `sgemm.rs`
//!   ([`dpbf16`](self::dpbf16)).
//! * **Emulated** (any other CPU, and Miri): the packed operands are widened to f32 and
//!   multiplied by the f32 product of [`crate::kernel::matmul`]. The same products of
//!   the same bf16 values, summed in another order.
//!
//! Every product of two bf16 values is exact in f32 and every kernel adds them in f32,
//! so the three agree to f32 rounding (tested), and against an f64 product of the same
//! bf16 values within `k` f32 roundings.
//!
//! **Packing** (one format for both native kernels). `A` is copied into rows of `Kp`
//! bf16 (`k` rounded up to 32, zero-padded), `Mp` rows (`m` rounded up to 32). `B` is
//! cut into panels of 32 columns and blocks of 32 depths; each block is two 1 KiB tiles
//! (columns 0–15 and 16–31), row `r` of a tile holding the pairs `B[2r][c], B[2r+1][c]`
//! of its 16 columns: the "VNNI" layout AMX's `B` tiles take, and whose rows are the
//! 16-lane vectors `VDPBF16PS` takes. Packing costs `m·k + k·n` element copies against
//! `m·n·k` multiply-adds.
//!
//! **Blocking.** Depths are taken `KC` (512) at a time and the rows of `A` `MC` at a
//! time (about 256 KiB of packed `A` over `KC` depths, which stays in L2, and fewer when
//! that leaves a thread of the pool idle); for each block of rows and chunk of depths,
//! each 32 rows of `A` (32 KiB, in L1) meet every panel of `B` (`KC × 32` bf16, from
//! L2) in turn. Blocks of rows are split over the current rayon pool's threads, each
//! writing its own rows of `C`; the first chunk of depths writes `C` (or adds to it, or
//! adds a bias to what it wrote, [`gemm_bias`]), the others add. The AMX kernel loads
//! and stores a whole 32 × 32 block of `C` in place; the other kernels, and blocks at
//! `C`'s edges, go through a 32 × 32 buffer. Contiguous bf16 rows of whole blocks are
//! their own packed `A`.
//!
//! The fused ops multiply through these products at `Precision::Bf16`
//! (`crate::linear::product`); [`linear_bf16`] is a standalone op with a bf16 output.

use std::sync::OnceLock;

use half::bf16;
use rayon::prelude::*;

use crate::kernel::{Dst, Mat, SharedMut, Uninit};

#[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
mod amx;
#[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
use amx::Tiles;
/// Where AMX is not compiled in, nothing to configure.
#[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(miri))))]
enum Tiles {}
mod act;
mod convert;
#[cfg(all(target_arch = "x86_64", not(miri)))]
mod dpbf16;
mod linear;
mod pack;
mod product;
#[cfg(test)]
mod tests;

#[cfg(test)]
use convert::round_to_bf16;
pub(crate) use convert::{round_and_halve, round_into, to_bf16_vec, widen, widen_into, ToBf16};
pub(crate) use pack::{b_index, pack_a, pack_b, PackedA, PackedB, B_BLOCK};

pub(crate) use act::{grad_as, half_slice, held_slice, storage_as, widened};
pub use linear::{linear_bf16, linear_bf16_on};
pub(crate) use product::{keep, Bf16Product, Held, HeldMat};

/// Which kernel multiplies bf16 on this CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Bf16Kernel {
    /// AMX tiles (`TDPBF16PS`).
    Amx,
    /// AVX-512 BF16 (`VDPBF16PS`).
    Avx512Bf16,
    /// Widened to f32 and multiplied by the f32 kernels: correct, not faster.
    Emulated,
}

impl Bf16Kernel {
    /// The fastest kernel this CPU (and OS) runs.
    pub fn best() -> Bf16Kernel {
        static BEST: OnceLock<Bf16Kernel> = OnceLock::new();
        *BEST.get_or_init(|| {
            let all = Bf16Kernel::available();
            all[0]
        })
    }

    /// Every kernel this CPU runs, fastest first (always ending with `Emulated`).
    pub fn available() -> Vec<Bf16Kernel> {
        let mut all = Vec::new();
        #[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
        if amx::available() {
            all.push(Bf16Kernel::Amx);
        }
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        if dpbf16::available() {
            all.push(Bf16Kernel::Avx512Bf16);
        }
        all.push(Bf16Kernel::Emulated);
        all
    }

    /// Whether the CPU multiplies bf16 natively (the report says "emulated" otherwise).
    pub fn is_native(self) -> bool {
        self != Bf16Kernel::Emulated
    }

    pub fn name(self) -> &'static str {
        match self {
            Bf16Kernel::Amx => "amx",
            Bf16Kernel::Avx512Bf16 => "avx512_bf16",
            Bf16Kernel::Emulated => "emulated",
        }
    }
}

impl std::fmt::Display for Bf16Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The depth, rows and columns of the blocks the kernels work on.
pub(crate) const BLOCK: usize = 32;

pub(crate) fn round_up(x: usize) -> usize {
    x.div_ceil(BLOCK) * BLOCK
}

/// Depths per chunk of the blocked product (a multiple of 32).
const KC: usize = 512;

/// Rows of `A` per task: about 256 KiB of packed `A` over `kc` depths, a multiple of 32.
fn rows_per_block(kc: usize) -> usize {
    ((256 * 1024 / (2 * kc.max(1))) / BLOCK).max(1) * BLOCK
}

/// `dst[m×n] = (Add ? dst : 0) + a · b` in f32 from bf16 operands (f32 ones are rounded
/// to bf16), with `kernel`; `dst` row-major of row stride `ld`, written whole (it may
/// start uninitialised) or accumulated onto.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm<A: ToBf16, B: ToBf16>(
    kernel: Bf16Kernel,
    m: usize,
    n: usize,
    k: usize,
    dst: Dst<f32>,
    ld: usize,
    a: Mat<A>,
    b: Mat<B>,
) {
    gemm_bias(kernel, m, n, k, dst, ld, a, b, None)
}

/// [`gemm`], and with `bias` (`n` values; not with [`Dst::Add`]) `dst = bias + a · b`:
/// the bias is added to each block of `dst` as its first chunk of depths is written,
/// while the block is in L1, instead of being written over all of `dst` first.
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm_bias<A: ToBf16, B: ToBf16>(
    kernel: Bf16Kernel,
    m: usize,
    n: usize,
    k: usize,
    dst: Dst<f32>,
    ld: usize,
    a: Mat<A>,
    b: Mat<B>,
    bias: Option<&[f32]>,
) {
    let (ptr, len, accumulate) = match dst {
        Dst::Uninit(d) => (d.as_mut_ptr().cast::<f32>(), d.len(), false),
        Dst::Set(d) => (d.as_mut_ptr(), d.len(), false),
        Dst::Add(d) => (d.as_mut_ptr(), d.len(), true),
    };
    assert!(
        m == 0 || n == 0 || ((m - 1) * ld + n <= len && n <= ld),
        "bf16 gemm: destination out of bounds"
    );
    assert!(
        a.fits(m, k) && b.fits(k, n),
        "bf16 gemm: operands out of bounds"
    );
    assert!(
        bias.is_none_or(|b| b.len() >= n && !accumulate),
        "bf16 gemm: a bias of n values, onto a destination that is written, not added to"
    );
    if m == 0 || n == 0 {
        return;
    }
    let out = SharedMut(ptr);
    // Row `r`, columns `j..j + w` of the destination.
    let row = |r: usize, j: usize, w: usize| -> *mut f32 {
        debug_assert!(r < m && j + w <= n);
        // SAFETY: `r < m`, `j + w ≤ n ≤ ld`: inside the destination checked above.
        unsafe { out.ptr().add(r * ld + j) }
    };
    // Writes the bias (or zeros) over the destination: before an empty sum, or before
    // the emulated kernel adds onto it.
    let place = || {
        for r in 0..m {
            // SAFETY: `n` elements of row `r` (see `row`), exclusively borrowed.
            unsafe {
                match bias {
                    Some(b) => std::ptr::copy_nonoverlapping(b.as_ptr(), row(r, 0, n), n),
                    None => std::ptr::write_bytes(row(r, 0, n), 0, n),
                }
            }
        }
    };
    if k == 0 {
        // An empty sum; the kernels need at least one block of depth.
        if !accumulate {
            place();
        }
        return;
    }
    let pa = pack_a(a, m, k);
    let pb = pack_b(b, k, n);
    if kernel == Bf16Kernel::Emulated {
        if bias.is_some() {
            place();
        }
        // SAFETY: the destination's bounds were checked above; it is exclusively
        // borrowed (it overlaps neither packed operand) and with `Add` (or a bias just
        // placed) initialised.
        return unsafe { emulated(&pa, &pb, m, n, k, ptr, ld, accumulate || bias.is_some()) };
    }
    // Depths are taken `KC` at a time, so that a block of rows of `A` and the part of
    // every panel of `B` it meets stay in L2 (a product over 4,096 tokens, a weight's
    // gradient, would otherwise stream all of `B` from memory for every 32 rows).
    let kc = KC.min(pa.kp);
    // Rows per task: an L2's worth, or fewer so that every thread of the pool has one.
    let threads = rayon::current_num_threads();
    let mc = rows_per_block(kc).min(round_up(m.div_ceil(threads)).max(BLOCK));
    let blocks = m.div_ceil(mc);
    let run = |t: usize| {
        let rows = t * mc..((t + 1) * mc).min(m);
        let mut c = [0f32; BLOCK * BLOCK];
        // This task's tile configuration, for all its blocks.
        #[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
        // SAFETY: `Amx` is only offered when `amx::available`.
        let tiles = (kernel == Bf16Kernel::Amx).then(|| unsafe { amx::Tiles::configure() });
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux", not(miri))))]
        let tiles: Option<Tiles> = None;
        for k0 in (0..pa.kp).step_by(kc) {
            let depth = kc.min(pa.kp - k0);
            // The first chunk writes (or adds onto) the destination, the others add.
            let add = accumulate || k0 > 0;
            // Each 32 rows of `A` (`32 × KC` bf16: 32 KiB) meet every panel of `B` in
            // turn: they stay in L1 while the panels stream from L2 (the other order,
            // a panel in L1 meeting every block of rows, reads both from L2: 8 % slower
            // on the reference GPT).
            let order = rows
                .clone()
                .step_by(BLOCK)
                .flat_map(|i| (0..n).step_by(BLOCK).map(move |j| (i, j)));
            for (i, j) in order {
                let panel = &pb.data[((j / BLOCK) * pb.kb + k0 / BLOCK) * B_BLOCK..]
                    [..depth / BLOCK * B_BLOCK];
                let a_rows = &pa.data[i * pa.kp + k0..][..(BLOCK - 1) * pa.kp + depth];
                let (h, w) = ((m - i).min(BLOCK), (n - j).min(BLOCK));
                #[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
                if let (Some(tiles), true) = (&tiles, h == BLOCK && w == BLOCK) {
                    // A whole block: the tiles are loaded from and stored to the
                    // destination itself.
                    // SAFETY: `Amx` is only offered when `amx::available`; the
                    // operands' sizes by construction (32 rows of `depth` at stride
                    // `Kp`, `depth / 32` blocks of the panel); the 32 × 32 block at
                    // `(i, j)` is inside the destination (`i + 32 ≤ m`,
                    // `j + 32 ≤ n ≤ ld`), in this task's rows, and initialised when
                    // `add` (by the caller, or by the previous chunk).
                    unsafe {
                        amx::block(tiles, a_rows, pa.kp, depth, panel, row(i, j, w), ld, add)
                    };
                    if let (Some(b), false) = (bias, add) {
                        for r in 0..BLOCK {
                            let d = row(i + r, j, w);
                            for (x, &v) in b[j..j + w].iter().enumerate() {
                                // SAFETY: element `x < w` of a row of this task's
                                // block, just written by the kernel (see above).
                                unsafe { *d.add(x) += v };
                            }
                        }
                    }
                    continue;
                }
                block(kernel, tiles.as_ref(), a_rows, pa.kp, depth, panel, &mut c);
                if let (Some(b), false) = (bias, add) {
                    for cr in c.chunks_exact_mut(BLOCK) {
                        for (x, &v) in cr.iter_mut().zip(&b[j..j + w]) {
                            *x += v;
                        }
                    }
                }
                for r in 0..h {
                    let (d, s) = (row(i + r, j, w), &c[r * BLOCK..r * BLOCK + w]);
                    // SAFETY: `w` elements of a row of this task's rows (see `row`);
                    // no other task writes them, nothing reads the destination until
                    // all tasks are done, and with `add` they are initialised.
                    unsafe {
                        match add {
                            true => {
                                for (x, &v) in s.iter().enumerate() {
                                    *d.add(x) += v;
                                }
                            }
                            false => std::ptr::copy_nonoverlapping(s.as_ptr(), d, w),
                        }
                    }
                }
            }
        }
    };
    if blocks > 1 && rayon::current_num_threads() > 1 {
        (0..blocks).into_par_iter().for_each(run);
    } else {
        (0..blocks).for_each(run);
    }
}

/// One 32 × 32 block of `C` (`c`, row-major) = 32 packed rows of `A` times one panel.
fn block(
    kernel: Bf16Kernel,
    tiles: Option<&Tiles>,
    a: &[u16],
    lda: usize,
    depth: usize,
    panel: &[u16],
    c: &mut [f32; BLOCK * BLOCK],
) {
    // Used by the AMX and AVX-512 BF16 arms only, which some targets (and Miri) do not
    // compile.
    let _ = (&tiles, &c);
    debug_assert!(depth.is_multiple_of(BLOCK) && depth <= lda);
    debug_assert_eq!(a.len(), (BLOCK - 1) * lda + depth);
    debug_assert_eq!(panel.len(), depth / BLOCK * B_BLOCK);
    match kernel {
        #[cfg(all(target_arch = "x86_64", target_os = "linux", not(miri)))]
        // SAFETY: `Amx` is only offered when the CPU has AMX-BF16 and the OS granted the
        // tile state (`amx::available`); the slices hold the 32 rows of `depth` (stride
        // `lda`) and the `depth / 32` blocks the kernel reads (asserted above in debug
        // builds, by construction in `gemm`).
        Bf16Kernel::Amx => unsafe {
            let tiles = tiles.expect("the AMX kernel runs inside a configured task");
            amx::block(tiles, a, lda, depth, panel, c.as_mut_ptr(), BLOCK, false)
        },
        #[cfg(all(target_arch = "x86_64", not(miri)))]
        // SAFETY: `Avx512Bf16` is only offered when the CPU has AVX-512 F and BF16
        // (`dpbf16::available`); the operands' sizes as above.
        Bf16Kernel::Avx512Bf16 => unsafe { dpbf16::block(a, lda, depth, panel, c) },
        _ => unreachable!("{kernel} is not available on this CPU"),
    }
}

/// The emulated kernel: the packed operands widened to f32, multiplied in f32.
///
/// # Safety
/// As [`crate::kernel::matmul_raw`]'s destination: `dst + r·ld + c` for `r < m`, `c < n`
/// (`n ≤ ld`) is valid for writes (and reads, initialised, when `accumulate`), and
/// nothing else accesses it during the call.
#[allow(clippy::too_many_arguments)]
unsafe fn emulated(
    pa: &PackedA,
    pb: &PackedB,
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    ld: usize,
    accumulate: bool,
) {
    let widen = |x: u16| bf16::from_bits(x).to_f32();
    let a: Vec<f32> = pa.data[..m * pa.kp].iter().map(|&x| widen(x)).collect();
    let mut b = vec![0f32; k * n];
    for (p, row) in b.chunks_exact_mut(n).enumerate() {
        for (c, x) in row.iter_mut().enumerate() {
            *x = widen(pb.data[b_index(pb.kb, p, c)]);
        }
    }
    let (a, b) = (Mat::rows(&a, pa.kp), Mat::rows(&b, n));
    // SAFETY: the caller's contract on `dst`; `a` and `b` are this function's own.
    unsafe { crate::kernel::matmul_raw(m, n, k, dst, ld, accumulate, a, b, true) }
}

/// `a · b` with bf16 multiplications and f32 accumulation, on [`Bf16Kernel::best`]: `a`
/// `[m, k]` and `b` `[k, n]`, each bf16 or f32 (rounded to the nearest bf16), any
/// strides (a transposed weight, `w.t()`, is read in place); an f32 `[m, n]`. CPU
/// tensors only. No backward: a building block of the bf16 paths of the fused ops.
pub fn matmul_bf16(
    a: &candle_core::Tensor,
    b: &candle_core::Tensor,
) -> candle_core::Result<candle_core::Tensor> {
    matmul_bf16_with(a, b, Bf16Kernel::best())
}

/// [`matmul_bf16`] on a given kernel (one of [`Bf16Kernel::available`]), to compare
/// them.
pub fn matmul_bf16_with(
    a: &candle_core::Tensor,
    b: &candle_core::Tensor,
    kernel: Bf16Kernel,
) -> candle_core::Result<candle_core::Tensor> {
    use candle_core::{bail, DType};
    if !Bf16Kernel::available().contains(&kernel) {
        bail!("matmul_bf16: the {kernel} kernel does not run on this CPU");
    }
    let ((m, k), (k2, n)) = (a.dims2()?, b.dims2()?);
    if k != k2 {
        bail!("matmul_bf16: [{m}, {k}] · [{k2}, {n}]: the inner dims differ");
    }
    for t in [a, b] {
        if !matches!(t.dtype(), DType::BF16 | DType::F32) || !t.device().is_cpu() {
            bail!(
                "matmul_bf16: a {:?} tensor on {:?}; bf16 or f32 CPU tensors expected",
                t.dtype(),
                t.device().location()
            );
        }
    }
    let mut out = Uninit::<f32>::new(m * n)?;
    let (sa, la) = a.storage_and_layout();
    let (sb, lb) = b.storage_and_layout();
    let (x, y) = (operand(&sa, la)?, operand(&sb, lb)?);
    macro_rules! go {
        ($a:expr, $b:expr) => {
            gemm(
                kernel,
                m,
                n,
                k,
                Dst::Uninit(out.as_mut()),
                n,
                Mat {
                    data: $a,
                    rs: x.1,
                    cs: x.2,
                },
                Mat {
                    data: $b,
                    rs: y.1,
                    cs: y.2,
                },
            )
        };
    }
    match (x.0, y.0) {
        (Operand::Bf16(a), Operand::Bf16(b)) => go!(a, b),
        (Operand::Bf16(a), Operand::F32(b)) => go!(a, b),
        (Operand::F32(a), Operand::Bf16(b)) => go!(a, b),
        (Operand::F32(a), Operand::F32(b)) => go!(a, b),
    }
    drop((sa, sb));
    // SAFETY: `gemm` wrote every one of the `m·n` elements (`Dst::Uninit`, row stride n).
    let out = unsafe { out.assume_init() };
    candle_core::Tensor::from_vec(out, (m, n), &candle_core::Device::Cpu)
}

/// A bf16 or f32 CPU tensor's elements from its start, and its two strides.
fn operand<'s>(
    s: &'s candle_core::Storage,
    l: &candle_core::Layout,
) -> candle_core::Result<(Operand<'s>, usize, usize)> {
    let candle_core::Storage::Cpu(s) = s else {
        candle_core::bail!("matmul_bf16: bf16 or f32 CPU tensors expected");
    };
    Ok((
        Operand::of(s, l.start_offset())?,
        l.stride()[0],
        l.stride()[1],
    ))
}

/// A tensor's elements as a bf16 product reads them.
#[derive(Clone, Copy)]
pub(crate) enum Operand<'a> {
    Bf16(&'a [bf16]),
    F32(&'a [f32]),
}

impl<'a> Operand<'a> {
    /// A bf16 or f32 CPU storage's elements from `start`.
    pub(crate) fn of(s: &'a candle_core::CpuStorage, start: usize) -> candle_core::Result<Self> {
        match s {
            candle_core::CpuStorage::BF16(v) => Ok(Operand::Bf16(&v[start..])),
            candle_core::CpuStorage::F32(v) => Ok(Operand::F32(&v[start..])),
            _ => candle_core::bail!("bf16 products: bf16 or f32 tensors expected"),
        }
    }
}
