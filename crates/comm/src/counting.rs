//! A communicator wrapper that counts the operations passing through it.
//!
//! Used by tests that pin down communication volume, for example "a tensor-parallel
//! transformer block costs exactly 2 all-reduces forward and 2 backward".

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use crate::{Communicator, ReduceOp, Result, Tag};

/// Counts per operation name (`"all_reduce"`, `"send"`, …), shared by clones.
#[derive(Debug, Default, Clone)]
pub struct Counts(Arc<Mutex<BTreeMap<&'static str, usize>>>);

impl Counts {
    fn bump(&self, op: &'static str) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(op)
            .or_default() += 1;
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
    }
}

/// Wraps a communicator and counts every call made through it. Groups split from it
/// are not counted.
pub struct Counting {
    inner: Arc<dyn Communicator>,
    counts: Counts,
}

impl Counting {
    /// Wraps `inner`; returns the wrapper and a handle on its counts.
    pub fn wrap(inner: Arc<dyn Communicator>) -> (Arc<dyn Communicator>, Counts) {
        let counts = Counts::default();
        let c = Counting {
            inner,
            counts: counts.clone(),
        };
        (Arc::new(c), counts)
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
        self.counts.bump("send");
        self.inner.send(t, dst, tag)
    }
    fn recv(&self, src: usize, tag: Tag) -> Result<Tensor> {
        self.counts.bump("recv");
        self.inner.recv(src, tag)
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.counts.bump("all_reduce");
        self.inner.all_reduce(t, op)
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.counts.bump("all_gather");
        self.inner.all_gather(t, dim)
    }
    fn reduce_scatter(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.counts.bump("reduce_scatter");
        self.inner.reduce_scatter(t, dim, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.counts.bump("broadcast");
        self.inner.broadcast(t, root)
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.counts.bump("all_to_all");
        self.inner.all_to_all(parts)
    }
    fn barrier(&self) -> Result<()> {
        self.counts.bump("barrier");
        self.inner.barrier()
    }
    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        self.counts.bump("split");
        self.inner.split_named(color, key, name)
    }
}
