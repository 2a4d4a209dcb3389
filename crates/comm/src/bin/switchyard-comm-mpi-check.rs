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
//!   inputs that round. Rank 0 prints `conformance: ok on N ranks`.
//! * `exit-in-recv`, `exit-in-all-reduce`: rank 1 exits with status 3 while the other
//!   ranks wait for it in a receive or an all-reduce; `mpirun` must end the job.
//! * `signal-in-recv`: rank 1 dies of `SIGABRT` while the others wait for it.
//! * `error-abort`: rank 1's work fails and it calls `switchyard_comm::mpi::abort`.
//! * `timeout-recv`, `timeout-all-reduce`: rank 1 sleeps; the others time out (the
//!   timeout is `SWITCHYARD_COMM_TIMEOUT_SECS`), print the error and abort.
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
        "timeout-recv" | "timeout-all-reduce" => timeout_mode(&comm, &mode),
        other => Err(format!("unknown mode {other:?}")),
    };
    if let Err(e) = outcome {
        mpi::abort(1, &e);
    }
    // Dropping the last communicator finalises MPI.
    drop(comm);
}

fn conformance_mode(comm: &Arc<dyn Communicator>) -> Result<(), String> {
    conformance::run_all(&**comm)?;
    same_bits_as_local(comm)?;
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
    if comm.rank() == 1 {
        std::thread::sleep(Duration::from_secs(600));
        return Err("rank 1 was not stopped".into());
    }
    let x = Tensor::ones(4, DType::F32, &Device::Cpu).map_err(|e| e.to_string())?;
    let r = if mode == "timeout-recv" {
        comm.recv(1, 7).map(drop)
    } else {
        comm.all_reduce(&x, ReduceOp::Sum).map(drop)
    };
    match r {
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
