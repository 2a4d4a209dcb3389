//! ZeRO stages 2 and 3 segment by segment: the buckets are the pipeline stages'
//! segments (one per transformer block), and the executor's [`SegmentHooks`] say when a
//! segment runs and when its gradients are final.
//!
//! - **Units.** A parameter that exactly one segment of this rank uses belongs to that
//!   segment's bucket. A parameter several segments use (a token table tied to the head
//!   on one rank), or whose copies on other pipeline ranks are summed ([`crate::Worker`]'s
//!   tied groups), is *resident*: it stays whole for the step and is reduce-scattered
//!   after the pipeline, in buckets of `bucket_mib` like stage 1's.
//! - **Gradients (stages 2 and 3).** As soon as a segment's backward of a microbatch is
//!   done (at `B`, or at `W` of a split backward), its bucket is reduce-scattered over
//!   the data-parallel replicas and the replica adds the result into its shard: the full
//!   gradients of one segment live at a time, the rank keeps `4·Ψ/dp` (FSDP and DeepSpeed
//!   reduce every microbatch too; the reduce-scatter's bytes are `m` times one step's).
//! - **Parameters (stage 3).** Each replica keeps `1/dp` of every bucket
//!   ([`ShardedAdamW::held`]); the variables are empty between uses. Before a segment
//!   runs (its forward, its recomputed forward, its backward) its bucket is all-gathered
//!   into the variables, and the stage derives its fused weights in place
//!   ([`switchyard_pipeline::Stage::begin_segment`]); after, both are freed in place.
//!   Autograd graphs that saved the weights keep valid handles: the gather before the
//!   backward writes the values back into the same storage.

use std::collections::HashMap;
use std::sync::Mutex;

use candle_core::{Tensor, TensorId, Var};
use switchyard_comm::Communicator;
use switchyard_mem::Category;
use switchyard_pipeline::{SegmentHooks, Stage};

use super::prefetch::{self, Prefetcher};
use super::scatter::{InFlight, Scatterer};
use super::{scatter_bucket, ShardedAdamW};
use crate::error::Result;

/// Which bucket each segment owns, and which parameters are resident.
#[derive(Debug, Clone, Default)]
pub struct Units {
    /// Per parameter index, its segment `(stage, segment)`, or `None` when resident.
    pub owner: Vec<Option<(u32, usize)>>,
    /// The groups of parameter indices, one per bucket: the segments' first (in stage
    /// and segment order), then the resident ones cut by size (the whole ones last).
    pub groups: Vec<Vec<usize>>,
    /// The bucket of each segment that owns parameters.
    pub bucket_of: HashMap<(u32, usize), usize>,
    /// The buckets of the resident parameters.
    pub resident: Vec<usize>,
}

impl Units {
    /// Takes out of `grads` (the executor's gradients of a stage's parameters, whose
    /// indices are `idx`) those of the parameters segment `segment` of `stage` owns,
    /// with their indices; the rest (resident, or another segment's) stay.
    pub fn take_owned(
        &self,
        (stage, segment): (u32, usize),
        idx: &[usize],
        grads: &mut [Option<Tensor>],
    ) -> Vec<(usize, Tensor)> {
        debug_assert_eq!(idx.len(), grads.len(), "one gradient slot per parameter");
        idx.iter()
            .zip(grads.iter_mut())
            .filter(|(&p, _)| self.owner[p] == Some((stage, segment)))
            .filter_map(|(&p, g)| g.take().map(|g| (p, g)))
            .collect()
    }

