//! Checks the MPI backend under `mpirun`; `crates/comm/tests/mpi.rs` runs it.
//!
//! ```text
//! mpirun -np 4 switchyard-comm-mpi-check [MODE]
//! ```
//!
//! Modes:
//!
//! * `conformance` (the default): the backend-generic conformance suite on the MPI
//!   world, then a check that all-reduce is bit-identical to the in-process backend's on
//!   inputs that round, and checks the suite does not cover: tags beyond MPI's tag
//!   range, large messages sent both ways before either side receives, and two threads
//!   using two groups at once. Rank 0 prints `conformance: ok on N ranks`.
//! * `exit-in-recv`, `exit-in-all-reduce`: rank 1 exits with status 3 while the other
//!   ranks wait for it in a receive or an all-reduce; `mpirun` must end the job.
//! * `signal-in-recv`: rank 1 dies of `SIGABRT` while the others wait for it.
//! * `error-abort`: rank 1's work fails and it calls `switchyard_comm::mpi::abort`.
//! * `timeout-recv`, `timeout-all-reduce`: rank 1 sleeps; the others time out (the
//!   timeout is `SWITCHYARD_COMM_TIMEOUT_SECS`), print the error and abort.
//! * `timeout-then-return`: as `timeout-recv`, but the waiting ranks then return
//!   normally instead of aborting: a failed process must not finalise, so mpirun still
//!   ends the job with an error.
//! * `leave-early`: rank 1 finishes (and finalises) at once while the others wait to
//!   receive from it: they time out and abort.
//! * `lifetime`: a second `init` shares the world; MPI is finalised when the last
//!   communicator is dropped, and `init` afterwards is an error.

use std::process::exit;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};
use switchyard_comm::{conformance, local, mpi, Communicator, ReduceOp};

fn main() {
    let mode = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "conformance".into());
    if mode == "lifetime" {
        return lifetime_mode().unwrap_or_else(|e| mpi::abort(1, &e));
    }
    let comm = match mpi::init() {
        Ok(c) => c,
        Err(e) => mpi::abort(1, &format!("MPI init: {e}")),
    };
    let outcome = match mode.as_str() {
        "conformance" => conformance_mode(&comm),
        "exit-in-recv" | "exit-in-all-reduce" | "signal-in-recv" => exit_mode(&comm, &mode),
        "error-abort" => error_mode(&comm),
        "timeout-recv" | "timeout-all-reduce" | "leave-early" | "timeout-then-return" => {
            timeout_mode(&comm, &mode)
        }
        other => Err(format!("unknown mode {other:?}")),
    };
    if let Err(e) = outcome {
        mpi::abort(1, &e);
    }
    // Dropping the last communicator finalises MPI.
    drop(comm);
}

fn conformance_mode(comm: &Arc<dyn Communicator>) -> Result<(), String> {
    conformance::run_all(&**comm).map_err(|e| e.to_string())?;
    same_bits_as_local(comm)?;
    wide_tags(comm)?;
    shapes_that_differ(comm)?;
    eager_exchange(comm)?;
    concurrent_groups(comm)?;
    comm.barrier().map_err(|e| e.to_string())?;
    if comm.rank() == 0 {
        println!("conformance: ok on {} ranks", comm.world_size());
    }
    Ok(())
}

/// Inputs whose sums round, so that the reduction order shows in the bits.
fn rounding_input(rank: usize, len: usize, dtype: DType) -> Tensor {
    let v: Vec<f64> = (0..len)
        .map(|i| ((rank * 7919 + i * 104_729) % 1000) as f64 / 7.0 + 1e-3 * rank as f64)
        .collect();
    Tensor::from_vec(v, len, &Device::Cpu)
        .and_then(|t| t.to_dtype(dtype))
        .expect("input")
}

fn bits(t: &Tensor) -> Vec<u64> {
    let t = t.to_dtype(DType::F64).unwrap().to_vec1::<f64>().unwrap();
    t.into_iter().map(f64::to_bits).collect()
}

