//! The subcommands of `switchyard`.

pub mod bench;
mod interrupt;
pub mod model;
pub mod plan;
mod resume;
pub mod schedule;
pub mod train;

/// candle reads two thread counts from the environment, once per process (see
/// `switchyard_comm::threads`). Each worker computes on its own rayon pool, so candle's
/// shared element-wise pool is kept to one thread. Runs before any thread starts.
pub fn configure_threads_env() {
    if std::env::var_os("CANDLE_NUM_THREADS").is_none() {
        std::env::set_var("CANDLE_NUM_THREADS", "1");
    }
}

/// Sets how many pieces candle cuts each matrix product into: the threads each of
/// `workers` workers gets. Call before the workers start.
pub fn set_gemm_threads(threads_per_worker: usize) {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", threads_per_worker.max(1).to_string());
    }
}
