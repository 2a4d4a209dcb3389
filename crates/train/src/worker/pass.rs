//! One pipeline pass of a step on this rank: the executor over the step's microbatches,
//! with the hooks that reduce-scatter (ZeRO 2 and 3) or all-reduce
//! (`overlap_grad_reduce`) each segment's gradients during the backward, and the
//! data-parallel group's exposed communication measured from every rank's times.

use candle_core::{Tensor, Var};
use switchyard_models::{DropoutStep, Model, ModelStage};
use switchyard_pipeline::{Executor, Microbatches, Stage, StepStats};

use super::overlap::{GradReduceStats, ReduceHooks, Reduced};
use super::Worker;
use crate::data::Sampler;
use crate::error::Result;
use crate::zero::{Optimizer, ZeroHooks};
use crate::Recompute;

/// Which hooks a pipeline pass runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Hooks {
    /// None: the gradients come back whole, not summed over anything.
    Plain,
    /// ZeRO 2 and 3: each segment's bucket reduce-scattered as its backward ends.
    Zero,
    /// `overlap_grad_reduce`: each segment's bucket all-reduced on the communication
    /// thread once the last microbatch made it final.
    Overlap,
}

/// What one pipeline pass of a step produced on this rank.
pub(super) struct Pass {
    /// Per parameter, this rank's gradient (`None` where the hooks took it).
    pub(super) grads: Vec<Option<Tensor>>,
    /// The losses of the microbatches that ended here.
    pub(super) losses: Vec<f64>,
    pub(super) stats: StepStats,
    /// ZeRO 2 and 3: this replica's summed shard of every bucket.
    pub(super) shards: Option<Vec<Tensor>>,
    /// `overlap_grad_reduce`: the buckets already summed over the replicas.
    pub(super) reduced: Option<Reduced>,
}

/// A model's stage as the executor sees it: its own parameters and the tied ones it
/// uses without having created them.
struct Wrapped<'a, S> {
    stage: &'a S,
    params: &'a [Var],
    /// ZeRO 3: the parameters are empty at the step's start, so nothing is derived from
    /// them for the whole step (segments derive theirs when gathered).
    zero3: bool,
}

impl<S: ModelStage> Stage for Wrapped<'_, S> {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        self.stage.forward(x)
    }
    fn num_segments(&self) -> usize {
        self.stage.num_segments()
    }
    fn forward_segment(&self, i: usize, x: &Tensor) -> candle_core::Result<Tensor> {
        self.stage.forward_segment(i, x)
    }
    fn split_backward(&self, split: bool) {
        self.stage.split_backward(split)
    }
    fn microbatch(&self, microbatch: u32) {
        self.stage.microbatch(microbatch)
    }
    fn backward_weights(&self, microbatch: u32) -> candle_core::Result<Vec<(Var, Tensor)>> {
        self.stage.backward_weights(microbatch)
    }
    fn params(&self) -> &[Var] {
        self.params
    }
    fn segment_params(&self, i: usize) -> Vec<Var> {
        self.stage.segment_params(i)
    }
    fn begin_segment(&self, i: usize) -> candle_core::Result<()> {
        self.stage.begin_segment(i)
    }
    fn release_segment(&self, i: usize) -> candle_core::Result<()> {
        self.stage.release_segment(i)
    }
    fn begin_step(&self) -> candle_core::Result<()> {
        match self.zero3 {
            true => Ok(()),
            false => self.stage.begin_step(),
        }
    }
    fn end_step(&self) {
        self.stage.end_step()
    }
    fn set_loss_scale(&self, scale: f64) {
        self.stage.set_loss_scale(scale)
    }
    fn recomputing(&self, on: bool) {
        self.stage.recomputing(on)
    }
}

/// Tells a rank's stages which step their dropouts draw masks for, and when dropped
/// (after the pass, also after an error) that the step is over.
struct InStep<'a, S: ModelStage>(&'a [(u32, S)]);

