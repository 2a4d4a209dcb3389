//! One rank of a training job: its stages, its shard of the parameters, its optimizer,
//! and one training step from data to update.
//!
//! A step:
//! 1. the pipeline executor runs this rank's actions of the schedule over its
//!    microbatches (with tensor-parallel collectives inside the layers);
//! 2. tied parameters ([`switchyard_models::Tied`], such as a token table shared with
//!    the LM head): the copies' gradients are summed over the ranks that hold them;
//! 3. data parallelism: gradients are summed over the replicas in buckets (the loss was
//!    already scaled by `1 / (microbatches · dp)`, so the sum is the mean);
//! 4. one small all-gather over the world shares every rank's loss, squared gradient norm
//!    and non-finite flags, so every rank knows the job's loss and global norm and
//!    stops at the same step if anything is not finite;
//! 5. gradients are clipped by the global norm and AdamW updates this rank's shards.
//!
//! With ZeRO (`--zero 1|2|3`, [`crate::zero`]) step 3 is a reduce-scatter instead: each
//! replica keeps its `1/dp` of every bucket, the norm adds up the replicas' shards, AdamW
//! updates the replica's shard with the moments of that shard only, and an all-gather
//! gives every replica the whole updated parameters. Stages 2 and 3 reduce-scatter each
//! segment's bucket inside step 1, as its backward ends ([`crate::zero::ZeroHooks`]);
//! stage 3 skips the all-gather: the next step gathers each segment's parameters just
//! before it runs.
//!
//! The files: this one builds a worker and runs a step; `pass.rs` runs the step's
//! pipeline pass with the hooks that reduce gradients during it; `grads.rs` sums gradients over
//! replicas and tied copies and gathers ZeRO 3's parameters whole ([`Worker::gathered`]);
//! `validation.rs` scores the validation split; `state.rs` is the checkpoint's part;
//! `metrics.rs` holds what a step reports.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device, Tensor, TensorId, Var};
use switchyard_comm::{Communicator, Mesh, Spans, Timed};
use switchyard_mem::Category;
use switchyard_models::{plan_stages, Model};
use switchyard_pipeline::{CheckedProgram, Stage, StepStats};
use switchyard_schedule::Program;
use switchyard_shard::{Param, ParamSource, ParamStore, ShardSpec};

use crate::data::Dataset;
use crate::error::{fail, Context, Result};
use crate::optim::{sum_sq, AdamW, LrSchedule};
use crate::zero::{self, Optimizer, Prefetcher, Scatterer, ShardedAdamW, Units};
use crate::{Recompute, TrainConfig};

mod grads;
mod metrics;
mod overlap;
mod pass;
mod state;
mod validation;

pub use metrics::{CommSpan, NonFinite, StepMetrics};
pub use overlap::{GradReduceStats, GradReducer, ReduceSpan};
use pass::Hooks;

/// One rank's state.
pub struct Worker<'a, M: Model> {
    pub cfg: TrainConfig<M>,
    pub mesh: Mesh,
    program: CheckedProgram,
    store: ParamStore,
    stages: Vec<(u32, M::Stage)>,
    /// Per stage, the parameters the executor collects gradients for: the stage's own,
    /// and the tied ones it uses that another stage of this rank created.
    stage_params: Vec<Vec<Var>>,
    params: Vec<Param>,
    index: HashMap<TensorId, usize>,
    /// Whether a parameter's gradient counts toward the global norm on this rank (each
    /// parameter counted once per replica).
    owned: Vec<bool>,
    /// Whether a parameter belongs to one expert (`--ep`, [`Param::expert`]): held by
    /// this rank of its expert group only.
    expert: Vec<bool>,
    /// `--ep` with more replicas than one expert group: the replicas that hold the same
    /// experts as this one, over which the experts' gradients are summed.
    edp: Option<Arc<dyn Communicator>>,
    /// `--ep`: what the expert group's collectives recorded (for the trace).
    expert_spans: Option<Spans>,
    /// Each tied parameter this rank holds whose copies live on other pipeline ranks
    /// too: its index and the group of the ranks that hold a copy.
    tied: Vec<(usize, Arc<dyn Communicator>)>,
    /// ZeRO 2 and 3: the buckets of the segments and the resident parameters.
    units: Option<Units>,
    /// ZeRO 3 with `zero_prefetch`: the thread that gathers the next segment ahead.
    prefetcher: Option<Prefetcher>,
    /// ZeRO 2 and 3 with `overlap_grad_reduce`: the reduce-scatter thread.
    scatterer: Option<Scatterer>,
    /// `overlap_grad_reduce` (without ZeRO, `dp > 1`): the buckets of the segments and
    /// the thread that all-reduces them during the backward.
    overlap: Option<(Units, GradReducer)>,
    pub opt: Optimizer,
    pub schedule: LrSchedule,
    data: &'a dyn Dataset,
    epoch: Instant,
}