/// MPI's all-reduce equals the in-process backend's bit for bit (small and large path,
/// every op), and all-gather / reduce-scatter of the same inputs agree too.
fn same_bits_as_local(comm: &Arc<dyn Communicator>) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    for len in [5usize, 100_003] {
        for dtype in [DType::F32, DType::F64, DType::BF16] {
            for op in [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max] {
                let got = comm
                    .all_reduce(&rounding_input(r, len, dtype), op)
                    .map_err(|e| e.to_string())?;
                let want = local::Launcher::new(n)
                    .threads_per_worker(1)
                    .run(|c| c.all_reduce(&rounding_input(c.rank(), len, dtype), op))
                    .map_err(|e| e.to_string())?;
                if bits(&got) != bits(&want[0]) {
                    return Err(format!(
                        "all_reduce {op:?} of {len} {dtype:?} differs from the in-process backend"
                    ));
                }
            }
        }
    }
    Ok(())
}

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

/// Tags far beyond MPI_TAG_UB (they fold onto MPI tags), sent in one order and received
/// in another.
fn wide_tags(comm: &Arc<dyn Communicator>) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let tags = [5u64, (1 << 31) + 5, (1 << 32) + 5, u64::MAX, 1 << 40];
    for (i, &tag) in tags.iter().enumerate() {
        let t = Tensor::new(&[r as f64, i as f64], &Device::Cpu).map_err(err)?;
        comm.send(&t, next, tag).map_err(err)?;
    }
    for (i, &tag) in tags.iter().enumerate().rev() {
        let got = comm
            .recv(prev, tag)
            .map_err(err)?
            .to_vec1::<f64>()
            .map_err(err)?;
        if got != [prev as f64, i as f64] {
            return Err(format!("tag {tag}: got {got:?} from rank {prev}"));
        }
    }
    Ok(())
}

/// Broadcast to ranks that pass any tensor at all; an all-reduce whose sizes differ
/// across the one-round (small) and two-round paths fails on every rank.
fn shapes_that_differ(comm: &Arc<dyn Communicator>) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let root = n - 1;
    let mine = if r == root {
        Tensor::arange(0f64, 3000.0, &Device::Cpu).and_then(|t| t.reshape((30, 100)))
    } else {
        Tensor::zeros(1, DType::U8, &Device::Cpu)
    };
    let got = comm.broadcast(&mine.map_err(err)?, root).map_err(err)?;
    if got.dims() != [30, 100] || got.dtype() != DType::F64 {
        return Err(format!("broadcast gave {:?} {:?}", got.dims(), got.dtype()));
    }
    if n > 1 {
        let len = if r == 0 { 4 } else { 100_000 };
        let x = Tensor::ones(len, DType::F32, &Device::Cpu).map_err(err)?;
        match comm.all_reduce(&x, ReduceOp::Sum) {
            Err(switchyard_comm::CommError::Mismatch { .. }) => {}
            other => return Err(format!("mixed-size all_reduce: {other:?}")),
        }
    }
    Ok(())
}

/// Every rank sends 8 MiB to every other rank before receiving anything: sends must not
/// wait for their receives.
fn eager_exchange(comm: &Arc<dyn Communicator>) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let len = 2 << 20;
    for d in (0..n).filter(|&d| d != r) {
        let t = Tensor::full((r * n + d) as f32, len, &Device::Cpu).map_err(err)?;
        comm.send(&t, d, 77).map_err(err)?;
    }
    for s in (0..n).filter(|&s| s != r) {
        let got = comm.recv(s, 77).map_err(err)?;
        let v = got.to_vec1::<f32>().map_err(err)?;
        if v.len() != len || v.iter().any(|&x| x != (s * n + r) as f32) {
            return Err(format!("eager exchange: wrong data from rank {s}"));
        }
    }
    Ok(())
}

/// One thread all-reduces in one group while another passes messages in another.
fn concurrent_groups(comm: &Arc<dyn Communicator>) -> Result<(), String> {
    let (r, n) = (comm.rank(), comm.world_size());
    let a = comm.split_named(0, r, "a").map_err(err)?;
    let b = comm.split_named(0, r, "b").map_err(err)?;
    std::thread::scope(|s| {
        let reducer = s.spawn(|| -> Result<(), String> {
            for i in 0..50 {
                let x = Tensor::full(i as f32, 1000, &Device::Cpu).map_err(err)?;
                let y = a.all_reduce(&x, ReduceOp::Sum).map_err(err)?;
                if y.to_vec1::<f32>().map_err(err)?[999] != (i * n) as f32 {
                    return Err("concurrent all_reduce: wrong sum".into());
                }
            }
            Ok(())
        });
        let ring = s.spawn(|| -> Result<(), String> {
            for i in 0..50u64 {
                let x = Tensor::new(&[i as f32], &Device::Cpu).map_err(err)?;
                b.send(&x, (r + 1) % n, i).map_err(err)?;
                let got = b.recv((r + n - 1) % n, i).map_err(err)?;
                if got.to_vec1::<f32>().map_err(err)? != [i as f32] {
                    return Err("concurrent ring: wrong message".into());
                }
            }
            Ok(())
        });
        reducer
            .join()
            .map_err(|_| "reducer panicked".to_string())??;
        ring.join().map_err(|_| "ring panicked".to_string())?
    })
}

