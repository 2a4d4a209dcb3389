//! The AMX micro-kernel: a 32 × 32 block of `C` in four tile registers.
//!
//! Tiles `tmm0`–`tmm3` hold `C`'s four 16 × 16 f32 quarters; per 32 depths, `tmm4` and
//! `tmm5` take 16 rows × 32 bf16 of `A` each (rows 0–15 and 16–31, straight from the
//! packed rows, stride `2·Kp` bytes), `tmm6` and `tmm7` the two 1 KiB tiles of the
//! panel's block of `B` (stride 64 bytes), and four `TDPBF16PS` add their products.
//! Rust has no stable AMX intrinsics; the kernel is inline assembly, one `asm!` for a
//! block's whole depth (a chunk of up to 512 depths: `gemm` blocks over depth), so that
//! the tile data (which the compiler knows nothing of) lives in one `asm!`. The tile
//! configuration is loaded once per task ([`Tiles`]), not per block: it is state of the
//! thread, which compiled Rust code never touches.
//!
//! Linux hands a process the 8 KiB tile state only on request
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, once for every thread of the
//! process); until then an AMX instruction faults. [`available`] asks once.

use std::arch::asm;
use std::sync::OnceLock;

use super::{BLOCK, B_BLOCK};

/// The 64-byte tile configuration `LDTILECFG` reads (palette 1).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    /// Bytes per row of each tile.
    colsb: [u16; 16],
    /// Rows of each tile.
    rows: [u8; 16],
}

/// The tile configuration of the micro-kernel (eight 16 × 64-byte tiles), loaded into
/// this thread's tile state for as long as the guard lives and released when it drops:
/// `LDTILECFG` and `TILERELEASE` cost about as much as a block's products at short
/// depths, so a task configures once for all its blocks. Not `Send`: the
/// configuration belongs to the thread that loaded it.
pub(super) struct Tiles(std::marker::PhantomData<*const ()>);

impl Tiles {
    /// Loads the configuration.
    ///
    /// # Safety
    /// [`available`] returned true, and no other `Tiles` is alive on this thread (its
    /// drop would release the configuration under this one).
    pub(super) unsafe fn configure() -> Tiles {
        let mut cfg = TileConfig {
            palette: 1,
            start_row: 0,
            reserved: [0; 14],
            colsb: [0; 16],
            rows: [0; 16],
        };
        for t in 0..8 {
            cfg.colsb[t] = 64;
            cfg.rows[t] = 16;
        }
        // SAFETY: the CPU has AMX and the process the tile state (the caller's
        // contract); `cfg` is a valid palette-1 configuration, 64 bytes, aligned.
        unsafe { asm!("ldtilecfg [{cfg}]", cfg = in(reg) &cfg, options(nostack)) };
        Tiles(std::marker::PhantomData)
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: the configuration was loaded by this thread (`Tiles` is not `Send`);
        // releasing it touches no memory.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// Whether this CPU has AMX-BF16 and the kernel granted this process the tile state.
pub(super) fn available() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| {
        // CPUID leaf 7: EDX bit 22 AMX-BF16, bit 24 AMX-TILE.
        let l = std::arch::x86_64::__cpuid_count(7, 0);
        let cpu = (l.edx >> 22) & 1 == 1 && (l.edx >> 24) & 1 == 1;
        cpu && request_tile_state()
    })
}

