//! A group's shared state and the rendezvous that every collective is built from.
//!
//! A rendezvous is a barrier with a payload. Each rank *deposits* a value (its input and
//! a description of the call), the last rank to arrive runs a closure on the shared state
//! (checks that the descriptions agree, allocates the output), and everyone leaves with
//! the result of that closure and the deposits of all ranks.
//!
//! Deposits and results are double-buffered by the parity of the rendezvous generation.
//! A rank can deposit for generation `g + 2` only after every rank has arrived at `g + 1`,
//! that is, after every rank has finished reading what was deposited at `g`. So no
//! collective needs a trailing barrier just to protect its inputs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use super::launcher::World;
use crate::reduce::{OutBuf, RawOut};
use crate::{CommError, Peer, Result};

/// What a rank brings to a rendezvous.
#[derive(Clone, Default)]
pub(crate) struct Deposit {
    /// The generation this deposit belongs to.
    pub gen: u64,
    /// The operation, for mismatch messages.
    pub op: &'static str,
    /// Everything that must agree across ranks ("shape [4, 8], F32, Sum").
    pub desc: String,
    pub tensor: Option<Tensor>,
    pub parts: Vec<Tensor>,
    pub color_key: (usize, usize),
}

/// What the last rank to arrive hands to everyone.
#[derive(Clone)]
pub(crate) enum Shared {
    None,
    Buf(RawOut),
    Tensor(Tensor),
    Groups(Arc<HashMap<usize, Arc<Group>>>),
}

#[derive(Default)]
pub(crate) struct State {
    gen: u64,
    arrived: usize,
    slots: [Vec<Deposit>; 2],
    results: [Option<std::result::Result<Shared, String>>; 2],
    /// Members that have yet to read each slot's result; the last one drops the
    /// deposits' tensors and the result, so that a collective's inputs and output live
    /// no longer than its callers hold them (not until the group's next collective).
    readers: [usize; 2],
    /// The output buffer of the collective in progress, filled by all ranks.
    pub out: Option<OutBuf>,
}

pub(crate) struct Group {
    pub name: String,
    /// Global ranks of the members, in group order.
    pub members: Vec<usize>,
    /// Context id: keeps point-to-point messages of different groups apart.
    pub ctx: u64,
    state: Mutex<State>,
    cv: Condvar,
    /// A copy of `State::gen` that waiters can spin on without the lock.
    gen: AtomicU64,
}

/// How often a blocked rank re-checks for failures it was not woken for.
const POLL: Duration = Duration::from_millis(50);
/// How many times a waiting rank checks for the others before it sleeps. Collectives
/// of a training step arrive close together; a short spin saves the futex wake-up.
const SPIN: u32 = 4000;

impl Group {
    pub fn new(name: String, members: Vec<usize>, ctx: u64) -> Group {
        let n = members.len();
        let state = State {
            slots: [vec![Deposit::default(); n], vec![Deposit::default(); n]],
            ..State::default()
        };
        Group {
            name,
            members,
            ctx,
            state: Mutex::new(state),
            cv: Condvar::new(),
            gen: AtomicU64::new(0),
        }
    }

    pub fn describe(&self) -> String {
        let m: Vec<String> = self.members.iter().map(|r| r.to_string()).collect();
        format!("{}[{}]", self.name, m.join(","))
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-written in a way we
        // rely on (the job is aborted anyway), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every rank blocked in this group so it re-checks for failures.
    pub fn wake(&self) {
        let _g = self.lock();
        self.cv.notify_all();
    }

    /// Deposits `dep` for rank `me`, waits for every member, and returns the result of
    /// `last` (run once, by the last rank to arrive) and every rank's deposit.
    pub fn rendezvous<F>(
        &self,
        world: &World,
        me: usize,
        mut dep: Deposit,
        last: F,
    ) -> Result<(Shared, Vec<Deposit>)>
    where
        F: FnOnce(&mut State, &[Deposit]) -> std::result::Result<Shared, String>,
    {
        let op = dep.op;
        let global = self.members[me];
        let peer = || Peer::Group(self.describe());
        world.check(op, global, peer())?;
        let n = self.members.len();
        let mut st = self.lock();
        let my_gen = st.gen;
        let p = (my_gen % 2) as usize;
        dep.gen = my_gen;
        st.slots[p][me] = dep;
        st.arrived += 1;
        if st.arrived == n {
            st.arrived = 0;
            let deps = std::mem::take(&mut st.slots[p]);
            let r = last(&mut st, &deps);
            st.slots[p] = deps;
            st.results[p] = Some(r);
            st.readers[p] = n;
            st.gen += 1;
            self.gen.store(st.gen, Ordering::Release);
            self.cv.notify_all();
        } else {
            drop(st);
            for i in 0..SPIN {
                if self.gen.load(Ordering::Acquire) != my_gen {
                    break;
                }
                if i % 64 == 63 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            st = self.lock();
            let start = Instant::now();
            while st.gen == my_gen {
                if world.is_aborted() {
                    drop(st);
                    return Err(world.peer_failed(op, global, peer()));
                }
                let missing =
                    (0..n).find(|&i| st.slots[p][i].gen != my_gen || st.slots[p][i].op.is_empty());
                if let Some(i) = missing.filter(|&i| world.has_exited(self.members[i])) {
                    drop(st);
                    return Err(CommError::PeerFailed {
                        op,
                        rank: global,
                        peer: peer(),
                        failed_rank: self.members[i],
                        cause: "it returned without joining this collective".into(),
                    });
                }
                let waited = start.elapsed();
                if waited >= world.timeout {
                    drop(st);
                    let err = CommError::Timeout {
                        op,
                        rank: global,
                        peer: peer(),
                        after: world.timeout,
                    };
                    world.fail_with(global, &err);
                    return Err(err);
                }
                let slice = POLL.min(world.timeout - waited);
                st = self
                    .cv
                    .wait_timeout(st, slice)
                    .unwrap_or_else(|e| e.into_inner())
                    .0;
            }
        }
        let result = st.results[p].clone().expect("result set by the last rank");
        let deps = st.slots[p].clone();
        st.readers[p] -= 1;
        if st.readers[p] == 0 {
            for d in &mut st.slots[p] {
                d.tensor = None;
                d.parts.clear();
            }
            st.results[p] = None;
        }
        drop(st);
        match result {
            Ok(shared) => Ok((shared, deps)),
            Err(reason) => Err(CommError::Mismatch {
                op,
                rank: global,
                group: self.describe(),
                reason,
            }),
        }
    }
}

/// Checks that every rank described the call the same way.
pub(crate) fn agree(deps: &[Deposit]) -> std::result::Result<(), String> {
    let first = &deps[0];
    for (r, d) in deps.iter().enumerate().skip(1) {
        if d.op != first.op || d.desc != first.desc {
            return Err(format!(
                "rank 0 called {}({}) but rank {r} called {}({})",
                first.op, first.desc, d.op, d.desc
            ));
        }
    }
    Ok(())
}