    /// Cuts a rank's parameters (`sizes`, by index; `index` maps a variable to its
    /// index) by the segments of its `stages` that use them; `pinned` parameters are
    /// resident whatever uses them, and so are the `whole` ones (expert parameters:
    /// summed over another group, kept entire by ZeRO), cut into buckets of their own.
    pub fn new(
        stages: &[(u32, &dyn Stage)],
        index: &HashMap<TensorId, usize>,
        sizes: &[usize],
        pinned: &[usize],
        whole: &[bool],
        bucket_mib: f64,
    ) -> Units {
        let is_whole = |p: usize| whole.get(p).copied().unwrap_or(false);
        let mut uses: Vec<Vec<(u32, usize)>> = vec![Vec::new(); sizes.len()];
        for &(s, stage) in stages {
            for i in 0..stage.num_segments() {
                for v in stage.segment_params(i) {
                    if let Some(&p) = index.get(&v.id()) {
                        if !uses[p].contains(&(s, i)) {
                            uses[p].push((s, i));
                        }
                    }
                }
            }
        }
        let owner: Vec<Option<(u32, usize)>> = uses
            .iter()
            .enumerate()
            .map(
                |(p, u)| match (u.as_slice(), pinned.contains(&p) || is_whole(p)) {
                    ([one], false) => Some(*one),
                    _ => None,
                },
            )
            .collect();
        let mut by_segment: std::collections::BTreeMap<(u32, usize), Vec<usize>> =
            Default::default();
        for (p, o) in owner.iter().enumerate() {
            if let Some(o) = o {
                by_segment.entry(*o).or_default().push(p);
            }
        }
        let mut groups = Vec::new();
        let mut bucket_of = HashMap::new();
        for (seg, params) in by_segment {
            bucket_of.insert(seg, groups.len());
            groups.push(params);
        }
        let mut resident = Vec::new();
        for w in [false, true] {
            let resident_params: Vec<usize> = (0..sizes.len())
                .filter(|&p| owner[p].is_none() && is_whole(p) == w)
                .collect();
            let resident_sizes: Vec<usize> = resident_params.iter().map(|&p| sizes[p]).collect();
            for r in super::buckets(&resident_sizes, bucket_mib) {
                resident.push(groups.len());
                groups.push(r.map(|j| resident_params[j]).collect());
            }
        }
        Units {
            owner,
            groups,
            bucket_of,
            resident,
        }
    }
}

