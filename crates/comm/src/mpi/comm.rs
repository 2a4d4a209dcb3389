//! One process's handle on one MPI communicator: construction, point-to-point, the
//! bounded wait every operation ends in, draining on drop, and the [`Communicator`]
//! implementation (whose collectives live in `collective.rs`).

use std::collections::{HashMap, VecDeque};
use std::ffi::c_int;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use candle_core::{Device, Tensor};
use mpi::ffi;

use super::runtime::{Handle, Poll, Runtime};
use super::wire;
use super::MpiConfig;
use crate::args;
use crate::{CommError, Communicator, Peer, ReduceOp, Result, Tag};

/// A send in flight: MPI reads `buf` until `req` completes.
struct PendingSend {
    req: Handle<ffi::MPI_Request>,
    /// Only kept alive: MPI reads it until `req` completes.
    _buf: Vec<u64>,
}

pub(super) struct MpiComm {
    pub rt: Arc<Runtime>,
    pub comm: Handle<ffi::MPI_Comm>,
    /// Freed on drop (every group but the world).
    owned: bool,
    pub me: usize,
    pub n: usize,
    members: Vec<usize>,
    name: String,
    /// `name[members]`, for errors.
    pub label: String,
    sends: Mutex<Vec<PendingSend>>,
    /// Messages received for another full tag that folded onto the same MPI tag.
    stash: Mutex<HashMap<(usize, Tag), VecDeque<Tensor>>>,
    /// Reused by large collectives (as large as the largest so far), so that they do not
    /// fault in fresh pages on every call.
    scratch: Mutex<Vec<u64>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// An element or word count as MPI's `int`.
pub(super) fn count(n: usize) -> std::result::Result<c_int, String> {
    c_int::try_from(n)
        .map_err(|_| format!("{n} elements exceed MPI's count limit of {}", c_int::MAX))
}

/// The world communicator while anyone holds it: every `init` returns this one, so that
/// all handles on the world share its pending sends and set-aside messages.
static WORLD: Mutex<Weak<MpiComm>> = Mutex::new(Weak::new());

/// Starts MPI (once) and returns the world.
pub(super) fn world(config: MpiConfig) -> Result<Arc<dyn Communicator>> {
    let mut world = lock(&WORLD);
    if let Some(w) = world.upgrade() {
        return Ok(w);
    }
    let rt = Runtime::get(config)?;
    let n = rt.world_size;
    let w = Arc::new(MpiComm::new(
        rt.clone(),
        rt.world(),
        false,
        rt.world_rank,
        (0..n).collect(),
        "world".into(),
    ));
    *world = Arc::downgrade(&w);
    Ok(w)
}

impl MpiComm {
    pub fn new(
        rt: Arc<Runtime>,
        comm: Handle<ffi::MPI_Comm>,
        owned: bool,
        me: usize,
        members: Vec<usize>,
        name: String,
    ) -> MpiComm {
        let m: Vec<String> = members.iter().map(|r| r.to_string()).collect();
        let label = format!("{name}[{}]", m.join(","));
        MpiComm {
            rt,
            comm,
            owned,
            me,
            n: members.len(),
            members,
            name,
            label,
            sends: Mutex::new(Vec::new()),
            stash: Mutex::new(HashMap::new()),
            scratch: Mutex::new(Vec::new()),
        }
    }

    pub fn global(&self) -> usize {
        self.members[self.me]
    }

    pub fn group(&self) -> Peer {
        Peer::Group(self.label.clone())
    }

    pub fn invalid(&self, op: &'static str, reason: impl Into<String>) -> CommError {
        CommError::Invalid {
            op,
            rank: self.global(),
            reason: reason.into(),
        }
    }

    pub fn backend(&self, op: &'static str, reason: impl std::fmt::Display) -> CommError {
        CommError::Backend {
            op,
            rank: self.global(),
            reason: reason.to_string(),
        }
    }

    /// One MPI call; failure is a backend error of `op`.
    pub fn mpi(&self, op: &'static str, f: impl FnOnce() -> c_int) -> Result<()> {
        self.rt.call(f).map_err(|e| self.backend(op, e))
    }

    pub fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        args::peer_in_range(peer, self.n, &self.label).map_err(|r| self.invalid(op, r))
    }

    pub fn check_dim(&self, op: &'static str, t: &Tensor, dim: usize) -> Result<()> {
        args::dim_exists(t, dim).map_err(|r| self.invalid(op, r))
    }

    /// `t` as a contiguous host tensor detached from autograd: a tensor on another
    /// device is copied to the host ([`crate::host`]).
    pub fn contiguous(&self, op: &'static str, t: &Tensor) -> Result<Tensor> {
        let t = crate::host::to_host(t).map_err(|e| self.backend(op, e))?;
        Ok(t.contiguous().map_err(|e| self.backend(op, e))?.detach())
    }

