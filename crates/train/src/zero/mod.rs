//! ZeRO stages 1 and 2 over the data-parallel axis (Rajbhandari et al., 2020).
//!
//! Without ZeRO every data-parallel replica all-reduces the gradients and keeps AdamW's
//! moments of every parameter it holds. With ZeRO each of the `dp` replicas of a rank
//! owns `1/dp` of every gradient bucket:
//!
//! 1. a bucket (the same consecutive parameters the all-reduce sums together, about
//!    `bucket_mib`) is flattened, padded with zeros to a multiple of `dp` elements, and
//!    reduce-scattered (summed): replica `r` receives elements `[r·s, (r+1)·s)` of the
//!    sum, `s = ⌈n/dp⌉`;
//! 2. the global gradient norm is the sum of the squares of every replica's own shard
//!    (the padding is zero), added in the step's one world all-gather like the
//!    unsharded path's, so clipping sees the same norm;
//! 3. AdamW updates replica `r`'s shard of the parameters with the moments of that
//!    shard only ([`ShardedAdamW`], the same element-wise arithmetic as
//!    [`crate::optim::AdamW`]);
//! 4. the updated shards are all-gathered, and every replica writes the whole bucket
//!    back into its parameters, so all replicas hold the same full parameters again.
//!
//! Stage 1 keeps the rank's full (unreduced) gradients until the step ends, as a
//! framework whose gradients live beside the parameters does; stage 2 drops each
//! bucket's full gradients as soon as the bucket is scattered. The executor accumulates
//! whole gradients over the microbatches, so the backward's own peak is the same in
//! both stages; what stage 2 saves is the full gradient during the update.
//!
//! The communication is that of the all-reduce: a ring all-reduce is a reduce-scatter
//! followed by an all-gather, and each moves `(dp − 1)/dp` of the (padded) bucket.
//!
//! Expert parameters (`--ep`, [`switchyard_shard::Param::expert`]) differ from replica
//! to replica, so they never share a bucket with the others: their buckets are *whole*
//! ([`Bucket::whole`]), cut over one replica, and kept entire with their moments by the
//! replica that holds the experts (ZeRO over the dense parameters, as Megatron-Core and
//! DeepSpeed-MoE do by default). Their gradients are summed over the replicas that hold
//! the same experts before they get here, and nothing is communicated for them.
//!
//! Checkpoints keep today's format: [`ShardedAdamW::full_moments`] all-gathers every
//! parameter's moments, so a ZeRO checkpoint loads on any layout and any stage, and
//! [`ShardedAdamW::restore`] cuts full moments into this replica's shards.

use std::ops::Range;

use candle_core::{DType, Device, Tensor, Var};
use switchyard_comm::Communicator;
use switchyard_mem::Category;
use switchyard_shard::storage::with_f32_values;

use crate::error::{fail, Result};

mod grads;
mod prefetch;
mod scatter;
mod segments;
use crate::optim::{update_slice, AdamW, AdamWConfig, StepScalars};
pub use grads::{reduce_scatter, scatter_bucket, shard_norm};
pub use prefetch::Prefetcher;
pub use scatter::Scatterer;
pub use segments::{Units, ZeroHooks};

/// The buckets of consecutive parameters, by their element counts `sizes`: each holds
/// at most `bucket_mib` MiB of f32 values, or a single parameter that is larger alone.
/// The unsharded all-reduce and ZeRO's reduce-scatter use the same buckets.
pub fn buckets(sizes: &[usize], bucket_mib: f64) -> Vec<Range<usize>> {
    let limit = ((bucket_mib * 1024.0 * 1024.0) / 4.0).max(1.0) as usize;
    let mut out = Vec::new();
    let mut start = 0;
    while start < sizes.len() {
        let (mut end, mut elems) = (start, 0);
        while end < sizes.len() && (end == start || elems + sizes[end] <= limit) {
            elems += sizes[end];
            end += 1;
        }
        out.push(start..end);
        start = end;
    }
    out
}

/// The part of one parameter that lies in this replica's shard of a bucket: elements
/// `from..from + len` of the flattened parameter are elements `at..at + len` of the shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub param: usize,
    pub from: usize,
    pub len: usize,
    pub at: usize,
}

