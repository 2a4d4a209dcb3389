//! A communicator wrapper that adds a latency, and optionally a transfer time, to every
//! collective: a slow network on one machine.
//!
//! Threads of one process exchange tensors in microseconds, so whether a collective is
//! hidden behind compute (ZeRO 3's prefetched gathers, for example) does not show on
//! them. [`Latency::wrap`] makes each collective of the wrapped communicator and of every
//! group split from it sleep `α` before it starts, the way a message waits for the
//! network; sleeping costs no core, so another thread computes meanwhile.
//! [`Latency::wrap_link`] also sleeps the tensor's bytes over a bandwidth `β`, the time a
//! network adapter would spend moving them (the data-parallel all-reduce overlapped with
//! the backward only saves time where something other than the cores moves the bytes).
//! Point-to-point messages are passed through untouched (the pipeline's synthetic stages
//! model those).

use std::sync::Arc;
use std::time::Duration;

use candle_core::Tensor;

use crate::{Communicator, ReduceOp, Result, Tag};

/// See the module docs.
pub struct Latency {
    inner: Arc<dyn Communicator>,
    alpha: Duration,
    /// Bytes a second of the simulated link (`None`: transfers take no time).
    bytes_per_s: Option<f64>,
}

impl Latency {
    /// `inner` with `alpha` added to each of its collectives and its groups'.
    pub fn wrap(inner: Arc<dyn Communicator>, alpha: Duration) -> Arc<dyn Communicator> {
        Arc::new(Latency {
            inner,
            alpha,
            bytes_per_s: None,
        })
    }

    /// `inner` with `alpha` plus the collective's tensor bytes at `bytes_per_s` added to
    /// each of its collectives and its groups'.
    pub fn wrap_link(
        inner: Arc<dyn Communicator>,
        alpha: Duration,
        bytes_per_s: f64,
    ) -> Arc<dyn Communicator> {
        Arc::new(Latency {
            inner,
            alpha,
            bytes_per_s: Some(bytes_per_s),
        })
    }

    /// Sleeps the latency and the transfer of `ts`' bytes.
    fn wait(&self, ts: &[&Tensor]) {
        let bytes: usize = ts
            .iter()
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        let transfer = match self.bytes_per_s {
            Some(b) if b > 0.0 => Duration::from_secs_f64(bytes as f64 / b),
            _ => Duration::ZERO,
        };
        let total = self.alpha + transfer;
        if !total.is_zero() {
            std::thread::sleep(total);
        }
    }
}

impl Communicator for Latency {
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
        self.wait(&[t]);
        self.inner.all_reduce(t, op)
    }
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        self.wait(&[t]);
        self.inner.all_gather(t, dim)
    }
    fn reduce_scatter(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        self.wait(&[t]);
        self.inner.reduce_scatter(t, dim, op)
    }
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        self.wait(&[t]);
        self.inner.broadcast(t, root)
    }
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.wait(&parts.iter().collect::<Vec<_>>());
        self.inner.all_to_all(parts)
    }
    fn barrier(&self) -> Result<()> {
        self.wait(&[]);
        self.inner.barrier()
    }
    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        let child = self.inner.split_named(color, key, name)?;
        Ok(Arc::new(Latency {
            inner: child,
            alpha: self.alpha,
            bytes_per_s: self.bytes_per_s,
        }))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::{conformance, local};

    #[test]
    fn it_conforms_and_each_collective_waits_at_least_its_latency() {
        let alpha = Duration::from_millis(20);
        local::launch(3, |world| -> std::result::Result<(), String> {
            let fast = Latency::wrap(world.clone(), Duration::ZERO);
            conformance::run_all(&*fast).map_err(|e| e.to_string())?;
            let slow = Latency::wrap(world, alpha);
            let dp = slow
                .split_named(0, slow.rank(), "dp")
                .map_err(|e| e.to_string())?;
            let x = Tensor::new(&[slow.rank() as f32], &candle_core::Device::Cpu)
                .map_err(|e| e.to_string())?;
            let t = Instant::now();
            let y = dp
                .all_reduce(&x, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            // A lower bound only: sleeping never returns early.
            assert!(t.elapsed() >= alpha, "{:?}", t.elapsed());
            assert_eq!(y.to_vec1::<f32>().unwrap(), [3.0]);
            // 1,000 f32 at 100 kB/s: 40 ms more, on a group split from the link too.
            let link = Latency::wrap_link(fast, Duration::ZERO, 1e5)
                .split_named(0, slow.rank(), "dp2")
                .map_err(|e| e.to_string())?;
            let x = Tensor::zeros(1000, candle_core::DType::F32, &candle_core::Device::Cpu)
                .map_err(|e| e.to_string())?;
            let t = Instant::now();
            link.all_reduce(&x, ReduceOp::Sum)
                .map_err(|e| e.to_string())?;
            assert!(
                t.elapsed() >= Duration::from_millis(40),
                "{:?}",
                t.elapsed()
            );
            Ok(())
        })
        .unwrap();
    }
}
