//! ZeRO 3's prefetch: the next segment's parameters are all-gathered on a communication
//! thread while the current segment computes (FSDP's `forward_prefetch` and
//! `backward_prefetch`, DeepSpeed's `stage3_prefetch_bucket_size`).
//!
//! - **Its own group.** The thread all-gathers over a communicator split from the
//!   data-parallel group for it alone, so its collectives never interleave with the main
//!   thread's (the gradients' reduce-scatters, the pipeline's tensor-parallel ones).
//!   Both sequences are the same on every replica, which is all a collective needs.
//! - **Which segment is next.** The executor acquires the segments of a step in program
//!   order, the same every step. The first step records the order of the buckets it
//!   gathers; later steps start the gather of entry `j + 1` as soon as entry `j` is in
//!   the variables, and the first entry's as the step starts. A step whose order
//!   differs from the recorded one (it cannot today) drops the prefetched bucket and
//!   gathers synchronously until the step ends: every replica diverges at the same
//!   point, so the groups stay matched.
//! - **Memory.** One bucket is in flight at a time: the gathered next segment, a
//!   communication buffer charged to the rank's ledger, next to the current segment's
//!   parameters.
//! - **No hangs.** A failed gather comes back as the error of the acquire that waits
//!   for it. A worker that ends with a gather in flight (another rank failed) leaves
//!   the thread to finish on its own: the failure that ended the worker ends the gather.

use std::sync::Mutex;

use candle_core::Tensor;
use crossbeam_channel::{bounded, Receiver};
use switchyard_comm::Communicator;

use super::ShardedAdamW;
use crate::comm_thread::{CommThread, Deliver};
use crate::error::{Context, IntoTrainError, Result};

/// The communication thread of one rank and the order of the buckets it gathers.
pub struct Prefetcher {
    thread: CommThread,
    /// The buckets the last step gathered, in order (empty before the first step).
    order: Mutex<Vec<usize>>,
}

impl Prefetcher {
    /// Splits `dp` for the thread and starts it; its allocations are charged to this
    /// thread's ledger. Collective over `dp`.
    pub fn new(dp: &dyn Communicator) -> Result<Prefetcher> {
        Ok(Prefetcher {
            thread: CommThread::new(dp, "prefetch", "ZeRO 3: the prefetch thread")?,
            order: Mutex::new(Vec::new()),
        })
    }

    /// Starts all-gathering `shard` (bucket `k`'s).
    fn start(&self, k: usize, shard: Tensor) -> Result<Pending> {
        let (done, rx) = bounded(1);
        let rank = self.thread.rank;
        let gather = move |comm: &dyn Communicator| -> Deliver {
            let full = comm.all_gather(&shard, 0);
            drop(shard);
            // The acquire that waited may be gone (its rank failed).
            Box::new(move || drop(done.send(full)))
        };
        if !self.thread.run(Box::new(gather)) {
            return Err(ended(rank, k));
        }
        Ok(Pending { k, rank, rx })
    }

    /// The state of one step: the order recorded by the last one.
    pub fn step<'p>(&'p self, opt: &ShardedAdamW) -> Result<Step<'p>> {
        let expected = self.order.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let mut s = Step {
            prefetcher: self,
            expected,
            seen: Vec::new(),
            pending: None,
            diverged: false,
        };
        if let Some(&k) = s.expected.first() {
            s.start(opt, k)?;
        }
        Ok(s)
    }
}

/// A gather in flight.
struct Pending {
    k: usize,
    rank: usize,
    rx: Receiver<std::result::Result<Tensor, switchyard_comm::CommError>>,
}

impl Pending {
    fn wait(self) -> Result<Tensor> {
        match self.rx.recv() {
            Ok(r) => r.with_context(|| format!("ZeRO 3: prefetching bucket {}", self.k)),
            Err(_) => Err(ended(self.rank, self.k)),
        }
    }
}

/// The thread is gone (it panicked): the gather of bucket `k` will not come.
fn ended(rank: usize, k: usize) -> crate::TrainError {
    let e = switchyard_comm::CommError::Backend {
        op: "all_gather",
        rank,
        reason: "the prefetch thread has ended".into(),
    };
    crate::TrainError::from(e).into_train_error(format!("ZeRO 3: prefetching bucket {k}"))
}

/// One step's prefetching (inside [`super::ZeroHooks`]).
pub struct Step<'p> {
    prefetcher: &'p Prefetcher,
    /// The order the last step gathered in.
    expected: Vec<usize>,
    /// The buckets this step gathered so far.
    seen: Vec<usize>,
    pending: Option<Pending>,
    /// This step left the expected order: no more prefetching.
    diverged: bool,
}