/// One bucket as ZeRO cuts it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Bucket {
    /// The parameters in it (indices into the rank's parameter list, ascending).
    pub params: Vec<usize>,
    /// Each parameter's offset in the flattened bucket.
    pub offsets: Vec<usize>,
    /// Elements in the bucket.
    pub len: usize,
    /// The replicas it is cut over: `dp`, or 1 for a [`Bucket::whole`] one.
    pub n: usize,
    /// Elements per replica: `⌈len / n⌉` (the last replicas' shards end in padding).
    pub shard: usize,
    /// The pieces of parameters in this replica's shard, in order.
    pub pieces: Vec<Piece>,
}

impl Bucket {
    fn new(params: Vec<usize>, sizes: &[usize], dp: usize, rank: usize) -> Bucket {
        let (dp, rank) = (dp.max(1), rank);
        let mut offsets = Vec::with_capacity(params.len());
        let mut len = 0;
        for &i in &params {
            offsets.push(len);
            len += sizes[i];
        }
        let shard = len.div_ceil(dp.max(1));
        let (lo, hi) = (rank * shard, (rank + 1) * shard);
        let pieces = params
            .iter()
            .zip(&offsets)
            .filter_map(|(&i, &o)| {
                let (a, b) = (o.max(lo), (o + sizes[i]).min(hi));
                (a < b).then(|| Piece {
                    param: i,
                    from: a - o,
                    len: b - a,
                    at: a - lo,
                })
            })
            .collect();
        Bucket {
            params,
            offsets,
            len,
            n: dp,
            shard,
            pieces,
        }
    }

    /// Elements in the bucket with its padding: `shard · n`.
    pub fn padded(&self) -> usize {
        self.shard * self.n
    }

    /// Whether this replica keeps the bucket entire (expert parameters): its reduce-
    /// scatter and all-gather are no-ops.
    pub fn whole(&self) -> bool {
        self.n == 1
    }
}

/// How ZeRO cuts a rank's parameters: the buckets and this replica's shard of each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub dp: usize,
    pub rank: usize,
    pub buckets: Vec<Bucket>,
}

impl Layout {
    /// The layout of parameters with `sizes` elements for replica `rank` of `dp`: the
    /// parameters not marked `whole` cut by size, then the `whole` ones (expert
    /// parameters, kept entire; `whole` may be empty: none) cut by size.
    pub fn new(sizes: &[usize], whole: &[bool], bucket_mib: f64, dp: usize, rank: usize) -> Layout {
        let is_whole = |i: usize| whole.get(i).copied().unwrap_or(false);
        let mut groups = Vec::new();
        for w in [false, true] {
            let idx: Vec<usize> = (0..sizes.len()).filter(|&i| is_whole(i) == w).collect();
            let sz: Vec<usize> = idx.iter().map(|&i| sizes[i]).collect();
            groups.extend(
                buckets(&sz, bucket_mib)
                    .into_iter()
                    .map(|r| idx[r].to_vec()),
            );
        }
        Layout::of_groups(groups, sizes, whole, dp, rank)
    }

    /// The layout of parameters with `sizes` elements cut into the given `groups` of
    /// parameter indices (each ascending; together each index once), one bucket each;
    /// a group of `whole` parameters (all or none of it) is kept entire.
    pub fn of_groups(
        groups: Vec<Vec<usize>>,
        sizes: &[usize],
        whole: &[bool],
        dp: usize,
        rank: usize,
    ) -> Layout {
        let is_whole = |i: &usize| whole.get(*i).copied().unwrap_or(false);
        let buckets = groups
            .into_iter()
            .map(|g| {
                // A bucket summed over the replicas must not hold a parameter that differs
                // between them, nor the other way round.
                assert!(
                    g.iter().all(is_whole) || !g.iter().any(is_whole),
                    "ZeRO layout: a group mixes expert and other parameters: {g:?}"
                );
                g
            })
            .map(|g| match g.iter().any(is_whole) {
                true => Bucket::new(g, sizes, 1, 0),
                false => Bucket::new(g, sizes, dp, rank),
            })
            .collect();
        Layout { dp, rank, buckets }
    }