    /// A host result back on `device`, the device of the input it came from.
    fn on(&self, op: &'static str, device: &Device, r: Result<Tensor>) -> Result<Tensor> {
        crate::host::to_device(r?, device).map_err(|e| self.backend(op, e))
    }

    /// Waits for `reqs`, keeping `keep` (every buffer MPI may still touch) alive. On
    /// timeout or error the buffers are leaked, since MPI may still use them, and this
    /// process is marked failed.
    pub fn wait<B>(
        &self,
        op: &'static str,
        peer: Peer,
        poll: &Poll,
        mut reqs: Vec<ffi::MPI_Request>,
        keep: B,
    ) -> Result<B> {
        let n = reqs.len() as c_int;
        let done = self.rt.poll(poll, || {
            let mut flag: c_int = 0;
            // SAFETY: `reqs` are active requests owned by this call.
            self.rt.call(|| unsafe {
                ffi::MPI_Testall(n, reqs.as_mut_ptr(), &mut flag, ffi::RSMPI_STATUSES_IGNORE)
            })?;
            Ok(flag != 0)
        });
        let err = match done {
            Ok(true) => return Ok(keep),
            Ok(false) => CommError::Timeout {
                op,
                rank: self.global(),
                peer,
                after: poll.timeout,
            },
            Err(e) => self.backend(op, e),
        };
        std::mem::forget(keep);
        self.rt.fail(&err);
        Err(err)
    }

    /// The group's scratch buffer, at least `words` long. Give it back with
    /// [`MpiComm::put_scratch`] (a buffer MPI may still touch after a timeout is leaked
    /// instead, and the next call allocates a new one).
    pub fn take_scratch(&self, words: usize) -> Vec<u64> {
        let v = std::mem::take(&mut *lock(&self.scratch));
        if v.len() >= words {
            v
        } else {
            vec![0; words]
        }
    }

    pub fn put_scratch(&self, v: Vec<u64>) {
        let mut s = lock(&self.scratch);
        if v.len() >= s.len() {
            *s = v;
        }
    }

    /// Forgets sends that have completed. Also drives MPI's progress.
    fn reap(&self) -> Result<()> {
        let mut sends = lock(&self.sends);
        let mut first_err = None;
        sends.retain_mut(|s| {
            let mut flag: c_int = 0;
            // SAFETY: `s.req` is an active send request whose buffer `s.buf` is alive.
            let r = self.rt.call(|| unsafe {
                ffi::MPI_Test(&mut s.req.0, &mut flag, ffi::RSMPI_STATUS_IGNORE)
            });
            match r {
                Ok(()) => flag == 0,
                Err(e) => {
                    first_err.get_or_insert(e);
                    true
                }
            }
        });
        match first_err {
            None => Ok(()),
            Some(e) => Err(self.backend("send", e)),
        }
    }

    /// The MPI tag a switchyard tag travels under.
    fn mpi_tag(&self, tag: Tag) -> c_int {
        (tag % (self.rt.tag_ub + 1)) as c_int
    }

    fn take_stashed(&self, src: usize, tag: Tag) -> Option<Tensor> {
        let mut stash = lock(&self.stash);
        let q = stash.get_mut(&(src, tag))?;
        let t = q.pop_front();
        if q.is_empty() {
            stash.remove(&(src, tag));
        }
        t
    }

