//! A rank's communication thread: collectives that run beside the rank's own thread, over
//! a communicator split for the thread alone, so that its collectives never interleave
//! with the rank's (both sequences are the same on every member, which is all a
//! collective needs). ZeRO 3's prefetch ([`crate::zero::Prefetcher`]) and the overlapped
//! gradient all-reduce ([`crate::GradReducer`]) each own one.
//!
//! - **Jobs.** A job is a closure given the thread's communicator; it returns a
//!   [`Deliver`], which sends its result wherever its caller waits. The thread runs them
//!   in order, and counts a job done before it delivers, so that a caller that got every
//!   result finds the thread idle.
//! - **Memory.** The thread charges the ledger of the rank that made it, as
//!   communication buffers.
//! - **No hangs.** Dropped with a job in flight (its rank failed), the thread is left to
//!   end when that collective fails: the failure that ended the rank ends it too.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};
use switchyard_comm::Communicator;
use switchyard_mem::Category;

use crate::error::{Context, Result};

/// What the thread runs: a collective over its communicator, returning how to hand its
/// result over.
pub(crate) type Job = Box<dyn FnOnce(&dyn Communicator) -> Deliver + Send>;

/// A job's last part: sends its result to whoever waits for it.
pub(crate) type Deliver = Box<dyn FnOnce() + Send>;

/// One rank's communication thread.
pub(crate) struct CommThread {
    /// This rank's global rank, for errors.
    pub(crate) rank: usize,
    jobs: Option<Sender<Job>>,
    thread: Option<JoinHandle<()>>,
    in_flight: Arc<AtomicUsize>,
}

impl CommThread {
    /// Splits `group` for a thread named `switchyard-{name}` and starts it; `what` names
    /// it in errors. Collective over `group`.
    pub(crate) fn new(group: &dyn Communicator, name: &str, what: &str) -> Result<CommThread> {
        let comm = group
            .split_named(0, group.rank(), name)
            .with_context(|| format!("{what}: its group"))?;
        let (jobs, rx) = unbounded::<Job>();
        let ledger = switchyard_mem::current_ledger();
        let in_flight = Arc::new(AtomicUsize::new(0));
        let count = in_flight.clone();
        let thread = std::thread::Builder::new()
            .name(format!("switchyard-{name}"))
            .spawn(move || {
                let _ledger = ledger.map(|l| l.enter());
                let _comm = switchyard_mem::scope(Category::Comm);
                for job in rx {
                    let deliver = job(&*comm);
                    count.fetch_sub(1, Ordering::AcqRel);
                    deliver();
                }
            })
            .with_context(|| format!("{what}: starting it"))?;
        Ok(CommThread {
            rank: group.members()[group.rank()],
            jobs: Some(jobs),
            thread: Some(thread),
            in_flight,
        })
    }

    /// Queues `job`; `false` when the thread has ended (it panicked).
    pub(crate) fn run(&self, job: Job) -> bool {
        self.in_flight.fetch_add(1, Ordering::AcqRel);
        let jobs = self.jobs.as_ref().expect("open until dropped");
        let sent = jobs.send(job).is_ok();
        if !sent {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
        sent
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        // Closing the channel ends the thread's loop once it is idle; with a job in
        // flight (a failed step) it is left to end when that collective fails.
        drop(self.jobs.take());
        if let Some(t) = self.thread.take() {
            if self.in_flight.load(Ordering::Acquire) == 0 {
                let _ = t.join();
            }
        }
    }
}