    /// Elements of every bucket's shard: the moments this replica keeps.
    pub fn shard_elems(&self) -> usize {
        self.buckets.iter().map(|b| b.shard).sum()
    }
}

/// AdamW over this replica's shards (ZeRO stages 1 and 2): the moments of `1/dp` of
/// every bucket, the same update as [`crate::optim::AdamW`] element by element.
pub struct ShardedAdamW {
    pub config: AdamWConfig,
    /// Steps taken so far (`t` of the bias correction).
    pub t: u64,
    pub layout: Layout,
    params: Vec<Var>,
    decay: Vec<bool>,
    /// Per bucket, the first and second moments of this replica's shard (`shard`
    /// elements; the padding's stay zero).
    pub m: Vec<Vec<f64>>,
    pub v: Vec<Vec<f64>>,
    /// Stage 3: per bucket, this replica's shard of the parameters, their only copy
    /// between the gathers of [`ShardedAdamW::gather`] (`None` for stages 1 and 2, whose
    /// replicas keep the whole parameters).
    pub held: Option<Vec<Vec<f32>>>,
}

impl ShardedAdamW {
    /// Zero moments for this replica's shard of `params`, cut by `layout`.
    pub fn new(params: Vec<Var>, config: AdamWConfig, layout: Layout) -> ShardedAdamW {
        let decay = params
            .iter()
            .map(|p| config.decay.applies_to(p.rank()))
            .collect();
        let m = layout.buckets.iter().map(|b| vec![0.0; b.shard]).collect();
        let v = layout.buckets.iter().map(|b| vec![0.0; b.shard]).collect();
        ShardedAdamW {
            config,
            t: 0,
            layout,
            params,
            decay,
            m,
            v,
            held: None,
        }
    }

    /// Stage 3: keeps this replica's shard of every bucket of the parameters and frees
    /// the parameters' own values (in place: the variables stay, empty, until
    /// [`ShardedAdamW::gather`]).
    pub fn shard_params(&mut self) -> Result<()> {
        let mut held = Vec::with_capacity(self.layout.buckets.len());
        for b in &self.layout.buckets {
            let mut p = vec![0f32; b.shard];
            for pc in &b.pieces {
                let var = &self.params[pc.param];
                if var.dtype() != DType::F32 || !var.device().is_cpu() {
                    fail!(
                        Config,
                        "ZeRO 3: parameter {} is {:?} on {:?}; only f32 parameters on the CPU \
                         are sharded in place",
                        pc.param,
                        var.dtype(),
                        var.device().location()
                    );
                }
                read_f32(var.as_tensor(), pc.from, &mut p[pc.at..pc.at + pc.len])?;
            }
            held.push(p);
        }
        self.held = Some(held);
        for k in 0..self.layout.buckets.len() {
            self.release(k)?;
        }
        Ok(())
    }

    /// Stage 3: all-gathers bucket `k`'s parameters over `dp` into the variables.
    /// Collective over `dp`.
    pub fn gather(&self, dp: &dyn Communicator, k: usize) -> Result<()> {
        let Some(mine) = self.held_shard(k)? else {
            return Ok(());
        };
        if self.layout.buckets[k].whole() {
            return self.fill(k, &mine);
        }
        let full = {
            let _comm = switchyard_mem::scope(Category::Comm);
            dp.all_gather(&mine, 0)?
        };
        drop(mine);
        self.fill(k, &full)
    }

    /// Stage 3: this replica's shard of bucket `k`'s parameters, as a tensor to
    /// all-gather (a communication buffer); `None` below stage 3.
    pub fn held_shard(&self, k: usize) -> Result<Option<Tensor>> {
        let Some(held) = &self.held else {
            return Ok(None);
        };
        let _comm = switchyard_mem::scope(Category::Comm);
        let b = &self.layout.buckets[k];
        Ok(Some(Tensor::from_slice(&held[k], b.shard, &Device::Cpu)?))
    }