impl<'a, S: ModelStage> InStep<'a, S> {
    fn new(stages: &'a [(u32, S)], step: DropoutStep) -> Self {
        stages
            .iter()
            .for_each(|(_, s)| s.set_dropout_step(Some(step)));
        InStep(stages)
    }
}

impl<S: ModelStage> Drop for InStep<'_, S> {
    fn drop(&mut self) {
        self.0.iter().for_each(|(_, s)| s.set_dropout_step(None));
    }
}

impl<M: Model> Worker<'_, M> {
    /// [`Worker::compute_grads`] with `hooks`: under [`Hooks::Zero`] the gradients of
    /// the segments' buckets come back as this replica's summed shards, under
    /// [`Hooks::Overlap`] summed over the replicas; the resident parameters' in
    /// [`Pass::grads`] in both.
    pub(super) fn run_pipeline(&self, step: usize, hooks: Hooks) -> Result<Pass> {
        let c = &self.cfg;
        let (m, mbs) = (c.microbatches, c.microbatch_size());
        let per_replica = c.batch / c.dp;
        let first = self.mesh.coord.dp * per_replica;
        let (x, y) = self
            .data
            .batch(&Sampler::of(c), step, first..first + per_replica)?;
        let (x, y) = (self.on_device(&x)?, self.on_device(&y)?);
        let step_rows = DropoutStep {
            seed: c.seed,
            step: step as u64,
            first_row: first,
        };
        let _in_step = InStep::new(&self.stages, step_rows);
        let inputs = (0..m)
            .map(|i| x.narrow(0, i * mbs, mbs))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let targets = (0..m)
            .map(|i| y.narrow(0, i * mbs, mbs))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let last = self.program().num_stages - 1;
        let head = self.stages.iter().find(|(s, _)| *s == last).map(|(_, g)| g);
        let loss = |out: &Tensor, mb: usize| match head {
            Some(h) => h.loss(out, &targets[mb]),
            None => {
                candle_core::bail!("the loss runs on the last stage, which is not on this rank")
            }
        };
        let wrapped: Vec<Wrapped<M::Stage>> = self
            .stages
            .iter()
            .zip(&self.stage_params)
            .map(|((_, stage), params)| Wrapped {
                stage,
                params,
                zero3: self.cfg.zero == 3,
            })
            .collect();
        let refs: Vec<(u32, &dyn Stage)> = self
            .stages
            .iter()
            .zip(&wrapped)
            .map(|((s, _), w)| (*s, w as &dyn Stage))
            .collect();
        let zero_hooks = match (hooks, &self.units, &self.opt) {
            (Hooks::Zero, Some(units), Optimizer::Sharded(o)) => Some(ZeroHooks::new(
                units,
                o,
                &*self.mesh.dp,
                &refs,
                &self.index,
                self.prefetcher.as_ref(),
                self.scatterer.as_ref(),
            )?),
            _ => None,
        };
        let reduce_hooks = match (hooks, &self.overlap) {
            (Hooks::Overlap, Some((units, reducer))) => Some(ReduceHooks::new(
                reducer,
                units,
                &self.params,
                &refs,
                &self.index,
                m,
            )),
            _ => None,
        };
        let mut exec = Executor::with_checked(&self.program, &*self.mesh.pp, refs)?
            .with_epoch(self.epoch)
            .with_recompute(self.cfg.recompute == Recompute::Full);
        if let Some(h) = &zero_hooks {
            exec = exec.with_hooks(h);
        }
        if let Some(h) = &reduce_hooks {
            exec = exec.with_hooks(h);
        }
        let microbatches = Microbatches {
            inputs,
            loss: &loss,
            loss_scale: 1.0 / (m * c.dp) as f64,
        };
        // ZeRO 3: the resident parameters stay whole for the step.
        let out = match (&zero_hooks, &self.units, &self.opt) {
            (Some(_), Some(units), Optimizer::Sharded(o)) if o.held.is_some() => {
                self.with_buckets(o, &units.resident, || Ok(exec.run(&microbatches)?))?
            }
            _ => exec.run(&microbatches)?,
        };
        let mut grads: Vec<Option<Tensor>> = vec![None; self.params.len()];
        for ((_, gs), w) in out.grads.into_iter().zip(&wrapped) {
            for (g, v) in gs.into_iter().zip(w.params) {
                let (Some(g), Some(&i)) = (g, self.index.get(&v.id())) else {
                    continue;
                };
                grads[i] = Some(match grads[i].take() {
                    Some(prev) => (prev + g)?,
                    None => g,
                });
            }
        }
        let losses = out.losses.into_iter().map(|(_, l)| l).collect();
        let shards = zero_hooks.map(ZeroHooks::into_shards).transpose()?;
        let reduced = reduce_hooks.map(|h| h.finish(self.epoch)).transpose()?;
        Ok(Pass {
            grads,
            losses,
            stats: out.stats,
            shards,
            reduced,
        })
    }

    /// Fills in `g`'s exposed communication and imbalance from the rows of every rank
    /// (`[.., pipeline end, all-reduces done]`) of this rank's data-parallel group.
    pub(super) fn group_times(&self, g: &mut GradReduceStats, rows: &[&[f64]]) {
        let mesh = self.cfg.mesh();
        let me = self.mesh.coord;
        let group: Vec<(f64, f64)> = rows
            .iter()
            .enumerate()
            .filter(|&(r, _)| {
                let c = mesh.coord(r);
                (c.pp, c.tp) == (me.pp, me.tp)
            })
            .map(|(_, x)| (x[x.len() - 2], x[x.len() - 1]))
            .collect();
        let max = |f: &dyn Fn(&(f64, f64)) -> f64| group.iter().map(f).fold(f64::MIN, f64::max);
        let min_end = group.iter().map(|x| x.0).fold(f64::MAX, f64::min);
        let us = |x: f64| std::time::Duration::from_secs_f64(x.max(0.0) / 1e6);
        g.exposed = us(max(&|x| x.1) - max(&|x| x.0));
        g.imbalance = us(max(&|x| x.0) - min_end);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// A stage that records the dropout steps it is told.
    #[derive(Default)]
    struct Probe(Mutex<Vec<Option<DropoutStep>>>);

    impl Stage for Probe {
        fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
            Ok(x.clone())
        }
        fn params(&self) -> &[Var] {
            &[]
        }
    }

    impl ModelStage for Probe {
        fn loss(&self, out: &Tensor, _: &Tensor) -> candle_core::Result<Tensor> {
            Ok(out.clone())
        }
        fn set_dropout_step(&self, step: Option<DropoutStep>) {
            self.0.lock().unwrap().push(step);
        }
    }

    /// Every stage of the rank gets the step for the pass and loses it after, also when
    /// the pass ends in an error or a panic.
    #[test]
    fn the_step_is_set_for_the_pass_and_unset_after_it() {
        let step = DropoutStep {
            seed: 3,
            step: 7,
            first_row: 4,
        };
        let stages = vec![(0, Probe::default()), (2, Probe::default())];
        let told = |s: &Probe| s.0.lock().unwrap().clone();
        let pass = |fail: bool| -> std::result::Result<(), &'static str> {
            let _in_step = InStep::new(&stages, step);
            for (_, s) in &stages {
                assert_eq!(told(s).last(), Some(&Some(step)));
            }
            if fail {
                return Err("the pass failed");
            }
            Ok(())
        };
        assert!(pass(false).is_ok());
        assert!(pass(true).is_err());
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _in_step = InStep::new(&stages, step);
            panic!("a stage panicked");
        }));
        assert!(panicked.is_err());
        for (_, s) in &stages {
            assert_eq!(told(s), [Some(step), None].repeat(3));
        }
    }
}
