//! How a [`Worker`] sums gradients over the replicas and tied copies, and gathers ZeRO 3's
//! parameters whole for whatever reads them outside a step.

use std::time::Instant;

use candle_core::{Shape, Tensor};
use switchyard_comm::{Communicator, ReduceOp};
use switchyard_mem::Category;
use switchyard_models::Model;

use super::overlap::{GradReduceStats, ReduceSpan, Reduced};
use super::Worker;
use crate::error::{fail, Context, Result};
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
        self.sync_grads_after(grads, None).map(drop)
    }

    /// [`Worker::sync_grads`] after a pipeline whose hooks already all-reduced some
    /// buckets (`reduced`, [`super::overlap`]): those gradients are written in, and only
    /// the rest (the resident parameters) is all-reduced. Returns what the data-parallel
    /// all-reduce cost this step (`None` without replicas).
    pub(super) fn sync_grads_after(
        &self,
        grads: &mut [Option<Tensor>],
        reduced: Option<Reduced>,
    ) -> Result<Option<GradReduceStats>> {
        let since = |t: Instant| t.saturating_duration_since(self.epoch).as_secs_f64() * 1e6;
        let mut done = vec![false; grads.len()];
        let mut stats = GradReduceStats {
            pipeline_end_us: since(Instant::now()),
            ..GradReduceStats::default()
        };
        if let Some(r) = reduced {
            for (i, g) in r.grads {
                // The hooks took every gradient of a bucket's parameters: one that
                // reached the executor's sum anyway (a segment that uses a parameter
                // without listing it) would be lost here.
                if grads[i].is_some() {
                    fail!(
                        Config,
                        "overlap_grad_reduce: {} has a gradient outside the segment that \
                         owns it (Stage::segment_params must list every segment's \
                         parameters)",
                        self.params[i].name
                    );
                }
                grads[i] = Some(g);
                done[i] = true;
            }
            stats = r.stats;
        }
        self.sync_tied(grads, true)?;
        if self.cfg.dp == 1 {
            return Ok(None);
        }
        let _gradients = switchyard_mem::scope(Category::Gradients);
        // Expert parameters are summed over the replicas that hold the same experts.
        let rest: Vec<usize> = (0..grads.len())
            .filter(|&i| !done[i] && !self.expert[i])
            .collect();
        if !rest.is_empty() || self.edp.is_some() {
            let t0 = Instant::now();
            self.sync_experts(grads)?;
            self.all_reduce_buckets(&*self.mesh.dp, grads, &rest)?;
            stats.spans.push(ReduceSpan {
                bucket: None,
                start_us: since(t0),
                dur_us: t0.elapsed().as_secs_f64() * 1e6,
            });
            stats.done_us = since(Instant::now());
        }
        Ok(Some(stats))
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

    /// `--ep`: sums the expert parameters' gradients (zeros where this rank computed
    /// none) over the replicas that hold the same experts (`edp`; nothing to do when
    /// one expert group spans every replica: each expert's gradient is then complete
    /// on its owner, the combine all-to-all's backward brought every token's share).
    pub(super) fn sync_experts(&self, grads: &mut [Option<Tensor>]) -> Result<()> {
        let which: Vec<usize> = (0..grads.len()).filter(|&i| self.expert[i]).collect();
        let _gradients = switchyard_mem::scope(Category::Gradients);
        for &i in &which {
            if grads[i].is_none() {
                grads[i] = Some(self.params[i].var.zeros_like()?);
            }
        }
        match &self.edp {
            Some(edp) if !which.is_empty() => self
                .all_reduce_buckets(&**edp, grads, &which)
                .context("the experts' gradient all-reduce over the replicas that hold them"),
            _ => Ok(()),
        }
    }

    /// All-reduce over `group` of the gradients of parameters `which`, a bucket of
    /// about `bucket_mib` at a time.
    fn all_reduce_buckets(
        &self,
        group: &dyn Communicator,
        grads: &mut [Option<Tensor>],
        which: &[usize],
    ) -> Result<()> {
        let sizes: Vec<usize> = which
            .iter()
            .map(|&i| grads[i].as_ref().map_or(0, |g| g.elem_count()))
            .collect();
        for bucket in zero::buckets(&sizes, self.cfg.bucket_mib) {
            let idx = &which[bucket];
            let parts: Vec<Tensor> = idx
                .iter()
                .map(|&i| grads[i].clone().expect("filled by sync_tied"))
                .collect();
            let summed = group.all_reduce(&flatten(&parts)?, ReduceOp::Sum)?;
            let shapes: Vec<&Shape> = parts.iter().map(|t| t.shape()).collect();
            for (&i, g) in idx.iter().zip(unflatten(&summed, &shapes)?) {
                grads[i] = Some(g);
            }
        }
        Ok(())
    }
}

/// Gradients as one flat tensor, in order (a bucket for a collective).
pub(super) fn flatten(parts: &[Tensor]) -> candle_core::Result<Tensor> {
    let flat: Vec<Tensor> = parts
        .iter()
        .map(|g| g.flatten_all())
        .collect::<candle_core::Result<_>>()?;
    Tensor::cat(&flat, 0)
}

/// [`flatten`] undone: the tensors of `shapes`, in order, each a copy of its own.
pub(super) fn unflatten(flat: &Tensor, shapes: &[&Shape]) -> candle_core::Result<Vec<Tensor>> {
    let mut off = 0;
    let mut out = Vec::with_capacity(shapes.len());
    for s in shapes {
        let n = s.elem_count();
        // A copy of its own: the in-process backend hands every rank one shared sum,
        // which would otherwise stay on the ledger of the rank that made it (and be
        // counted there) until the slowest replica's optimizer is done.
        out.push(flat.narrow(0, off, n)?.reshape(*s)?.force_contiguous()?);
        off += n;
    }
    Ok(out)
}
