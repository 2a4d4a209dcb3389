//! The world of one launch (failure state, mailboxes, groups), the launcher, and the
//! [`Communicator`] implementation.

use std::any::Any;
use std::collections::HashMap;
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use candle_core::Tensor;
use crossbeam_channel::{unbounded, Receiver, Sender};

use super::comm::LocalComm;
use super::group::Group;
use crate::{threads, CommError, Communicator, Peer, Result, Tag};

/// How a rank failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureKind {
    /// The rank's closure returned an error.
    Error,
    /// The rank's closure panicked.
    Panic,
}

/// One rank's failure, as reported by the launcher.
#[derive(Debug, Clone)]
pub struct RankFailure {
    pub rank: usize,
    pub kind: FailureKind,
    pub message: String,
}

impl fmt::Display for RankFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            FailureKind::Error => write!(f, "rank {} failed: {}", self.rank, self.message),
            FailureKind::Panic => write!(f, "rank {} panicked: {}", self.rank, self.message),
        }
    }
}

/// The failure of a launch: the first rank that failed, and what happened to the others.
#[derive(Debug, Clone)]
pub struct LaunchError {
    /// The first failure (the cause; later failures are usually its consequences).
    pub first: RankFailure,
    /// Every other rank that failed, in rank order.
    pub others: Vec<RankFailure>,
}

impl fmt::Display for LaunchError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.first)?;
        if !self.others.is_empty() {
            write!(
                f,
                " ({} other rank(s) stopped as a result)",
                self.others.len()
            )?;
        }
        Ok(())
    }
}

impl std::error::Error for LaunchError {}

type Mailbox = Mutex<HashMap<(u64, usize, Tag), (Sender<Tensor>, Receiver<Tensor>)>>;

/// Everything the ranks of one launch share.
pub(crate) struct World {
    pub timeout: Duration,
    failure: Mutex<Option<RankFailure>>,
    aborted: AtomicBool,
    abort_tx: Mutex<Option<Sender<()>>>,
    pub(crate) abort_rx: Receiver<()>,
    exit_tx: Vec<Mutex<Option<Sender<()>>>>,
    pub(crate) exit_rx: Vec<Receiver<()>>,
    exited: Vec<AtomicBool>,
    /// Per destination rank: one channel per (context, source, tag).
    mailboxes: Vec<Mailbox>,
    groups: Mutex<Vec<Weak<Group>>>,
    next_ctx: AtomicU64,
}

impl World {
    fn new(size: usize, timeout: Duration) -> World {
        let (abort_tx, abort_rx) = unbounded();
        let (exit_tx, exit_rx): (Vec<_>, Vec<_>) = (0..size)
            .map(|_| {
                let (t, r) = unbounded();
                (Mutex::new(Some(t)), r)
            })
            .unzip();
        World {
            timeout,
            failure: Mutex::new(None),
            aborted: AtomicBool::new(false),
            abort_tx: Mutex::new(Some(abort_tx)),
            abort_rx,
            exit_tx,
            exit_rx,
            exited: (0..size).map(|_| AtomicBool::new(false)).collect(),
            mailboxes: (0..size).map(|_| Mutex::new(HashMap::new())).collect(),
            groups: Mutex::new(Vec::new()),
            next_ctx: AtomicU64::new(0),
        }
    }

    pub fn new_group(&self, name: String, members: Vec<usize>) -> Arc<Group> {
        let ctx = self.next_ctx.fetch_add(1, Ordering::Relaxed);
        let g = Arc::new(Group::new(name, members, ctx));
        let mut groups = lock(&self.groups);
        groups.retain(|w| w.strong_count() > 0);
        groups.push(Arc::downgrade(&g));
        g
    }

