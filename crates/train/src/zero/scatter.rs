//! ZeRO 2 and 3's gradient reduce-scatters on a communication thread (issue 17 §3, with
//! `overlap_grad_reduce`): as a segment's backward of a microbatch ends, its bucket is
//! handed to the thread, which flattens and reduce-scatters it over a data-parallel group
//! of its own while the backward of the segment before it runs (DeepSpeed's
//! `overlap_comm`, FSDP's reduce-scatter stream).
//!
//! - **One in flight.** A segment's gradients wait for the thread until the next
//!   segment's backward ends, when the hooks take the finished shard and hand over the
//!   next bucket. The bucket in flight takes the place of the one the rank's own thread
//!   would flatten; what is more is the shard it returns, `1/dp` of a segment, until the
//!   rank adds it (the memory estimator counts it).
//! - **Same sums.** The thread runs the same reduce-scatter on the same bucket
//!   ([`super::scatter_bucket`]), and the hooks add each bucket's shards in the order of
//!   the microbatches, as without it: the shards are bit-identical (tested).
//! - **No hangs.** A failed reduce-scatter comes back as the error of the hook or of the
//!   step's wait that takes it, naming the bucket. A worker that fails with a bucket in
//!   flight leaves the thread to end when that collective fails
//!   ([`crate::comm_thread`]).

use std::collections::HashMap;

use candle_core::Tensor;
use crossbeam_channel::{bounded, Receiver};
use switchyard_comm::{CommError, Communicator};
use switchyard_mem::Category;

use super::{scatter_bucket, Bucket};
use crate::comm_thread::{CommThread, Deliver};
use crate::error::{IntoTrainError, Result};

/// The reduce-scatter thread of one rank.
pub struct Scatterer {
    thread: CommThread,
}

/// A bucket's reduce-scatter on the thread: its number and where its shard arrives.
pub struct InFlight {
    pub k: usize,
    rx: Receiver<Result<Tensor>>,
    rank: usize,
}

impl Scatterer {
    /// Splits `dp` for the thread and starts it; its allocations are charged to this
    /// thread's ledger. Collective over `dp`.
    pub fn new(dp: &dyn Communicator) -> Result<Scatterer> {
        Ok(Scatterer {
            thread: CommThread::new(
                dp,
                "zero-scatter",
                "ZeRO: the gradient reduce-scatter thread",
            )?,
        })
    }

    /// Starts reduce-scattering bucket `k` (`b`) from the gradients `mine` (by
    /// parameter index; a parameter without one counts zeros).
    pub fn start(&self, k: usize, b: Bucket, mut mine: HashMap<usize, Tensor>) -> Result<InFlight> {
        let (done, rx) = bounded(1);
        let scatter = move |comm: &dyn Communicator| -> Deliver {
            let shard = {
                let _gradients = switchyard_mem::scope(Category::Gradients);
                scatter_bucket(&b, comm, |p| mine.remove(&p))
            };
            drop(mine);
            // The hook that waited may be gone (its rank failed).
            Box::new(move || drop(done.send(shard)))
        };
        let rank = self.thread.rank;
        match self.thread.run(Box::new(scatter)) {
            true => Ok(InFlight { k, rx, rank }),
            false => Err(ended(rank, k)),
        }
    }
}

impl InFlight {
    /// Waits for the shard.
    pub fn wait(self) -> Result<Tensor> {
        let k = self.k;
        let what = || format!("ZeRO: the gradient reduce-scatter of bucket {k}");
        match self.rx.recv() {
            Ok(shard) => shard.map_err(|e| e.into_train_error(what())),
            Err(_) => Err(ended(self.rank, k)),
        }
    }
}

/// The thread is gone (it panicked): bucket `k`'s shard will not come.
fn ended(rank: usize, k: usize) -> crate::TrainError {
    let e = CommError::Backend {
        op: "reduce_scatter",
        rank,
        reason: "the gradient reduce-scatter thread has ended".into(),
    };
    crate::TrainError::from(e)
        .into_train_error(format!("ZeRO: the gradient reduce-scatter of bucket {k}"))
}
