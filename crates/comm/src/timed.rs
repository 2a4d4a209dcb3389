//! A communicator wrapper that records when each collective ran and how many bytes it
//! concerned: what a trace shows of collectives that happen inside layers (a mixture of
//! experts' all-to-alls, forward and backward), where the executor, which times whole
//! actions, cannot see them.
//!
//! [`Timed::wrap`] returns the wrapper and a [`Spans`] handle; whoever owns the handle
//! drains it ([`Spans::take`]) as often as it reports. Groups split from the wrapper are
//! not timed. Point-to-point messages are not recorded (the executor times those).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;

use crate::{Communicator, ReduceOp, Result, Tag};

/// One collective call as [`Timed`] saw it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Span {
    /// The operation: `"all_to_all"`, `"all_reduce"`, …
    pub op: &'static str,
    /// When the call began on this rank.
    pub start: Instant,
    /// How long it took, waiting for the peers included.
    pub dur: Duration,
    /// The bytes it concerned, counted as [`crate::Traffic`] counts them.
    pub bytes: usize,
}

/// The spans a [`Timed`] recorded since the last [`Spans::take`]; shared by clones.
#[derive(Debug, Clone, Default)]
pub struct Spans(Arc<Mutex<Vec<Span>>>);

impl Spans {
    /// Everything recorded since the last call, in call order.
    pub fn take(&self) -> Vec<Span> {
        std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }

    fn push(&self, s: Span) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).push(s);
    }
}

/// See the module docs.
pub struct Timed {
    inner: Arc<dyn Communicator>,
    spans: Spans,
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl Timed {
    /// Wraps `inner`; returns the wrapper and the handle on what it records.
    pub fn wrap(inner: Arc<dyn Communicator>) -> (Arc<dyn Communicator>, Spans) {
        let spans = Spans::default();
        let t = Timed {
            inner,
            spans: spans.clone(),
        };
        (Arc::new(t), spans)
    }

    /// Runs `f` (collective `op` on `bytes` bytes) and records it, failed or not.
    fn timed<T>(&self, op: &'static str, bytes: usize, f: impl FnOnce() -> T) -> T {
        let start = Instant::now();
        let out = f();
        self.spans.push(Span {
            op,
            start,
            dur: start.elapsed(),
            bytes,
        });
        out
    }
}

impl Communicator for Timed {
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
        self.inner.send(t, dst, tag)
    }
    fn recv(&self, src: usize, tag: Tag) -> Result<Tensor> {
        self.inner.recv(src, tag)
    }
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        self.timed("all_reduce", bytes(t), || self.inner.all_reduce(t, op))
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let n = bytes(t) * self.inner.world_size();
        self.timed("all_gather", n, || self.inner.all_gather(t, dim))
    }
    fn reduce_scatter(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.timed("reduce_scatter", bytes(t), || {
            self.inner.reduce_scatter(t, dim, op)
        })
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.timed("broadcast", bytes(t), || self.inner.broadcast(t, root))
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let n = parts.iter().map(bytes).sum();
        self.timed("all_to_all", n, || self.inner.all_to_all(parts))
    }
    fn barrier(&self) -> Result<()> {
        self.timed("barrier", 0, || self.inner.barrier())
    }
    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        self.inner.split_named(color, key, name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{conformance, local};

    #[test]
    fn it_conforms_and_records_every_collective_with_its_bytes_once() {
        let outs = local::launch(2, |world| -> std::result::Result<_, String> {
            let (timed, spans) = Timed::wrap(world);
            conformance::run_all(&*timed).map_err(|e| e.to_string())?;
            assert!(!spans.take().is_empty());
            let run = || -> std::result::Result<(), Box<dyn std::error::Error>> {
                let x = Tensor::new(&[1f32, 2.0, 3.0], &candle_core::Device::Cpu)?;
                timed.all_reduce(&x, ReduceOp::Sum)?;
                timed.all_to_all(vec![x.clone(), x.narrow(0, 0, 1)?])?;
                Ok(())
            };
            run().map_err(|e| e.to_string())?;
            Ok((spans.take(), spans.take()))
        })
        .unwrap();
        for (first, second) in outs {
            let ops: Vec<(&str, usize)> = first.iter().map(|s| (s.op, s.bytes)).collect();
            assert_eq!(ops, [("all_reduce", 12), ("all_to_all", 16)]);
            assert!(first[0].start + first[0].dur <= first[1].start);
            assert!(second.is_empty());
        }
    }
}