fn exit_mode(comm: &Arc<dyn Communicator>, mode: &str) -> Result<(), String> {
    if comm.rank() == 1 {
        std::thread::sleep(Duration::from_millis(300));
        if mode == "signal-in-recv" {
            eprintln!("rank 1: aborting (SIGABRT) in the middle of the job");
            std::process::abort();
        }
        eprintln!("rank 1: exiting with status 3 in the middle of the job");
        exit(3);
    }
    let x = Tensor::ones(4, DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    let r = if mode != "exit-in-all-reduce" {
        comm.recv(1, 0).map(drop)
    } else {
        comm.all_reduce(&x, ReduceOp::Sum).map(drop)
    };
    // mpirun should have killed this process before the wait ends.
    Err(format!("rank {}: the wait returned: {r:?}", comm.rank()))
}

fn error_mode(comm: &Arc<dyn Communicator>) -> Result<(), String> {
    if comm.rank() == 1 {
        std::thread::sleep(Duration::from_millis(300));
        let work: Result<(), String> = Err("the loss is NaN at step 3".into());
        if let Err(e) = work {
            mpi::abort(2, &e);
        }
    }
    let x = Tensor::ones(4, DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    let r = comm.all_reduce(&x, ReduceOp::Sum);
    Err(format!(
        "rank {}: the all_reduce returned: {r:?}",
        comm.rank()
    ))
}

fn timeout_mode(comm: &Arc<dyn Communicator>, mode: &str) -> Result<(), String> {
    if comm.rank() == 1 && mode == "leave-early" {
        return Ok(());
    }
    if comm.rank() == 1 {
        std::thread::sleep(Duration::from_secs(600));
        return Err("rank 1 was not stopped".into());
    }
    let x = Tensor::ones(4, DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    let r = if mode != "timeout-all-reduce" {
        comm.recv(1, 7).map(drop)
    } else {
        comm.all_reduce(&x, ReduceOp::Sum).map(drop)
    };
    match r {
        Err(e @ switchyard_comm::CommError::Timeout { .. }) if mode == "timeout-then-return" => {
            eprintln!("rank {}: {e}; returning from main", comm.rank());
            Ok(())
        }
        Err(e @ switchyard_comm::CommError::Timeout { .. }) => {
            // Later operations refuse to run instead of waiting again.
            let again = comm.barrier();
            mpi::abort(
                4,
                &format!(
                    "{e} (then: {})",
                    again.err().map(|e| e.to_string()).unwrap_or_default()
                ),
            )
        }
        other => Err(format!("expected a timeout, got {other:?}")),
    }
}

fn lifetime_mode() -> Result<(), String> {
    let world = mpi::init().map_err(|e| e.to_string())?;
    let again = mpi::init().map_err(|e| e.to_string())?;
    if again.world_size() != world.world_size() || again.rank() != world.rank() {
        return Err("a second init gave a different world".into());
    }
    let tp = world
        .split_named(0, world.rank(), "tp")
        .map_err(|e| e.to_string())?;
    drop((world, again));
    // The group still works: it holds the runtime.
    let x = Tensor::ones(2, DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    let s = tp
        .all_reduce(&x, ReduceOp::Sum)
        .map_err(|e| e.to_string())?;
    let want = tp.world_size() as f32;
    if s.to_vec1::<f32>().map_err(|e| e.to_string())? != vec![want; 2] {
        return Err("all_reduce in a group that outlived the world".into());
    }
    let rank = tp.rank();
    drop(tp); // MPI_Finalize
    match mpi::init() {
        Err(e) if e.to_string().contains("cannot be initialised twice") => {}
        Err(e) => return Err(format!("init after finalize: wrong error: {e}")),
        Ok(_) => return Err("init after finalize succeeded".into()),
    }
    if rank == 0 {
        println!("lifetime: ok");
    }
    Ok(())
}