impl Step<'_> {
    fn start(&mut self, opt: &ShardedAdamW, k: usize) -> Result<()> {
        if let Some(shard) = opt.held_shard(k)? {
            self.pending = Some(self.prefetcher.start(k, shard)?);
        }
        Ok(())
    }

    /// Bucket `k`'s parameters into its variables: the prefetched gather when it is
    /// `k`'s, a gather over `dp` otherwise; then starts the next one's.
    pub fn gather(&mut self, opt: &ShardedAdamW, dp: &dyn Communicator, k: usize) -> Result<()> {
        let j = self.seen.len();
        self.seen.push(k);
        let prefetched = match self.pending.take() {
            Some(p) => {
                let same = p.k == k;
                let full = p.wait()?;
                same.then_some(full)
            }
            None => None,
        };
        match prefetched {
            Some(full) => {
                opt.fill(k, &full)?;
                drop(full);
            }
            None => opt.gather(dp, k)?,
        }
        if self.expected.get(j) != Some(&k) {
            self.diverged = true;
        }
        if !self.diverged {
            if let Some(&next) = self.expected.get(j + 1) {
                self.start(opt, next)?;
            }
        }
        Ok(())
    }

    /// Ends the step: waits for a gather still in flight (none when the order held) and
    /// records this step's order for the next.
    pub fn finish(mut self) -> Result<()> {
        if let Some(p) = self.pending.take() {
            p.wait()?;
        }
        *self
            .prefetcher
            .order
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = std::mem::take(&mut self.seen);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};
    use switchyard_comm::{local, Counting};

    use super::*;
    use crate::optim::AdamWConfig;
    use crate::zero::Layout;

    /// Three one-parameter buckets on two replicas, parameter `p` holding `100·p + i` at
    /// element `i`; each step gathers them in `orders[step]` and reads what the
    /// variables hold. Returns, per replica, the values read and the all-gathers of the
    /// main group and of the prefetch thread's.
    fn run(orders: &[&[usize]]) -> Vec<(Vec<Vec<f32>>, usize, usize)> {
        let orders: Vec<Vec<usize>> = orders.iter().map(|o| o.to_vec()).collect();
        local::launch(2, |world| -> Result<_> {
            let (world, counts) = Counting::wrap_groups(world);
            let dp = world.split_named(0, world.rank(), "dp")?;
            let sizes = [6, 4, 8];
            let vars: Vec<Var> = sizes
                .iter()
                .enumerate()
                .map(|(p, &n)| {
                    let v: Vec<f32> = (0..n).map(|i| (100 * p + i) as f32).collect();
                    Var::from_tensor(&Tensor::from_vec(v, n, &Device::Cpu)?)
                })
                .collect::<candle_core::Result<_>>()?;
            let layout =
                Layout::of_groups(vec![vec![0], vec![1], vec![2]], &sizes, &[], 2, dp.rank());
            let mut opt = ShardedAdamW::new(vars.clone(), AdamWConfig::default(), layout);
            opt.shard_params()?;
            let prefetcher = Prefetcher::new(&*dp)?;
            let mut read = Vec::new();
            for order in &orders {
                let mut step = prefetcher.step(&opt)?;
                for &k in order {
                    step.gather(&opt, &*dp, k)?;
                    read.push(vars[k].as_tensor().to_vec1::<f32>()?);
                    opt.release(k)?;
                }
                step.finish()?;
            }
            let t = |g: &str| counts.traffic(g, "all_gather").calls;
            Ok((read, t("dp"), t("dp/prefetch")))
        })
        .unwrap()
    }

    #[test]
    fn a_step_that_leaves_the_recorded_order_gathers_the_rest_itself() {
        let want =
            |k: usize, n: usize| -> Vec<f32> { (0..n).map(|i| (100 * k + i) as f32).collect() };
        let n = [6, 4, 8];
        // Recorded 0 1 2; the second step follows it, the third leaves it after one.
        let got = run(&[&[0, 1, 2], &[0, 1, 2], &[0, 2, 1]]);
        for (read, main, ahead) in got {
            let order = [0, 1, 2, 0, 1, 2, 0, 2, 1];
            for (r, &k) in read.iter().zip(&order) {
                assert_eq!(*r, want(k, n[k]), "bucket {k}");
            }
            // Step 1: all three on the main group. Step 2: all three prefetched.
            // Step 3: 0 prefetched (the first entry, at the step's start); 2 is not
            // the recorded 1: the prefetched 1 is dropped, 2 and then 1 are gathered
            // on the main group.
            assert_eq!((main, ahead), (3 + 2, 3 + 2));
        }
    }
}