    pub fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::Acquire)
    }

    pub fn has_exited(&self, global: usize) -> bool {
        self.exited[global].load(Ordering::Acquire)
    }

    /// Records `f` if it is the first failure, then wakes every blocked rank.
    /// Must not be called while holding a group's lock.
    fn fail(&self, f: RankFailure) {
        {
            let mut slot = lock(&self.failure);
            if slot.is_none() {
                *slot = Some(f);
            }
        }
        self.aborted.store(true, Ordering::Release);
        lock(&self.abort_tx).take();
        self.wake_all();
    }

    pub fn fail_with(&self, rank: usize, err: &CommError) {
        self.fail(RankFailure {
            rank,
            kind: FailureKind::Error,
            message: err.to_string(),
        });
    }

    fn exit(&self, rank: usize) {
        self.exited[rank].store(true, Ordering::Release);
        lock(&self.exit_tx[rank]).take();
        self.wake_all();
    }

    fn wake_all(&self) {
        let groups: Vec<Arc<Group>> = lock(&self.groups)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for g in groups {
            g.wake();
        }
    }

    /// The error for an operation abandoned because another rank failed.
    pub fn peer_failed(&self, op: &'static str, rank: usize, peer: Peer) -> CommError {
        let (failed_rank, cause) = match &*lock(&self.failure) {
            Some(f) => (f.rank, f.to_string()),
            None => (rank, "the job was aborted".to_string()),
        };
        CommError::PeerFailed {
            op,
            rank,
            peer,
            failed_rank,
            cause,
        }
    }

    /// Fails fast if the job has already been aborted.
    pub fn check(&self, op: &'static str, rank: usize, peer: Peer) -> Result<()> {
        if self.is_aborted() {
            Err(self.peer_failed(op, rank, peer))
        } else {
            Ok(())
        }
    }

    pub(crate) fn channel(
        &self,
        dst: usize,
        key: (u64, usize, Tag),
    ) -> (Sender<Tensor>, Receiver<Tensor>) {
        lock(&self.mailboxes[dst])
            .entry(key)
            .or_insert_with(unbounded)
            .clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Starts in-process jobs: one thread per rank.
///
/// ```
/// use std::time::Duration;
/// use switchyard_comm::local::Launcher;
///
/// let ranks = Launcher::new(3)
///     .timeout(Duration::from_secs(30))
///     .threads_per_worker(1)
///     .run(|comm| Ok::<_, String>(comm.rank()))
///     .unwrap();
/// assert_eq!(ranks, vec![0, 1, 2]);
/// ```
#[derive(Debug, Clone)]
pub struct Launcher {
    world_size: usize,
    timeout: Duration,
    threads_per_worker: Option<usize>,
}

impl Launcher {
    /// The default bound on any single blocking operation: generous, so that a slow
    /// worker on a loaded machine is not mistaken for a dead one.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

    pub fn new(world_size: usize) -> Launcher {
        Launcher {
            world_size,
            timeout: Self::DEFAULT_TIMEOUT,
            threads_per_worker: None,
        }
    }

    /// Bounds every blocking send, receive and collective.
    pub fn timeout(mut self, timeout: Duration) -> Launcher {
        self.timeout = timeout;
        self
    }

    /// The size of each rank's compute pool. By default the cores are shared out:
    /// [`threads::default_threads_per_worker`].
    pub fn threads_per_worker(mut self, threads: usize) -> Launcher {
        self.threads_per_worker = Some(threads.max(1));
        self
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Runs `f` on every rank and returns every rank's value, or the first failure.
    pub fn run<T, E, F>(&self, f: F) -> std::result::Result<Vec<T>, LaunchError>
    where
        T: Send,
        E: fmt::Display,
        F: Fn(Arc<dyn Communicator>) -> std::result::Result<T, E> + Sync,
    {
        let (outcomes, first) = self.run_inner(f);
        let mut values = Vec::with_capacity(outcomes.len());
        let mut failures = Vec::new();
        for o in outcomes {
            match o {
                Ok(v) => values.push(v),
                Err(e) => failures.push(e),
            }
        }
        if failures.is_empty() {
            return Ok(values);
        }
        let first = first.unwrap_or_else(|| failures[0].clone());
        let others = failures
            .into_iter()
            .filter(|f| f.rank != first.rank)
            .collect();
        Err(LaunchError { first, others })
    }

    /// Runs `f` on every rank and returns each rank's outcome, in rank order.
    pub fn run_each<T, E, F>(&self, f: F) -> Vec<std::result::Result<T, RankFailure>>
    where
        T: Send,
        E: fmt::Display,
        F: Fn(Arc<dyn Communicator>) -> std::result::Result<T, E> + Sync,
    {
        self.run_inner(f).0
    }

    #[allow(clippy::type_complexity)]
    fn run_inner<T, E, F>(
        &self,
        f: F,
    ) -> (
        Vec<std::result::Result<T, RankFailure>>,
        Option<RankFailure>,
    )
    where
        T: Send,
        E: fmt::Display,
        F: Fn(Arc<dyn Communicator>) -> std::result::Result<T, E> + Sync,
    {
        let n = self.world_size;
        if n == 0 {
            let f = RankFailure {
                rank: 0,
                kind: FailureKind::Error,
                message: "cannot launch a job of world size 0".into(),
            };
            return (vec![Err(f.clone())], Some(f));
        }
        let threads = self
            .threads_per_worker
            .unwrap_or_else(|| threads::default_threads_per_worker(n));
        let world = Arc::new(World::new(n, self.timeout));
        let group = world.new_group("world".into(), (0..n).collect());
        let f = &f;
        let outcomes = std::thread::scope(|s| {
            let handles: Vec<_> = (0..n)
                .map(|rank| {
                    let world = world.clone();
                    let group = group.clone();
                    std::thread::Builder::new()
                        .name(format!("switchyard-rank-{rank}"))
                        .spawn_scoped(s, move || {
                            let comm: Arc<dyn Communicator> = Arc::new(LocalComm {
                                world: world.clone(),
                                group,
                                me: rank,
                            });
                            // The rank's memory, measured (see switchyard-mem); none
                            // when every ledger is taken.
                            let ledger = switchyard_mem::Ledger::new();
                            let _charging = ledger.as_ref().map(|l| l.enter());
                            let outcome =
                                run_rank(threads, ledger.as_ref().map(|l| l.id()), || f(comm));
                            let outcome = outcome.map_err(|(kind, message)| {
                                let fl = RankFailure {
                                    rank,
                                    kind,
                                    message,
                                };
                                world.fail(fl.clone());
                                fl
                            });
                            world.exit(rank);
                            outcome
                        })
                        .expect("spawn a rank thread")
                })
                .collect();
            handles
                .into_iter()
                .enumerate()
                .map(|(rank, h)| {
                    h.join().unwrap_or_else(|p| {
                        Err(RankFailure {
                            rank,
                            kind: FailureKind::Panic,
                            message: panic_message(p.as_ref()),
                        })
                    })
                })
                .collect::<Vec<_>>()
        });
        let first = lock(&world.failure).clone();
        (outcomes, first)
    }
}

/// Runs one rank's closure inside its own compute pool, catching panics.
fn run_rank<T: Send, E: fmt::Display>(
    threads: usize,
    ledger: Option<switchyard_mem::LedgerId>,
    f: impl FnOnce() -> std::result::Result<T, E> + Send,
) -> std::result::Result<T, (FailureKind, String)> {
    let body = move || match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err((FailureKind::Error, e.to_string())),
        Err(p) => Err((FailureKind::Panic, panic_message(p.as_ref()))),
    };
    match threads::worker_pool_charging(threads, ledger) {
        Ok(pool) => pool.install(body),
        Err(e) => Err((FailureKind::Error, e.to_string())),
    }
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "panic with a non-string payload".into()
    }
}

/// A world of one rank on the calling thread: every collective is the identity and no
/// thread is started. For single-device code that takes a communicator.
pub fn solo() -> Arc<dyn Communicator> {
    let world = Arc::new(World::new(1, Launcher::DEFAULT_TIMEOUT));
    let group = world.new_group("solo".into(), vec![0]);
    Arc::new(LocalComm {
        world,
        group,
        me: 0,
    })
}

/// Runs every rank of a job on its own thread: see [`Launcher`].
pub fn launch<T, E, F>(world_size: usize, f: F) -> std::result::Result<Vec<T>, LaunchError>
where
    T: Send,
    E: fmt::Display,
    F: Fn(Arc<dyn Communicator>) -> std::result::Result<T, E> + Sync,
{
    Launcher::new(world_size).run(f)
}