    /// Stage 3: writes bucket `k`'s all-gathered values `full` (every replica's shard,
    /// in rank order) into the variables.
    pub fn fill(&self, k: usize, full: &Tensor) -> Result<()> {
        let b = &self.layout.buckets[k];
        let _parameters = switchyard_mem::scope(Category::Parameters);
        with_f32_values(full, |full| -> Result<()> {
            for (&i, &o) in b.params.iter().zip(&b.offsets) {
                let var = self.params[i].as_tensor();
                let n = var.elem_count();
                switchyard_shard::storage::fill_f32_with(var, |dst| {
                    dst.copy_from_slice(&full[o..o + n]);
                    Ok(())
                })?;
            }
            Ok(())
        })
    }

    /// Stage 3: frees bucket `k`'s parameters in place.
    pub fn release(&self, k: usize) -> Result<()> {
        if self.held.is_some() {
            for &i in &self.layout.buckets[k].params {
                switchyard_shard::storage::free_in_place(self.params[i].as_tensor())?;
            }
        }
        Ok(())
    }

    /// One step: `shards[k]` is this replica's (summed, clipped) gradient shard of bucket
    /// `k`. Updates the own shard of the parameters, then all-gathers every bucket over
    /// `dp` and writes it into the parameters. Collective over `dp`.
    pub fn step(&mut self, dp: &dyn Communicator, shards: &[Tensor], lr: f64) -> Result<()> {
        if shards.len() != self.layout.buckets.len() {
            fail!(
                Config,
                "ZeRO AdamW step: {} gradient shards for {} buckets",
                shards.len(),
                self.layout.buckets.len()
            );
        }
        self.t += 1;
        for (k, (b, g)) in self.layout.buckets.iter().zip(shards).enumerate() {
            // Stage 3 updates its own shard of the parameters; stages 1 and 2 read theirs
            // into a buffer the all-gather then sends (a communication buffer: the
            // measured optimizer state is the moments alone).
            let stage3 = self.held.is_some();
            let mut p = match self.held.as_mut() {
                Some(held) => std::mem::take(&mut held[k]),
                None => {
                    let _comm = switchyard_mem::scope(Category::Comm);
                    vec![0f32; b.shard]
                }
            };
            with_f32_values(g, |g| -> Result<()> {
                for pc in &b.pieces {
                    let var = &self.params[pc.param];
                    if var.dtype() != DType::F32 {
                        fail!(
                            Config,
                            "ZeRO AdamW step: parameter {} is {:?}; only f32 parameters are \
                             sharded",
                            pc.param,
                            var.dtype()
                        );
                    }
                    let r = pc.at..pc.at + pc.len;
                    if !stage3 {
                        read_f32(var.as_tensor(), pc.from, &mut p[r.clone()])?;
                    }
                    let wd = match self.decay[pc.param] {
                        true => self.config.weight_decay,
                        false => 0.0,
                    };
                    let s = StepScalars::new(self.config, self.t, lr, wd);
                    update_slice(
                        &mut p[r.clone()],
                        &g[r.clone()],
                        &mut self.m[k][r.clone()],
                        &mut self.v[k][r],
                        &s,
                    );
                }
                Ok(())
            })?;
            if let Some(held) = self.held.as_mut() {
                // The next use gathers them.
                held[k] = p;
                continue;
            }
            let comm = switchyard_mem::scope(Category::Comm);
            let mine = Tensor::from_vec(p, b.shard, &Device::Cpu)?;
            let full = match b.whole() {
                true => mine,
                false => dp.all_gather(&mine, 0)?,
            };
            debug_assert_eq!(full.elem_count(), b.padded());
            for (&i, &o) in b.params.iter().zip(&b.offsets) {
                let var = &self.params[i];
                let n = var.elem_count();
                let new = full.narrow(0, o, n)?.reshape(var.shape())?;
                var.set(&new.to_device(var.device())?)?;
            }
            drop(full);
            drop(comm);
        }
        Ok(())
    }

    /// Every parameter's full moments `(m, v)`, flattened, all-gathered from the
    /// replicas' shards. Collective over `dp`.
    pub fn full_moments(&self, dp: &dyn Communicator) -> Result<Vec<(Vec<f64>, Vec<f64>)>> {
        let mut out = vec![(Vec::new(), Vec::new()); self.params.len()];
        for (k, b) in self.layout.buckets.iter().enumerate() {
            let gather = |x: &[f64]| -> Result<Vec<f64>> {
                if b.whole() {
                    return Ok(x.to_vec());
                }
                let t = Tensor::from_slice(x, x.len(), &Device::Cpu)?;
                Ok(dp.all_gather(&t, 0)?.to_vec1::<f64>()?)
            };
            let (m, v) = (gather(&self.m[k])?, gather(&self.v[k])?);
            for (&i, &o) in b.params.iter().zip(&b.offsets) {
                let n = self.params[i].elem_count();
                out[i] = (m[o..o + n].to_vec(), v[o..o + n].to_vec());
            }
        }
        Ok(out)
    }

