//! A communicator wrapper that counts the operations passing through it.
//!
//! Used by tests that pin down communication volume, for example "a tensor-parallel
//! transformer block costs exactly 2 all-reduces forward and 2 backward", or "ZeRO's
//! reduce-scatter and all-gather move the bytes of the all-reduce they replace".
//!
//! Besides the calls, [`Counts::traffic`] records per group and operation the calls and
//! the bytes of the *whole* tensor each collective acts on (see [`Traffic`]). With
//! [`Counting::wrap_groups`] the groups split from the wrapped communicator (a mesh's
//! `tp`, `pp` and `dp`) are counted too, under their names.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use crate::{Communicator, ReduceOp, Result, Tag};

/// Counts per operation name (`"all_reduce"`, `"send"`, …), shared by clones.
#[derive(Debug, Default, Clone)]
pub struct Counts(
    Arc<Mutex<BTreeMap<&'static str, usize>>>,
    Arc<Mutex<BTreeMap<(String, &'static str), Traffic>>>,
);

/// The calls of one operation on one group and the bytes they concerned: for an
/// all-reduce and a reduce-scatter the input (the whole tensor), for an all-gather the
/// output (the whole tensor, every rank's part), for a broadcast and a send the tensor,
/// for an all-to-all every part sent. On a ring of `n` ranks each rank sends
/// `2·(n − 1)/n` of an all-reduce's bytes and `(n − 1)/n` of a reduce-scatter's or an
/// all-gather's.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Traffic {
    pub calls: usize,
    pub bytes: u128,
}

impl Counts {
    fn bump(&self, op: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(op)
            .or_default() += 1;
    }

    fn record(&self, group: &str, op: &'static str, bytes: usize) {
        let mut map = self.1.lock().unwrap_or_else(|e| e.into_inner());
        let t = map.entry((group.to_string(), op)).or_default();
        t.calls += 1;
        t.bytes += bytes as u128;
    }

    /// What `op` moved on `group`: `""` for the wrapped communicator itself, a split
    /// group's name (`"dp"`, `"tp"`, …) under [`Counting::wrap_groups`], nested groups as
    /// `"outer/inner"`.
    pub fn traffic(&self, group: &str, op: &str) -> Traffic {
        self.1
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .find(|((g, o), _)| g == group && *o == op)
            .map(|(_, t)| *t)
            .unwrap_or_default()
    }

    /// How many times `op` was called.
    pub fn get(&self, op: &str) -> usize {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(op)
            .copied()
            .unwrap_or(0)
    }

    /// Every count, by operation name.
    pub fn snapshot(&self) -> BTreeMap<&'static str, usize> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Forgets every count.
    pub fn reset(&self) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).clear();
        self.1.lock().unwrap_or_else(|e| e.into_inner()).clear();
    }
}

/// Wraps a communicator and counts every call made through it. Groups split from it
/// are not counted, unless it was made by [`Counting::wrap_groups`].
pub struct Counting {
    inner: Arc<dyn Communicator>,
    counts: Counts,
    /// `None`: the wrapped communicator itself; `Some(path)`: a group split from it.
    group: Option<String>,
    /// Whether split groups are wrapped (and counted) too.
    groups: bool,
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl Counting {
    /// Wraps `inner`; returns the wrapper and a handle on its counts.
    pub fn wrap(inner: Arc<dyn Communicator>) -> (Arc<dyn Communicator>, Counts) {
        Self::make(inner, false)
    }

    /// Wraps `inner` and every group split from it (and from those): their traffic is
    /// recorded under the groups' names ([`Counts::traffic`]); [`Counts::get`] still
    /// counts the calls on `inner` only.
    pub fn wrap_groups(inner: Arc<dyn Communicator>) -> (Arc<dyn Communicator>, Counts) {
        Self::make(inner, true)
    }

    fn make(inner: Arc<dyn Communicator>, groups: bool) -> (Arc<dyn Communicator>, Counts) {
        let counts = Counts::default();
        let c = Counting {
            inner,
            counts: counts.clone(),
            group: None,
            groups,
        };
        (Arc::new(c), counts)
    }

    fn count(&self, op: &'static str, bytes: usize) {
        match &self.group {
            None => {
                self.counts.bump(op);
                self.counts.record("", op, bytes);
            }
            Some(g) => self.counts.record(g, op, bytes),
        }
    }
}

impl Communicator for Counting {
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
    fn send(&self, t: &Tensor, dst: usize, tag: Tag) -> Result<()> {
        self.count("send", bytes(t));
        self.inner.send(t, dst, tag)
    }
    fn recv(&self, src: usize, tag: Tag) -> Result<Tensor> {
        let r = self.inner.recv(src, tag);
        self.count("recv", r.as_ref().map_or(0, bytes));
        r
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.count("all_reduce", bytes(t));
        self.inner.all_reduce(t, op)
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.count("all_gather", bytes(t) * self.inner.world_size());
        self.inner.all_gather(t, dim)
    }
    fn reduce_scatter(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.count("reduce_scatter", bytes(t));
        self.inner.reduce_scatter(t, dim, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.count("broadcast", bytes(t));
        self.inner.broadcast(t, root)
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.count("all_to_all", parts.iter().map(bytes).sum());
        self.inner.all_to_all(parts)
    }
    fn barrier(&self) -> Result<()> {
        self.count("barrier", 0);
        self.inner.barrier()
    }
    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        self.count("split", 0);
        let child = self.inner.split_named(color, key, name)?;
        if !self.groups {
            return Ok(child);
        }
        let path = match &self.group {
            None => name.to_string(),
            Some(g) => format!("{g}/{name}"),
        };
        Ok(Arc::new(Counting {
            inner: child,
            counts: self.counts.clone(),
            group: Some(path),
            groups: true,
        }))
    }
}
