//! The communicator wrapper that charges every message its `comm` cost.

use std::sync::Arc;

use candle_core::Tensor;
use switchyard_comm::{CommError, Communicator, ReduceOp, Tag};

use crate::StepStats;

use super::{microbatch_of, SyntheticClock, SyntheticMode};

/// A communicator that charges each message's cost on a [`SyntheticClock`] and
/// delegates the transfer to the real one. Point-to-point only: the collectives (which a
/// pipeline's executor does not use) are delegated uncharged.
///
/// Each side of a message costs the `comm` of the stage of its action, as in
/// `simulate_by_stage`; the stage is read from the message's tag (the layout of
/// `switchyard_schedule::tag`). In virtual mode the message's `[time, microbatch]`
/// tensor carries the send's end time.
pub struct SyntheticComm<'a> {
    inner: &'a dyn Communicator,
    clock: Arc<SyntheticClock>,
    comm: Vec<f64>,
}

impl<'a> SyntheticComm<'a> {
    /// Wraps `inner`; `comm[s]` is the cost of a send or receive of stage `s`.
    pub fn new(
        inner: &'a dyn Communicator,
        clock: Arc<SyntheticClock>,
        comm: Vec<f64>,
    ) -> SyntheticComm<'a> {
        SyntheticComm { inner, clock, comm }
    }

    fn cost(&self, op: &'static str, stage: u64) -> switchyard_comm::Result<f64> {
        usize::try_from(stage)
            .ok()
            .and_then(|s| self.comm.get(s).copied())
            .ok_or_else(|| CommError::Invalid {
                op,
                rank: self.inner.rank(),
                reason: format!("tag names stage {stage}, which has no synthetic cost"),
            })
    }

    fn backend(&self, op: &'static str) -> impl Fn(candle_core::Error) -> CommError + '_ {
        move |e| CommError::Backend {
            op,
            rank: self.inner.rank(),
            reason: e.to_string(),
        }
    }
}

/// The stage that receives a message with `tag`, and whether it is a gradient.
pub(super) fn receiver(tag: Tag) -> (u64, bool) {
    (tag >> 33, tag & 1 == 1)
}

impl Communicator for SyntheticComm<'_> {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn members(&self) -> Vec<usize> {
        self.inner.members()
    }

    fn name(&self) -> String {
        self.inner.name()
    }

    fn send(&self, t: &Tensor, dst: usize, tag: Tag) -> switchyard_comm::Result<()> {
        let (to, is_grad) = receiver(tag);
        let from = match is_grad {
            true => to + 1,
            false => to.wrapping_sub(1),
        };
        let stamp = self.clock.send(self.cost("send", from)?);
        match self.clock.mode() {
            SyntheticMode::Virtual => {
                let err = self.backend("send");
                let m = microbatch_of(&t.to_vec1::<f64>().map_err(&err)?).map_err(&err)?;
                let stamped = Tensor::new(&[stamp, m], t.device()).map_err(&err)?;
                self.inner.send(&stamped, dst, tag)
            }
            SyntheticMode::Sleep { .. } => self.inner.send(t, dst, tag),
        }
    }

    fn recv(&self, src: usize, tag: Tag) -> switchyard_comm::Result<Tensor> {
        let t = self.inner.recv(src, tag)?;
        let cost = self.cost("recv", receiver(tag).0)?;
        let sent = match self.clock.mode() {
            SyntheticMode::Virtual => {
                let err = self.backend("recv");
                t.to_vec1::<f64>()
                    .map_err(&err)?
                    .first()
                    .copied()
                    .unwrap_or(0.0)
            }
            SyntheticMode::Sleep { .. } => 0.0,
        };
        self.clock.recv(cost, sent);
        Ok(t)
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> switchyard_comm::Result<Tensor> {
        self.inner.all_reduce(t, op)
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> switchyard_comm::Result<Tensor> {
        self.inner.all_gather(t, dim)
    }

    fn reduce_scatter(
        &self,
        t: &Tensor,
        dim: usize,
        op: ReduceOp,
    ) -> switchyard_comm::Result<Tensor> {
        self.inner.reduce_scatter(t, dim, op)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> switchyard_comm::Result<Tensor> {
        self.inner.broadcast(t, root)
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> switchyard_comm::Result<Vec<Tensor>> {
        self.inner.all_to_all(parts)
    }

    fn barrier(&self) -> switchyard_comm::Result<()> {
        self.inner.barrier()
    }

    /// The real communicator's split: the new group is not synthetic.
    fn split_named(
        &self,
        color: usize,
        key: usize,
        name: &str,
    ) -> switchyard_comm::Result<Arc<dyn Communicator>> {
        self.inner.split_named(color, key, name)
    }
}

/// What one rank of [`run_synthetic`] brings back: the executor's statistics, the
/// clock's log and its time on messages.
pub(super) type RankRun = (StepStats, Vec<(f64, f64)>, f64);