impl<'a, M: Model> Worker<'a, M> {
    /// Builds this rank's part of the job. Collective over `world`.
    pub fn new(
        world: Arc<dyn Communicator>,
        cfg: &TrainConfig<M>,
        data: &'a dyn Dataset,
        source: ParamSource,
    ) -> Result<Worker<'a, M>> {
        cfg.validate()?;
        let mesh = Mesh::new(world.clone(), cfg.mesh())?;
        let program = CheckedProgram::new(&cfg.program()?)?;
        let pipe = program.program();
        let plans = plan_stages(&cfg.model.costs(cfg.seq_len), cfg.num_stages(), &cfg.split)?;
        // Measured memory (switchyard-mem): what building the stages allocates is
        // parameters.
        let category = switchyard_mem::scope(Category::Parameters);
        let device = cfg.device.open()?;
        let store = ParamStore::for_group_on(&*mesh.tp, &device, DType::F32, source)?;
        store.set_selective_recompute(cfg.recompute == Recompute::Selective);
        store.set_sequence_parallel(cfg.sequence_parallel);
        // Expert parallelism: groups of `ep` consecutive replicas spread the experts
        // over their ranks (the "ep" group, for the all-to-alls); replicas `r` with the
        // same `r % ep` hold the same experts (the "edp" group, which sums their
        // gradients; none when every replica is in one expert group). Every rank takes
        // part in both splits of its data-parallel group.
        let (mut edp, mut expert_spans) = (None, None);
        if cfg.ep > 1 {
            let r = mesh.coord.dp;
            // Timed: the layers' all-to-alls show in the trace.
            let (group, spans) = Timed::wrap(mesh.dp.split_named(r / cfg.ep, r, "ep")?);
            store.set_expert_group(Some(group));
            expert_spans = Some(spans);
            let group = mesh.dp.split_named(r % cfg.ep, r, "edp")?;
            edp = (group.world_size() > 1).then_some(group);
        }
        let mut stages = Vec::new();
        for s in pipe.stages_of_rank(mesh.coord.pp as u32) {
            let stage = cfg
                .model
                .stage(&plans[s as usize], &store, mesh.tp.clone())?;
            stages.push((s, stage));
        }
        let tied_params = cfg.model.tied(cfg.num_stages());
        // A stage that uses a tied parameter another stage of this rank created gets
        // that variable too.
        let stage_params = stages
            .iter()
            .map(|(s, stage)| {
                let mut own = stage.params().to_vec();
                for t in tied_params
                    .iter()
                    .filter(|t| t.stages.contains(&(*s as usize)))
                {
                    let Some(p) = store.get(&t.name) else {
                        fail!(
                            Config,
                            "{}: stage {s} uses the tied parameter {} but did not create it",
                            M::NAME,
                            t.name
                        );
                    };
                    if !own.iter().any(|v| v.id() == p.var.id()) {
                        own.push(p.var);
                    }
                }
                Ok(own)
            })
            .collect::<Result<_>>()?;
        let params = store.params();
        let expert: Vec<bool> = params.iter().map(|p| p.expert.is_some()).collect();
        let index: HashMap<TensorId, usize> = params
            .iter()
            .enumerate()
            .map(|(i, p)| (p.var.id(), i))
            .collect();
        // A tied parameter counts (global norm, checkpoint) on the rank of its owner
        // stage only.
        let runs = |stage: usize| stages.iter().any(|(s, _)| *s as usize == stage);
        let owned = params
            .iter()
            .map(|p| {
                let copy = tied_params
                    .iter()
                    .any(|t| t.name == p.name && !runs(t.stages[0]));
                !copy && (p.spec != ShardSpec::Replicated || mesh.coord.tp == 0)
            })
            .collect();
        // One group per tied parameter whose stages span several pipeline ranks; every
        // rank takes part in every split (color 0: not a member).
        let mut tied = Vec::new();
        for t in &tied_params {
            let mut ranks: Vec<u32> = t
                .stages
                .iter()
                .map(|&s| pipe.rank_of_stage(s as u32))
                .collect();
            ranks.sort_unstable();
            ranks.dedup();
            if ranks.len() < 2 {
                continue;
            }
            let me = mesh.coord.pp as u32;
            let (color, key) = match ranks.contains(&me) {
                true => (1 + mesh.coord.dp * cfg.tp + mesh.coord.tp, mesh.coord.pp),
                false => (0, world.rank()),
            };
            let group = world.split_named(color, key, &format!("tied:{}", t.name))?;
            if let Some(i) = params.iter().position(|p| p.name == t.name) {
                tied.push((i, group));
            }
        }
        drop(category);
        let sizes: Vec<usize> = params.iter().map(|p| p.var.elem_count()).collect();
        let cut = || {
            let refs: Vec<(u32, &dyn Stage)> = stages
                .iter()
                .map(|(s, st)| (*s, st as &dyn Stage))
                .collect();
            let pinned: Vec<usize> = tied.iter().map(|(i, _)| *i).collect();
            Units::new(&refs, &index, &sizes, &pinned, &expert, cfg.bucket_mib)
        };
        let units = (cfg.zero >= 2).then(cut);
        let overlap = match cfg.overlaps_grad_reduce() {
            true => Some((cut(), GradReducer::new(&*mesh.dp)?)),
            false => None,
        };
        let mut opt = {
            let _optimizer = switchyard_mem::scope(Category::Optimizer);
            let vars: Vec<Var> = params.iter().map(|p| p.var.clone()).collect();
            let (dp, r) = (cfg.dp, mesh.coord.dp);
            // Stage 1 cuts buckets by size, stages 2 and 3 by segment.
            let layout = match &units {
                _ if cfg.zero == 0 => None,
                Some(u) => Some(zero::Layout::of_groups(
                    u.groups.clone(),
                    &sizes,
                    &expert,
                    dp,
                    r,
                )),
                None => Some(zero::Layout::new(&sizes, &expert, cfg.bucket_mib, dp, r)),
            };
            match layout {
                None => Optimizer::Full(AdamW::new(vars, cfg.adamw())),
                Some(l) => Optimizer::Sharded(ShardedAdamW::new(vars, cfg.adamw(), l)),
            }
        };
        if let (3, Optimizer::Sharded(o)) = (cfg.zero, &mut opt) {
            let _parameters = switchyard_mem::scope(Category::Parameters);
            o.shard_params()
                .context("ZeRO 3: cutting the parameters into this replica's shards")?;
        }
        let prefetcher = match cfg.zero == 3 && cfg.zero_prefetch {
            true => Some(Prefetcher::new(&*mesh.dp)?),
            false => None,
        };
        let scatterer = match cfg.overlaps_reduce_scatter() {
            true => Some(Scatterer::new(&*mesh.dp)?),
            false => None,
        };
        let schedule = LrSchedule {
            max_lr: cfg.lr,
            min_lr: cfg.min_lr,
            warmup: cfg.warmup,
            total: cfg.steps,
        };
        Ok(Worker {
            cfg: cfg.clone(),
            mesh,
            program,
            store,
            stages,
            stage_params,
            params,
            index,
            owned,
            expert,
            edp,
            expert_spans,
            tied,
            units,
            prefetcher,
            scatterer,
            overlap,
            opt,
            schedule,
            data,
            epoch: Instant::now(),
        })
    }

    /// Whether parameter `i` counts on this rank where every parameter of the job counts
    /// once (the global norm without ZeRO, the checkpoint): an owned one (`owned`) on
    /// the first replica, or for an expert on the first expert group, whose ranks hold
    /// one copy of every expert between them.
    fn counts_once(&self, i: usize) -> bool {
        let dp = self.mesh.coord.dp;
        self.owned[i]
            && match self.expert[i] {
                true => self.in_first_expert_group(),
                false => dp == 0,
            }
    }

    /// Whether this replica is in the first expert group (`dp < ep`), whose ranks hold
    /// one copy of every expert between them.
    fn in_first_expert_group(&self) -> bool {
        self.mesh.coord.dp < self.cfg.ep
    }

    /// The expert group's collectives since the last call, timed from the epoch.
    fn expert_comm(&self) -> Vec<CommSpan> {
        let Some(spans) = &self.expert_spans else {
            return Vec::new();
        };
        let us = |t: Instant| t.saturating_duration_since(self.epoch).as_secs_f64() * 1e6;
        spans
            .take()
            .into_iter()
            .map(|s| CommSpan {
                op: s.op,
                start_us: us(s.start),
                dur_us: s.dur.as_secs_f64() * 1e6,
                bytes: s.bytes,
            })
            .collect()
    }

    /// Times in traces are measured from `epoch`.
    pub fn set_epoch(&mut self, epoch: Instant) {
        self.epoch = epoch;
    }

    pub fn program(&self) -> &Program {
        self.program.program()
    }

    pub fn params(&self) -> &[Param] {
        &self.params
    }

    pub fn store(&self) -> &ParamStore {
        &self.store
    }

    /// ZeRO 2 and 3: how the parameters are cut into the segments' buckets.
    pub fn zero_units(&self) -> Option<&Units> {
        self.units.as_ref()
    }

    /// `t` (a batch from the data, or an activation a communicator handed back in host
    /// memory) on the device of this rank's parameters; itself when it is there.
    fn on_device(&self, t: &Tensor) -> Result<Tensor> {
        Ok(t.to_device(self.store.device())?)
    }

    /// Forward and backward over this step's microbatches: this rank's gradient of each
    /// parameter (not yet summed over replicas or tied copies), the losses of the
    /// microbatches that ended here, and the executor's measurements. Under ZeRO 3 the
    /// parameters are gathered whole for it (for parity tests: a step reduce-scatters
    /// segment by segment instead).
    pub fn compute_grads(&self, step: usize) -> Result<(Vec<Option<Tensor>>, Vec<f64>, StepStats)> {
        let pass = self.gathered(|| self.run_pipeline(step, Hooks::Plain))?;
        Ok((pass.grads, pass.losses, pass.stats))
    }

    /// [`Worker::compute_grads`] then [`Worker::sync_grads`], the way a step does it:
    /// with `overlap_grad_reduce` the segments' buckets are all-reduced during the
    /// backward. Collective over the world.
    pub fn synced_grads(&self, step: usize) -> Result<(Vec<Option<Tensor>>, Vec<f64>, StepStats)> {
        if self.overlap.is_none() {
            let (mut grads, losses, stats) = self.compute_grads(step)?;
            self.sync_grads(&mut grads)?;
            return Ok((grads, losses, stats));
        }
        let mut pass = self.run_pipeline(step, Hooks::Overlap)?;
        self.sync_grads_after(&mut pass.grads, pass.reduced)?;
        Ok((pass.grads, pass.losses, pass.stats))
    }

    /// What this rank's stages counted since the last call, in the order of
    /// [`switchyard_models::Model::step_metrics`]; zeros but on tensor rank 0 (its
    /// peers counted the same).
    pub(super) fn model_metrics(&self) -> Vec<f64> {
        let names = self.cfg.model.step_metrics();
        let mut out = vec![0.0; names.len()];
        for (_, s) in &self.stages {
            for (n, v) in switchyard_models::ModelStage::take_metrics(s) {
                if let Some(k) = names.iter().position(|m| *m == n) {
                    if self.mesh.coord.tp == 0 {
                        out[k] += v;
                    }
                }
            }
        }
        out
    }

    /// One full training step (see the module docs). Collective over the world.
    pub fn step(&mut self, step: usize) -> Result<std::result::Result<StepMetrics, NonFinite>> {
        let t0 = Instant::now();
        // What validation or a test's extra pass recorded is not this step's.
        self.expert_spans.iter().for_each(|s| drop(s.take()));
        let hooks = match (&self.units, &self.overlap) {
            (Some(_), _) => Hooks::Zero,
            (None, Some(_)) => Hooks::Overlap,
            (None, None) => Hooks::Plain,
        };
        let pass = self.run_pipeline(step, hooks)?;
        let expert_comm = self.expert_comm();
        let (mut grads, losses, exec) = (pass.grads, pass.losses, pass.stats);
        let counted = self.model_metrics();
        // ZeRO: this replica's shard of every bucket, summed over the replicas.
        let mut shards = None;
        let mut grad_reduce = None;
        let (sq_owned, bad_grad) = match &self.opt {
            Optimizer::Full(_) => {
                grad_reduce = self.sync_grads_after(&mut grads, pass.reduced)?;
                let mut sq_owned = 0.0;
                let mut bad_grad = None;
                for (i, (g, p)) in grads.iter().zip(&self.params).enumerate() {
                    let s = sum_sq(g.as_ref().expect("synced"))?;
                    if !s.is_finite() && bad_grad.is_none() {
                        bad_grad = Some(p.name.clone());
                    }
                    if self.counts_once(i) {
                        sq_owned += s;
                    }
                }
                (sq_owned, bad_grad)
            }
            Optimizer::Sharded(o) => {
                // Stage 1 reduce-scatters every bucket now; stages 2 and 3 did their
                // segments' during the backward, and do the resident ones now.
                let (which, mut s) = match (&self.units, pass.shards) {
                    (Some(u), Some(s)) => (u.resident.clone(), s),
                    _ => ((0..o.layout.buckets.len()).collect(), Vec::new()),
                };
                self.sync_tied(&mut grads, self.units.is_none())?;
                self.sync_experts(&mut grads)?;
                let _gradients = switchyard_mem::scope(Category::Gradients);
                let scattered = zero::reduce_scatter(
                    &o.layout,
                    which,
                    &*self.mesh.dp,
                    &mut grads,
                    self.cfg.zero == 1,
                )
                .with_context(|| {
                    format!("ZeRO {}: the gradients' reduce-scatter", self.cfg.zero)
                })?;
                if s.is_empty() {
                    s = scattered.into_iter().map(|(_, t)| t).collect();
                } else {
                    for (k, t) in scattered {
                        s[k] = t;
                    }
                }
                // Every replica adds the squares of its own shard: together, each
                // element once (an expert's whole bucket: on one expert group).
                let counted: Vec<bool> = (0..self.params.len())
                    .map(|i| self.owned[i] && (!self.expert[i] || self.in_first_expert_group()))
                    .collect();
                let (sq, bad) = zero::shard_norm(&o.layout, &s, &counted)?;
                shards = Some(s);
                (sq, bad.map(|i| self.params[i].name.clone()))
            }
        };
        let reports_loss = self.mesh.coord.tp == 0 && !losses.is_empty();
        let loss_sum: f64 = if reports_loss {
            losses.iter().sum()
        } else {
            0.0
        };
        let bad_loss = losses.iter().any(|l| !l.is_finite());
        let mut mine = vec![
            loss_sum,
            if reports_loss {
                losses.len() as f64
            } else {
                0.0
            },
            if sq_owned.is_finite() { sq_owned } else { 0.0 },
            f64::from(u8::from(bad_loss)),
            f64::from(u8::from(bad_grad.is_some())),
            grad_reduce.as_ref().map_or(-1.0, |g| g.pipeline_end_us),
            grad_reduce.as_ref().map_or(-1.0, |g| g.done_us),
        ];
        let base = mine.len();
        mine.extend(&counted);
        let all = self
            .mesh
            .world
            .all_gather(&Tensor::new(mine.as_slice(), &Device::Cpu)?, 0)?
            .to_vec1::<f64>()?;
        let rows: Vec<&[f64]> = all.chunks(mine.len()).collect();
        if let Some(g) = grad_reduce.as_mut() {
            self.group_times(g, &rows);
        }
        // A loss goes bad in the forward pass, before any gradient: report it first.
        let bad_loss_rank = rows.iter().position(|x| x[3] != 0.0);
        if let Some(r) = bad_loss_rank.or_else(|| rows.iter().position(|x| x[4] != 0.0)) {
            let me = self.mesh.world.rank();
            let detail = (r == me).then(|| match (&bad_grad, bad_loss_rank == Some(me)) {
                (_, true) => format!(
                    "the loss of a microbatch is {}",
                    losses.iter().find(|l| !l.is_finite()).unwrap()
                ),
                (Some(name), false) => format!("the gradient of {name} is not finite"),
                (None, false) => "non-finite values".into(),
            });
            return Ok(Err(NonFinite {
                step,
                rank: r,
                detail,
            }));
        }
        let count: f64 = rows.iter().map(|x| x[1]).sum();
        let loss = rows.iter().map(|x| x[0]).sum::<f64>() / count;
        let names = self.cfg.model.step_metrics();
        let model = names
            .into_iter()
            .enumerate()
            .map(|(k, n)| (n, rows.iter().map(|x| x[base + k]).sum::<f64>()))
            .collect();
        let grad_norm = rows.iter().map(|x| x[2]).sum::<f64>().sqrt();
        let clip = self.cfg.grad_clip;
        if clip > 0.0 && grad_norm > clip {
            let scale = clip / (grad_norm + 1e-6);
            let _gradients = switchyard_mem::scope(Category::Gradients);
            match shards.as_mut() {
                Some(shards) => {
                    for g in shards.iter_mut() {
                        *g = g.affine(scale, 0.0)?;
                    }
                }
                None => {
                    for g in grads.iter_mut().flatten() {
                        *g = g.affine(scale, 0.0)?;
                    }
                }
            }
        }
        let lr = self.schedule.at(step);
        {
            let _optimizer = switchyard_mem::scope(Category::Optimizer);
            match (&mut self.opt, &shards) {
                (Optimizer::Full(o), _) => o.step(&grads, lr)?,
                (Optimizer::Sharded(o), Some(shards)) => {
                    o.step(&*self.mesh.dp, shards, lr).with_context(|| {
                        format!(
                            "ZeRO {}: the sharded AdamW step and the parameters' all-gather",
                            self.cfg.zero
                        )
                    })?
                }
                (Optimizer::Sharded(_), None) => unreachable!("scattered above"),
            }
        }
        // Stage 1 kept the full gradients until here.
        drop(grads);
        Ok(Ok(StepMetrics {
            step,
            loss,
            grad_norm,
            lr,
            seconds: t0.elapsed().as_secs_f64(),
            exec,
            val_loss: None,
            grad_reduce,
            model,
            expert_comm,
        }))
    }
}
