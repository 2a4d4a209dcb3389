//! What the machine can do, measured for the bench's table: one core's peak FLOP/s (an
//! FMA loop in assembly, chosen by the CPU's features at run time) and the process's
//! peak resident memory.

/// The process's peak resident memory (Linux `VmHWM`), in MiB.
pub fn peak_rss_mib() -> Option<f64> {
    switchyard_train::peak_rss().map(|b| b as f64 / (1024.0 * 1024.0))
}

/// One core's peak f32 FLOP/s, in GFLOP/s: the best of several short runs of
/// independent AVX-512 fused multiply-adds (AVX2 + FMA without AVX-512; 0 when neither).
/// Contention from other processes can only lower a run, so the best is the estimate.
pub fn fma_peak_gflops() -> f64 {
    (0..15).map(|_| fma::run(2_000_000)).fold(0.0, f64::max)
}

mod fma {
    /// The peak loop a CPU can run.
    #[derive(Debug, PartialEq)]
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) enum Loop {
        /// 512-bit FMAs: needs AVX-512F (the loop enables exactly that).
        Avx512,
        /// 256-bit FMAs: needs AVX2 and FMA (the loop enables both).
        Avx2,
        None,
    }

    /// The loop for a CPU with these features: each loop only where every feature its
    /// `target_feature` enables is present.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) fn choose(avx512f: bool, avx2: bool, fma: bool) -> Loop {
        if avx512f {
            Loop::Avx512
        } else if avx2 && fma {
            Loop::Avx2
        } else {
            Loop::None
        }
    }

    /// GFLOP/s of `iters` rounds of 12 independent vector FMAs.
    pub fn run(iters: u64) -> f64 {
        #[cfg(target_arch = "x86_64")]
        {
            let t = std::time::Instant::now();
            let found = choose(
                std::is_x86_feature_detected!("avx512f"),
                std::is_x86_feature_detected!("avx2"),
                std::is_x86_feature_detected!("fma"),
            );
            let (flops, sink) = match found {
                // SAFETY: the CPU has AVX-512F.
                Loop::Avx512 => (iters * 12 * 32, unsafe { avx512(iters) }),
                // SAFETY: the CPU has AVX2 and FMA.
                Loop::Avx2 => (iters * 12 * 16, unsafe { avx2(iters) }),
                Loop::None => return 0.0,
            };
            std::hint::black_box(sink);
            flops as f64 / t.elapsed().as_secs_f64() / 1e9
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = iters;
            0.0
        }
    }

    /// `iters` rounds of 12 independent 512-bit FMAs (two per cycle on two FMA units with
    /// a latency of 4 need 8 in flight).
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn avx512(iters: u64) -> f32 {
        std::arch::asm!(
            "vxorps xmm0, xmm0, xmm0",
            "vxorps xmm1, xmm1, xmm1",
            "vxorps xmm2, xmm2, xmm2",
            "vxorps xmm3, xmm3, xmm3",
            "vxorps xmm4, xmm4, xmm4",
            "vxorps xmm5, xmm5, xmm5",
            "vxorps xmm6, xmm6, xmm6",
            "vxorps xmm7, xmm7, xmm7",
            "vxorps xmm8, xmm8, xmm8",
            "vxorps xmm9, xmm9, xmm9",
            "vxorps xmm10, xmm10, xmm10",
            "vxorps xmm11, xmm11, xmm11",
            "vbroadcastss zmm12, xmm0",
            "vbroadcastss zmm13, xmm0",
            "2:",
            "vfmadd231ps zmm0, zmm12, zmm13",
            "vfmadd231ps zmm1, zmm12, zmm13",
            "vfmadd231ps zmm2, zmm12, zmm13",
            "vfmadd231ps zmm3, zmm12, zmm13",
            "vfmadd231ps zmm4, zmm12, zmm13",
            "vfmadd231ps zmm5, zmm12, zmm13",
            "vfmadd231ps zmm6, zmm12, zmm13",
            "vfmadd231ps zmm7, zmm12, zmm13",
            "vfmadd231ps zmm8, zmm12, zmm13",
            "vfmadd231ps zmm9, zmm12, zmm13",
            "vfmadd231ps zmm10, zmm12, zmm13",
            "vfmadd231ps zmm11, zmm12, zmm13",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) iters.max(1) => _,
            out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
            out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
            out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
            out("zmm12") _, out("zmm13") _,
            options(nostack, nomem),
        );
        0.0
    }

    /// As [`avx512`] with 256-bit FMAs.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn avx2(iters: u64) -> f32 {
        std::arch::asm!(
            "vxorps xmm0, xmm0, xmm0",
            "vxorps xmm1, xmm1, xmm1",
            "vxorps xmm2, xmm2, xmm2",
            "vxorps xmm3, xmm3, xmm3",
            "vxorps xmm4, xmm4, xmm4",
            "vxorps xmm5, xmm5, xmm5",
            "vxorps xmm6, xmm6, xmm6",
            "vxorps xmm7, xmm7, xmm7",
            "vxorps xmm8, xmm8, xmm8",
            "vxorps xmm9, xmm9, xmm9",
            "vxorps xmm10, xmm10, xmm10",
            "vxorps xmm11, xmm11, xmm11",
            "vxorps xmm12, xmm12, xmm12",
            "vxorps xmm13, xmm13, xmm13",
            "2:",
            "vfmadd231ps ymm0, ymm12, ymm13",
            "vfmadd231ps ymm1, ymm12, ymm13",
            "vfmadd231ps ymm2, ymm12, ymm13",
            "vfmadd231ps ymm3, ymm12, ymm13",
            "vfmadd231ps ymm4, ymm12, ymm13",
            "vfmadd231ps ymm5, ymm12, ymm13",
            "vfmadd231ps ymm6, ymm12, ymm13",
            "vfmadd231ps ymm7, ymm12, ymm13",
            "vfmadd231ps ymm8, ymm12, ymm13",
            "vfmadd231ps ymm9, ymm12, ymm13",
            "vfmadd231ps ymm10, ymm12, ymm13",
            "vfmadd231ps ymm11, ymm12, ymm13",
            "dec {n}",
            "jnz 2b",
            n = inout(reg) iters.max(1) => _,
            out("ymm0") _, out("ymm1") _, out("ymm2") _, out("ymm3") _,
            out("ymm4") _, out("ymm5") _, out("ymm6") _, out("ymm7") _,
            out("ymm8") _, out("ymm9") _, out("ymm10") _, out("ymm11") _,
            out("ymm12") _, out("ymm13") _,
            options(nostack, nomem),
        );
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FMA without AVX2 (or AVX2 without FMA) must not run the loop compiled for both.
    #[test]
    fn the_peak_loop_runs_only_with_every_feature_it_enables() {
        use fma::{choose, Loop};
        assert_eq!(choose(false, false, true), Loop::None);
        assert_eq!(choose(false, true, false), Loop::None);
        assert_eq!(choose(false, true, true), Loop::Avx2);
        assert_eq!(choose(true, false, false), Loop::Avx512);
        assert_eq!(choose(false, false, false), Loop::None);
    }
}