    /// One message from `src` under the MPI tag of `tag`, if one has arrived.
    fn try_receive(&self, src: usize, tag: Tag, poll: &Poll) -> Result<Option<(Tag, Tensor)>> {
        const OP: &str = "recv";
        let mut flag: c_int = 0;
        let mut msg = Handle(unsafe { ffi::RSMPI_MESSAGE_NULL });
        let mut status = std::mem::MaybeUninit::<ffi::MPI_Status>::uninit();
        // SAFETY: the out-pointers are valid for the call.
        self.mpi(OP, || unsafe {
            ffi::MPI_Improbe(
                src as c_int,
                self.mpi_tag(tag),
                self.comm.0,
                &mut flag,
                &mut msg.0,
                status.as_mut_ptr(),
            )
        })?;
        if flag == 0 {
            return Ok(None);
        }
        let mut words: c_int = 0;
        // SAFETY: Improbe filled `status` for the matched message.
        self.mpi(OP, || unsafe {
            ffi::MPI_Get_count(status.as_ptr(), ffi::RSMPI_UINT64_T, &mut words)
        })?;
        let mut buf: Vec<u64> = vec![0; words.max(0) as usize];
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `buf` holds `words` words and outlives the request (see `wait`).
        self.mpi(OP, || unsafe {
            ffi::MPI_Imrecv(
                buf.as_mut_ptr() as *mut std::ffi::c_void,
                words,
                ffi::RSMPI_UINT64_T,
                &mut msg.0,
                &mut req,
            )
        })?;
        let buf = self.wait(OP, Peer::Rank(src), poll, vec![req], buf)?;
        let (full, t) = wire::decode_message(&buf).map_err(|e| self.backend(OP, e))?;
        Ok(Some((full, t)))
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // Drain the sends still in flight: their receivers may not have posted yet. After
        // a failure nobody may receive them: leak them at once.
        let timeout = if self.rt.failed() {
            Duration::ZERO
        } else {
            self.rt.timeout
        };
        let poll = Poll::new(timeout);
        let drained = self.rt.poll(&poll, || {
            self.reap().map_err(|e| e.to_string())?;
            Ok(lock(&self.sends).is_empty())
        });
        if !matches!(drained, Ok(true)) {
            let left = std::mem::take(&mut *lock(&self.sends));
            if self.rt.failed() {
                std::mem::forget(left);
            } else {
                eprintln!(
                    "switchyard-comm: rank {}: {} send(s) on group {} were never received \
                 (after {:?}); their buffers are leaked",
                    self.global(),
                    left.len(),
                    self.label,
                    poll.timeout
                );
                std::mem::forget(left);
            }
        }
        if self.owned {
            let mut c = self.comm.0;
            // SAFETY: this handle owns the communicator; nothing uses it after this.
            let _ = self.rt.call(|| unsafe { ffi::MPI_Comm_free(&mut c) });
        }
    }
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.n
    }

    fn members(&self) -> Vec<usize> {
        self.members.clone()
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn send(&self, t: &Tensor, dst: usize, tag: Tag) -> Result<()> {
        const OP: &str = "send";
        self.check_peer(OP, dst)?;
        self.rt.check(OP, self.global(), Peer::Rank(dst))?;
        let x = self.contiguous(OP, t)?;
        let buf = wire::encode_message(tag, &x).map_err(|e| self.invalid(OP, e))?;
        let words = count(buf.len()).map_err(|e| self.invalid(OP, e))?;
        let mut req = unsafe { ffi::RSMPI_REQUEST_NULL };
        // SAFETY: `buf` moves into the pending list (its heap data stays put) and is
        // only dropped once the request has completed.
        self.mpi(OP, || unsafe {
            ffi::MPI_Isend(
                buf.as_ptr() as *const std::ffi::c_void,
                words,
                ffi::RSMPI_UINT64_T,
                dst as c_int,
                self.mpi_tag(tag),
                self.comm.0,
                &mut req,
            )
        })?;
        lock(&self.sends).push(PendingSend {
            req: Handle(req),
            _buf: buf,
        });
        self.reap()
    }

    fn recv(&self, src: usize, tag: Tag) -> Result<Tensor> {
        const OP: &str = "recv";
        self.check_peer(OP, src)?;
        self.rt.check(OP, self.global(), Peer::Rank(src))?;
        let poll = Poll::new(self.rt.timeout);
        let mut found = None;
        let mut failed = None;
        let done = self.rt.poll(&poll, || {
            if let Some(t) = self.take_stashed(src, tag) {
                found = Some(t);
                return Ok(true);
            }
            let step = self.reap().and_then(|_| self.try_receive(src, tag, &poll));
            match step {
                Ok(Some((full, t))) if full == tag => {
                    found = Some(t);
                    Ok(true)
                }
                Ok(Some((full, t))) => {
                    lock(&self.stash)
                        .entry((src, full))
                        .or_default()
                        .push_back(t);
                    Ok(false)
                }
                Ok(None) => Ok(false),
                Err(e) => {
                    failed = Some(e);
                    Ok(true)
                }
            }
        });
        if let Some(e) = failed {
            return Err(e);
        }
        match (done, found) {
            (Ok(true), Some(t)) => Ok(t),
            (Err(e), _) => Err(self.backend(OP, e)),
            _ => {
                let err = CommError::Timeout {
                    op: OP,
                    rank: self.global(),
                    peer: Peer::Rank(src),
                    after: poll.timeout,
                };
                self.rt.fail(&err);
                Err(err)
            }
        }
    }

    // Every input is staged through the host by `contiguous`, and each result goes back
    // to the device of its input ([`crate::host`]).
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.on("all_reduce", t.device(), self.all_reduce_impl(t, op))
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.on("all_gather", t.device(), self.all_gather_impl(t, dim))
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.on(
            "reduce_scatter",
            t.device(),
            self.reduce_scatter_impl(t, dim, op),
        )
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.on("broadcast", t.device(), self.broadcast_impl(t, root))
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let Some(device) = parts.first().map(|p| p.device().clone()) else {
            return self.all_to_all_impl(parts);
        };
        self.all_to_all_impl(parts)?
            .into_iter()
            .map(|t| self.on("all_to_all", &device, Ok(t)))
            .collect()
    }

    fn barrier(&self) -> Result<()> {
        self.barrier_impl()
    }

    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        self.split_impl(color, key, name)
    }
}