    /// Sets this replica's shards of the moments from every parameter's full (flattened)
    /// moments `(m, v)`.
    pub fn restore(&mut self, full: &[(Vec<f64>, Vec<f64>)], t: u64) -> Result<()> {
        for (k, b) in self.layout.buckets.iter().enumerate() {
            for pc in &b.pieces {
                let (m, v) = &full[pc.param];
                if m.len() != self.params[pc.param].elem_count() || v.len() != m.len() {
                    fail!(
                        Checkpoint,
                        "restoring ZeRO moments: parameter {} has {} elements, its moments {} and {}",
                        pc.param,
                        self.params[pc.param].elem_count(),
                        m.len(),
                        v.len()
                    );
                }
                let (src, dst) = (pc.from..pc.from + pc.len, pc.at..pc.at + pc.len);
                self.m[k][dst.clone()].copy_from_slice(&m[src.clone()]);
                self.v[k][dst].copy_from_slice(&v[src]);
            }
        }
        self.t = t;
        Ok(())
    }
}

/// Copies elements `from..from + out.len()` of the flattened f32 tensor `t` into `out`.
fn read_f32(t: &Tensor, from: usize, out: &mut [f32]) -> Result<()> {
    with_f32_values(t, |v| -> Result<()> {
        out.copy_from_slice(&v[from..from + out.len()]);
        Ok(())
    })
}

/// A rank's optimizer: AdamW over its whole parameters, or over its ZeRO shard of them.
pub enum Optimizer {
    /// `--zero 0`: every replica keeps the moments of every parameter it holds.
    Full(AdamW),
    /// `--zero 1|2`: the moments of this replica's `1/dp` of every bucket.
    Sharded(ShardedAdamW),
}

impl Optimizer {
    /// Steps taken so far.
    pub fn t(&self) -> u64 {
        match self {
            Optimizer::Full(o) => o.t,
            Optimizer::Sharded(o) => o.t,
        }
    }

    /// AdamW's hyper-parameters.
    pub fn config(&self) -> AdamWConfig {
        match self {
            Optimizer::Full(o) => o.config,
            Optimizer::Sharded(o) => o.config,
        }
    }

    /// Elements of moments (each of `m` and `v`) this rank keeps.
    pub fn moment_elems(&self) -> usize {
        match self {
            Optimizer::Full(o) => o.moments.iter().map(|m| m.m.len()).sum(),
            Optimizer::Sharded(o) => o.m.iter().map(Vec::len).sum(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_split_by_size_and_keep_a_large_parameter_alone() {
        // 1 MiB = 262144 f32.
        let sizes = [100_000, 100_000, 100_000, 400_000, 10];
        assert_eq!(buckets(&sizes, 1.0), vec![0..2, 2..3, 3..4, 4..5]);
        assert_eq!(buckets(&sizes, 100.0), vec![0..5]);
        assert!(buckets(&[], 1.0).is_empty());
    }

    #[test]
    fn the_shards_cover_every_element_once_with_padding_at_the_end() {
        let sizes = [5, 3, 7, 1];
        for dp in 1..=5 {
            let mut seen = vec![0; 16];
            for rank in 0..dp {
                let l = Layout::new(&sizes, &[], 100.0, dp, rank);
                let b = &l.buckets[0];
                assert_eq!((b.len, b.shard), (16, 16usize.div_ceil(dp)));
                for p in &b.pieces {
                    assert!(p.at + p.len <= b.shard);
                    let o = b.offsets[p.param];
                    let start = o + p.from;
                    assert_eq!(start, rank * b.shard + p.at);
                    for n in &mut seen[start..start + p.len] {
                        *n += 1;
                    }
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "dp {dp}: {seen:?}");
        }
    }
}