/// The hooks of one step of one rank under ZeRO 2 or 3.
pub struct ZeroHooks<'w> {
    pub units: &'w Units,
    pub opt: &'w ShardedAdamW,
    pub dp: &'w dyn Communicator,
    /// The stages of this rank, by id, with the index of each of their parameters.
    pub stages: HashMap<u32, (&'w dyn Stage, Vec<usize>)>,
    /// Per bucket, this replica's shard of the gradients summed so far.
    pub shards: Mutex<Vec<Option<Tensor>>>,
    /// Stage 3 with prefetching: this step's gathers ahead of use.
    pub prefetch: Option<Mutex<prefetch::Step<'w>>>,
    /// With `overlap_grad_reduce`: the thread that reduce-scatters the buckets, and the
    /// one it works on.
    pub scatter: Option<(&'w Scatterer, Mutex<Option<InFlight>>)>,
}

impl<'w> ZeroHooks<'w> {
    pub fn new(
        units: &'w Units,
        opt: &'w ShardedAdamW,
        dp: &'w dyn Communicator,
        stages: &[(u32, &'w dyn Stage)],
        index: &HashMap<TensorId, usize>,
        prefetcher: Option<&'w Prefetcher>,
        scatterer: Option<&'w Scatterer>,
    ) -> Result<ZeroHooks<'w>> {
        let stages = stages
            .iter()
            .map(|&(s, st)| {
                let idx = st.params().iter().map(|v: &Var| index[&v.id()]).collect();
                (s, (st, idx))
            })
            .collect();
        let prefetch = match prefetcher {
            Some(p) if opt.held.is_some() => Some(Mutex::new(p.step(opt)?)),
            _ => None,
        };
        Ok(ZeroHooks {
            units,
            opt,
            dp,
            stages,
            shards: Mutex::new(vec![None; units.groups.len()]),
            prefetch,
            scatter: scatterer.map(|s| (s, Mutex::new(None))),
        })
    }

    fn stage3(&self) -> bool {
        self.opt.held.is_some()
    }

    /// Adds a shard into bucket `k`'s sum.
    pub fn add_shard(&self, k: usize, shard: Tensor) -> Result<()> {
        let mut shards = self.shards.lock().unwrap_or_else(|e| e.into_inner());
        shards[k] = Some(match shards[k].take() {
            Some(prev) => (prev + shard)?,
            None => shard,
        });
        Ok(())
    }

    /// Adds the shard of the bucket on the reduce-scatter thread, once it is done.
    fn take_in_flight(&self) -> Result<()> {
        let Some((_, in_flight)) = &self.scatter else {
            return Ok(());
        };
        let f = in_flight.lock().unwrap_or_else(|e| e.into_inner()).take();
        match f {
            Some(f) => {
                let k = f.k;
                self.add_shard(k, f.wait()?)
            }
            None => Ok(()),
        }
    }

    /// Every bucket's summed shard (zeros for a bucket no gradient reached), once the
    /// reduce-scatter in flight is done; ends the step's prefetching.
    pub fn into_shards(self) -> Result<Vec<Tensor>> {
        self.take_in_flight()?;
        if let Some(p) = self.prefetch {
            p.into_inner().unwrap_or_else(|e| e.into_inner()).finish()?;
        }
        let shards = self.shards.into_inner().unwrap_or_else(|e| e.into_inner());
        shards
            .into_iter()
            .zip(&self.opt.layout.buckets)
            .map(|(s, b)| match s {
                Some(s) => Ok(s),
                None => Ok(Tensor::zeros(
                    b.shard,
                    candle_core::DType::F32,
                    &candle_core::Device::Cpu,
                )?),
            })
            .collect()
    }
}

fn hook_err(e: crate::TrainError) -> candle_core::Error {
    candle_core::Error::Msg(format!("{e:#}"))
}

impl SegmentHooks for ZeroHooks<'_> {
    fn acquire(&self, stage: u32, segment: usize) -> candle_core::Result<()> {
        if !self.stage3() {
            return Ok(());
        }
        if let Some(&k) = self.units.bucket_of.get(&(stage, segment)) {
            match &self.prefetch {
                Some(p) => p
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .gather(self.opt, self.dp, k),
                None => self.opt.gather(self.dp, k),
            }
            .map_err(hook_err)?;
        }
        // The fused weights are what the fused ops pack (`other`, as begin_step's).
        let _other = switchyard_mem::scope(Category::Other);
        self.stages[&stage].0.begin_segment(segment)
    }

    fn release(&self, stage: u32, segment: usize) -> candle_core::Result<()> {
        if !self.stage3() {
            return Ok(());
        }
        self.stages[&stage].0.release_segment(segment)?;
        if let Some(&k) = self.units.bucket_of.get(&(stage, segment)) {
            self.opt.release(k).map_err(hook_err)?;
        }
        Ok(())
    }

    fn grads(
        &self,
        stage: u32,
        segment: usize,
        grads: &mut [Option<Tensor>],
    ) -> candle_core::Result<()> {
        let Some(&k) = self.units.bucket_of.get(&(stage, segment)) else {
            return Ok(());
        };
        // The segment's own parameters, by index; the rest (resident) stay in `grads`.
        let idx = &self.stages[&stage].1;
        let mut mine: HashMap<usize, Tensor> = self
            .units
            .take_owned((stage, segment), idx, grads)
            .into_iter()
            .collect();
        let _gradients = switchyard_mem::scope(Category::Gradients);
        let b = &self.opt.layout.buckets[k];
        let Some((thread, in_flight)) = &self.scatter else {
            let shard = scatter_bucket(b, self.dp, |p| mine.remove(&p)).map_err(hook_err)?;
            return self.add_shard(k, shard).map_err(hook_err);
        };
        // One bucket on the thread at a time: the one before this segment's is done
        // (its shard added, in microbatch order) before this one goes.
        self.take_in_flight().map_err(hook_err)?;
        let f = thread.start(k, b.clone(), mine).map_err(hook_err)?;
        *in_flight.lock().unwrap_or_else(|e| e.into_inner()) = Some(f);
        Ok(())
    }
}
