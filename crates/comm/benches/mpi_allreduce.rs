//! All-reduce bandwidth: the MPI backend beside the in-process backend, 2 ranks, same
//! sizes (4 KiB … 64 MiB of f32), same run.
//!
//! ```text
//! cargo bench -p switchyard-comm --features mpi --bench mpi_allreduce
//! ```
//!
//! Started without `mpirun`, the bench starts itself again under
//! `mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2` (set `MPIRUN` to use
//! another launcher). Under MPI, rank 0 first times the in-process backend (2 threads
//! in this one process, while rank 1 waits), then both processes time the MPI backend and,
//! for reference, OpenMPI's own `MPI_Allreduce` (which does not reduce in rank order).
//! Rank 0 prints a Markdown table; `docs/PERFORMANCE.md` records it.
//!
//! Bandwidth is the buffer size divided by the time of one all-reduce (the slowest
//! rank's), as in `benches/comm.rs` of the workspace. Each figure is the best of
//! [`REPEATS`] timed runs, so that other work on a shared machine shows less.

use std::hint::black_box;
use std::process::{exit, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor};
use switchyard_comm::local::Launcher;
use switchyard_comm::{mpi, Communicator, ReduceOp};

/// Timed runs per figure; the fastest counts.
const REPEATS: usize = 3;
const SIZES: [usize; 5] = [4 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20];

fn label(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

/// Iterations per size: about 256 MiB reduced, at least 10, at most 2000.
fn iters(bytes: usize) -> u32 {
    ((256usize << 20) / bytes).clamp(10, 2000) as u32
}

fn input(bytes: usize, rank: usize) -> Tensor {
    Tensor::full(rank as f32 + 0.5, bytes / 4, &Device::Cpu).expect("input")
}

fn gbps(bytes: usize, per_op: Duration) -> f64 {
    bytes as f64 / per_op.as_secs_f64() / 1e9
}

/// The in-process backend, 2 threads, one core each.
fn local_time(bytes: usize) -> Duration {
    let n = iters(bytes);
    let times = Launcher::new(2)
        .threads_per_worker(1)
        .run(|comm| {
            let x = input(bytes, comm.rank());
            black_box(comm.all_reduce(&x, ReduceOp::Sum)?);
            comm.barrier()?;
            let t = Instant::now();
            for _ in 0..n {
                black_box(comm.all_reduce(&x, ReduceOp::Sum)?);
            }
            Ok::<_, switchyard_comm::CommError>(t.elapsed())
        })
        .expect("in-process run");
    times.into_iter().max().unwrap() / n
}

/// The slowest rank's time per operation of `op`, run `iters(bytes)` times.
fn mpi_time(comm: &Arc<dyn Communicator>, bytes: usize, mut op: impl FnMut()) -> Duration {
    let n = iters(bytes);
    op();
    op();
    comm.barrier().expect("barrier");
    let t = Instant::now();
    for _ in 0..n {
        op();
    }
    let mine = t.elapsed().as_secs_f64();
    let all = Tensor::new(&[mine], &Device::Cpu).expect("time");
    let slowest = comm.all_reduce(&all, ReduceOp::Max).expect("max");
    Duration::from_secs_f64(slowest.to_vec1::<f64>().expect("time")[0]) / n
}

/// OpenMPI's own blocking MPI_Allreduce (MPI_SUM over floats), for reference.
fn native_all_reduce(send: &[f32], recv: &mut [f32]) {
    // SAFETY: both buffers hold `send.len()` floats; MPI is initialised.
    let rc = unsafe {
        ::mpi::ffi::MPI_Allreduce(
            send.as_ptr() as *const std::ffi::c_void,
            recv.as_mut_ptr() as *mut std::ffi::c_void,
            send.len() as std::ffi::c_int,
            ::mpi::ffi::RSMPI_FLOAT,
            ::mpi::ffi::RSMPI_SUM,
            ::mpi::ffi::RSMPI_COMM_WORLD,
        )
    };
    assert_eq!(rc, 0, "MPI_Allreduce failed");
}

fn relaunch() -> ! {
    let exe = std::env::current_exe().expect("own path");
    let mpirun = std::env::var("MPIRUN").unwrap_or_else(|_| "mpirun".into());
    let status = Command::new(&mpirun)
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "--bind-to",
            "none",
            "-np",
            "2",
        ])
        .arg(exe)
        .args(std::env::args().skip(1))
        .status()
        .unwrap_or_else(|e| {
            eprintln!("cannot start {mpirun} ({e}): install OpenMPI with scripts/install-mpi.sh");
            exit(1)
        });
    exit(status.code().unwrap_or(1))
}

fn main() {
    if mpi::launcher_size().is_none() {
        relaunch();
    }
    let comm = mpi::init().unwrap_or_else(|e| mpi::abort(1, &e.to_string()));
    let rank = comm.rank();
    if comm.world_size() != 2 {
        mpi::abort(1, "run this bench with 2 ranks");
    }
    let mut rows = Vec::new();
    for &bytes in &SIZES {
        // The in-process job runs inside rank 0 while rank 1 waits at the barrier.
        let local = (rank == 0).then(|| (0..REPEATS).map(|_| local_time(bytes)).min().unwrap());
        comm.barrier().expect("barrier");
        let x = input(bytes, rank);
        let ours = (0..REPEATS)
            .map(|_| {
                mpi_time(&comm, bytes, || {
                    black_box(comm.all_reduce(&x, ReduceOp::Sum).expect("all_reduce"));
                })
            })
            .min()
            .unwrap();
        let send = x.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let mut recv = vec![0f32; send.len()];
        let native = (0..REPEATS)
            .map(|_| mpi_time(&comm, bytes, || native_all_reduce(&send, &mut recv)))
            .min()
            .unwrap();
        rows.push((bytes, local, ours, native));
    }
    if rank == 0 {
        println!("| size | in-process (GB/s) | MPI backend (GB/s) | MPI_Allreduce (GB/s) | MPI backend (µs/op) |");
        println!("|---:|---:|---:|---:|---:|");
        for (bytes, local, ours, native) in rows {
            println!(
                "| {} | {:.2} | {:.2} | {:.2} | {:.0} |",
                label(bytes),
                gbps(bytes, local.unwrap()),
                gbps(bytes, ours),
                gbps(bytes, native),
                ours.as_secs_f64() * 1e6
            );
        }
    }
    drop(comm);
}