/// `arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`: 0 when granted.
fn request_tile_state() -> bool {
    const SYS_ARCH_PRCTL: i64 = 158;
    const ARCH_REQ_XCOMP_PERM: u64 = 0x1023;
    const XFEATURE_XTILEDATA: u64 = 18;
    let ret: i64;
    // SAFETY: a plain system call that changes only this process's permission to use
    // the AMX state; it reads and writes no memory of ours. `syscall` clobbers rcx and
    // r11, declared below.
    unsafe {
        asm!(
            "syscall",
            inlateout("rax") SYS_ARCH_PRCTL => ret,
            in("rdi") ARCH_REQ_XCOMP_PERM,
            in("rsi") XFEATURE_XTILEDATA,
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret == 0
}

/// `C[32 × 32] = (C or 0) + A · B` for 32 packed rows of `A` (`a`: `depth` elements a
/// row, row stride `lda`) and a panel of packed `B` (`depth / 32` blocks); `C`
/// row-major at `c` with row stride `ldc` elements, read first when `accumulate`.
///
/// `tiles` is this thread's loaded configuration ([`Tiles::configure`]).
///
/// # Safety
/// [`available`] returned true; `depth` is a positive multiple of 32, at most `lda`;
/// `a` holds `31 · lda + depth` elements and `panel` `depth / 32 · B_BLOCK`; the 32 rows
/// of 32 f32 at `c`
/// (stride `ldc ≥ 32`) are valid for writes (and reads, initialised, when
/// `accumulate`) and nothing else accesses them during the call.
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn block(
    _tiles: &Tiles,
    a: &[u16],
    lda: usize,
    depth: usize,
    panel: &[u16],
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
) {
    debug_assert!(depth > 0 && depth.is_multiple_of(BLOCK) && depth <= lda && ldc >= BLOCK);
    debug_assert!(a.len() >= (BLOCK - 1) * lda + depth);
    debug_assert!(panel.len() >= depth / BLOCK * B_BLOCK);
    let (ap, bp) = (a.as_ptr(), panel.as_ptr());
    // The four quarters of `C`.
    // SAFETY: offsets inside the 32 × 32 block at `c` (the caller's contract).
    let (c1, c2, c3) = unsafe { (c.add(16), c.add(16 * ldc), c.add(16 * ldc + 16)) };
    macro_rules! kernel {
        ($($init:literal),*) => {
            // SAFETY: the caller's contract: every tile load reads 16 rows of 64 bytes
            // inside `a` (rows 0–31 at stride `lda`, bytes `64·q .. 64·q + 64` of each
            // row for block `q < depth / 32`) or inside `panel` (block `q`'s two 1 KiB
            // tiles); the quarters of `C` are 16 rows of 64 bytes at stride `4·ldc`
            // inside the caller's block. The tiles are configured by `Tiles`, which
            // this thread holds; every tile this block uses is loaded or zeroed here
            // before it is read.
            unsafe {
                asm!(
                    $($init,)*
                    "2:",
                    "tileloadd tmm4, [{a0} + {lda}*1]",
                    "tileloadd tmm5, [{a1} + {lda}*1]",
                    "tileloadd tmm6, [{b0} + {ldb}*1]",
                    "tileloadd tmm7, [{b1} + {ldb}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    "tdpbf16ps tmm1, tmm4, tmm7",
                    "tdpbf16ps tmm2, tmm5, tmm6",
                    "tdpbf16ps tmm3, tmm5, tmm7",
                    "add {a0}, 64",
                    "add {a1}, 64",
                    "add {b0}, 2048",
                    "add {b1}, 2048",
                    "dec {n}",
                    "jnz 2b",
                    "tilestored [{c0} + {ldc}*1], tmm0",
                    "tilestored [{c1} + {ldc}*1], tmm1",
                    "tilestored [{c2} + {ldc}*1], tmm2",
                    "tilestored [{c3} + {ldc}*1], tmm3",
                    a0 = inout(reg) ap => _,
                    a1 = inout(reg) ap.add(16 * lda) => _,
                    lda = in(reg) 2 * lda,
                    b0 = inout(reg) bp => _,
                    b1 = inout(reg) bp.add(512) => _,
                    ldb = in(reg) 64usize,
                    n = inout(reg) depth / BLOCK => _,
                    c0 = in(reg) c,
                    c1 = in(reg) c1,
                    c2 = in(reg) c2,
                    c3 = in(reg) c3,
                    ldc = in(reg) 4 * ldc,
                    options(nostack),
                )
            }
        };
    }
    match accumulate {
        true => kernel!(
            "tileloadd tmm0, [{c0} + {ldc}*1]",
            "tileloadd tmm1, [{c1} + {ldc}*1]",
            "tileloadd tmm2, [{c2} + {ldc}*1]",
            "tileloadd tmm3, [{c3} + {ldc}*1]"
        ),
        false => kernel!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3"
        ),
    }
}
