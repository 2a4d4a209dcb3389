//! Each worker computes on its own share of the cores, the way one GPU belongs to one
//! rank.
//!
//! The launcher runs every rank inside its own rayon pool, so any rayon parallelism in a
//! rank (switchyard's fused kernels, candle's gemm) stays on that rank's threads. The
//! default gives each of `w` workers `max(1, cores / w)` threads: one gemm thread per
//! worker once there are as many workers as cores.
//!
//! Two process-wide knobs of candle cannot be set per pool and are read from the
//! environment: `CANDLE_NUM_THREADS` sizes candle's shared element-wise pool, and
//! `RAYON_NUM_THREADS` is how many pieces candle cuts each matrix product into. The
//! `switchyard` binary sets both from the layout before it starts any thread, and this
//! repository's `.cargo/config.toml` sets `CANDLE_NUM_THREADS=1` for tests and benches, so
//! element-wise work runs on the calling worker instead of contending for one shared pool.

use crate::CommError;

/// The number of cores this process may use.
pub fn available_cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// The default compute threads per worker when `workers` ranks share this machine.
pub fn default_threads_per_worker(workers: usize) -> usize {
    (available_cores() / workers.max(1)).max(1)
}

/// A rayon pool of `threads` threads whose first thread is the calling thread, so that
/// the rank keeps running on the thread the launcher gave it.
pub fn worker_pool(threads: usize) -> crate::Result<rayon::ThreadPool> {
    worker_pool_charging(threads, None)
}

/// [`worker_pool`] whose threads charge their allocations to `ledger` (see
/// `switchyard-mem`), as the rank's own thread does.
pub fn worker_pool_charging(
    threads: usize,
    ledger: Option<switchyard_mem::LedgerId>,
) -> crate::Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .use_current_thread()
        .thread_name(|i| format!("switchyard-compute-{i}"))
        .start_handler(move |_| {
            if let Some(id) = ledger {
                // For the thread's whole life: the pool's threads are this rank's.
                std::mem::forget(id.enter());
            }
        })
        .build()
        .map_err(|e| CommError::Threads {
            threads,
            reason: e.to_string(),
        })
}
