//! How a [`Worker`] sums gradients over the replicas and tied copies, and gathers ZeRO 3's
//! parameters whole for whatever reads them outside a step.

use candle_core::Tensor;
use switchyard_comm::ReduceOp;
use switchyard_mem::Category;
use switchyard_models::Model;

use super::Worker;
use crate::error::{Context, Result};
use crate::zero::{self, Optimizer, ShardedAdamW};

impl<M: Model> Worker<'_, M> {
    /// Runs `f` with buckets `which` of a ZeRO 3 optimizer gathered (collective over
    /// `dp`), freeing them after, also when `f` fails.
    pub(super) fn with_buckets<R>(
        &self,
        o: &ShardedAdamW,
        which: &[usize],
        f: impl FnOnce() -> Result<R>,
    ) -> Result<R> {
        for &k in which {
            o.gather(&*self.mesh.dp, k)
                .context("ZeRO 3: gathering the parameters")?;
        }
        let out = f();
        for &k in which {
            o.release(k)?;
        }
        out
    }

    /// Runs `f` with every parameter whole: under ZeRO 3 all of them are gathered
    /// first (a collective over `dp`) and freed after; otherwise `f` alone.
    pub fn gathered<R>(&self, f: impl FnOnce() -> Result<R>) -> Result<R> {
        match &self.opt {
            Optimizer::Sharded(o) if o.held.is_some() => {
                let all: Vec<usize> = (0..o.layout.buckets.len()).collect();
                self.with_buckets(o, &all, f)
            }
            _ => f(),
        }
    }

    /// Sums the tied copies' gradients and averages over data-parallel replicas (with an
    /// all-reduce, whatever `--zero` says: the full gradients, for parity tests).
    pub fn sync_grads(&self, grads: &mut [Option<Tensor>]) -> Result<()> {
        self.sync_tied(grads, true)?;
        if self.cfg.dp > 1 {
            let _gradients = switchyard_mem::scope(Category::Gradients);
            self.all_reduce_buckets(grads)?;
        }
        Ok(())
    }

    /// Gives every parameter (with `fill_all`; else the tied ones) a gradient (zeros
    /// where this rank computed none) and sums the tied copies' gradients.
    pub(super) fn sync_tied(&self, grads: &mut [Option<Tensor>], fill_all: bool) -> Result<()> {
        let _gradients = switchyard_mem::scope(Category::Gradients);
        for (i, (g, p)) in grads.iter_mut().zip(&self.params).enumerate() {
            if g.is_none() && (fill_all || self.tied.iter().any(|(t, _)| *t == i)) {
                *g = Some(p.var.zeros_like()?);
            }
        }
        for (i, group) in &self.tied {
            let g = grads[*i].as_ref().expect("filled above");
            grads[*i] = Some(group.all_reduce(g, ReduceOp::Sum)?);
        }
        Ok(())
    }

    /// Data-parallel all-reduce, a bucket of about `bucket_mib` at a time.
    fn all_reduce_buckets(&self, grads: &mut [Option<Tensor>]) -> Result<()> {
        let sizes: Vec<usize> = grads
            .iter()
            .map(|g| g.as_ref().map_or(0, |g| g.elem_count()))
            .collect();
        for bucket in zero::buckets(&sizes, self.cfg.bucket_mib) {
            let (start, end) = (bucket.start, bucket.end);
            let flat: Vec<Tensor> = grads[start..end]
                .iter()
                .map(|g| g.as_ref().unwrap().flatten_all())
                .collect::<candle_core::Result<_>>()?;
            let summed = self
                .mesh
                .dp
                .all_reduce(&Tensor::cat(&flat, 0)?, ReduceOp::Sum)?;
            let mut off = 0;
            for g in &mut grads[start..end] {
                let t = g.as_ref().unwrap();
                let n = t.elem_count();
                // A copy of its own: the in-process backend hands every rank one shared
                // sum, which would otherwise stay on the ledger of the rank that made it
                // (and be counted there) until the slowest replica's optimizer is done.
                *g = Some(
                    summed
                        .narrow(0, off, n)?
                        .reshape(t.shape())?
                        .force_contiguous()?,
                );
                off += n;
            }
        }
        Ok(())
    }
}
