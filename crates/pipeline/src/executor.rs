//! The executor: performs one rank's actions of a lowered program.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use candle_core::{Result, Tensor, Var};
use serde::Serialize;
use switchyard_comm::Communicator;
use switchyard_schedule::{lower, tag, validate, Action, Op, Program};

use crate::segments::{
    self, backward, forward_graphs, forward_inputs, recompute, Hooked, LossFn, SegmentGrads,
    SegmentGraph, SegmentHooks,
};
use crate::{PipelineError, Stage};

/// One step's microbatches.
pub struct Microbatches<'b> {
    /// The input of each microbatch to the first stage. Only the rank that runs stage 0
    /// reads it; other ranks may pass an empty vector.
    pub inputs: Vec<Tensor>,
    /// On the last stage: the scalar loss of a microbatch from the stage's output and
    /// the microbatch index.
    pub loss: &'b (dyn Fn(&Tensor, usize) -> Result<Tensor> + Sync),
    /// What each microbatch's loss is multiplied by before its backward pass, so that
    /// the accumulated gradients are those of the mean loss (`1 / (microbatches · dp)`
    /// for a data-parallel mean).
    pub loss_scale: f64,
}

/// One action's place on the timeline.
#[derive(Debug, Clone, Serialize)]
pub struct TraceEvent {
    /// The action (serialized in its text form, `1F3`).
    pub action: Action,
    /// Start, in microseconds since the executor's epoch.
    pub start_us: f64,
    /// Duration in microseconds.
    pub dur_us: f64,
}

/// What the executor measured during a step.
#[derive(Debug, Clone, Default)]
pub struct StepStats {
    /// The most microbatches whose activations this rank held at once (from their
    /// forward until their backward, or their `W` for a split backward).
    pub peak_activations: usize,
    /// The same, per stage on this rank.
    pub peak_per_stage: BTreeMap<u32, usize>,
    /// Every action, in order.
    pub events: Vec<TraceEvent>,
    /// Time spent in compute actions (`F`, `B`, `I`, `W`).
    pub compute: Duration,
    /// The same per kind of compute action: its total time and how many ran (kept
    /// when [`StepStats::events`] is not, for the mean cost of each kind).
    pub compute_by_op: BTreeMap<Op, (Duration, usize)>,
    /// Time from the start to the end of the step on this rank.
    pub wall: Duration,
}

/// The pipeline bubble of each rank in one step, from each rank's `(compute, wall)`
/// ([`StepStats::compute`], [`StepStats::wall`]): `1 − compute / makespan`, where the
/// makespan is the longest `wall` of the step.
///
/// This is the simulator's measure (`RankTimeline::bubble_fraction` of
/// switchyard-schedule): the ranks start a step together, and a rank that finishes its
/// last action early is idle until the slowest rank is done. (Its own `wall` alone would
/// leave that wait out: in GPipe with p = 2, m = 4 and equal `F` and `B`, the last rank's
/// own window shows a bubble of 1/9, not the 1/5 both ranks really idle.)
pub fn step_bubbles(ranks: &[(Duration, Duration)]) -> Vec<f64> {
    let makespan = ranks
        .iter()
        .map(|&(_, wall)| wall.as_secs_f64())
        .fold(0.0, f64::max)
        .max(1e-12);
    ranks
        .iter()
        .map(|&(compute, _)| 1.0 - compute.as_secs_f64() / makespan)
        .collect()
}

/// The result of one step on one rank.
#[derive(Debug)]
pub struct StepOutput {
    /// The loss of each microbatch that finished on this rank (last stage only),
    /// unscaled, as `(microbatch, loss)`.
    pub losses: Vec<(u32, f64)>,
    /// Per stage on this rank: the gradient of each parameter, in the order of
    /// [`Stage::params`], summed over microbatches (`None` if it got none).
    pub grads: BTreeMap<u32, Vec<Option<Tensor>>>,
    pub stats: StepStats,
}

/// A program ready to run: lowered (when it spans several ranks) and validated.
#[derive(Debug, Clone)]
pub struct CheckedProgram(Program);

impl CheckedProgram {
    /// Lowers `program` if it spans several ranks and has no communication ops, then
    /// validates it; an invalid program is refused with the validator's message.
    pub fn new(program: &Program) -> Result<CheckedProgram> {
        let invalid = PipelineError::InvalidProgram;
        let program = match program.num_ranks() > 1 && !program.is_lowered() {
            true => lower(program).map_err(invalid)?,
            false => program.clone(),
        };
        validate(&program).map_err(invalid)?;
        Ok(CheckedProgram(program))
    }

    pub fn program(&self) -> &Program {
        &self.0
    }
}

/// Runs one rank's actions of a program.
pub struct Executor<'a> {
    program: Cow<'a, CheckedProgram>,
    rank: u32,
    comm: &'a dyn Communicator,
    stages: BTreeMap<u32, &'a dyn Stage>,
    epoch: Instant,
    recompute: bool,
    hooks: Option<&'a dyn SegmentHooks>,
}

/// What a forward pass leaves for its backward pass.
enum Stashed {
    /// The autograd graph.
    Graph {
        input: Option<Var>,
        /// The stage output, or the loss on the last stage.
        output: Tensor,
    },
    /// Under recomputation: the input of every segment, without a graph.
    Inputs(Vec<Tensor>),
    /// With hooks and without recomputation: one graph per segment.
    Segments(Vec<SegmentGraph>),
}

impl<'a> Executor<'a> {
    /// An executor for rank `comm.rank()` of `program`, running `stages` (stage id and
    /// module, one per stage the program gives this rank).
    ///
    /// A program that spans several ranks and has no communication ops is lowered first.
    /// The program is validated; an invalid one is refused with the validator's message
    /// before anything runs.
    pub fn new(
        program: &Program,
        comm: &'a dyn Communicator,
        stages: Vec<(u32, &'a dyn Stage)>,
    ) -> Result<Self> {
        Self::build(Cow::Owned(CheckedProgram::new(program)?), comm, stages)
    }

    /// As [`Executor::new`], for a program checked once beforehand: a training loop
    /// builds an executor every step and need not lower and validate every time.
    pub fn with_checked(
        program: &'a CheckedProgram,
        comm: &'a dyn Communicator,
        stages: Vec<(u32, &'a dyn Stage)>,
    ) -> Result<Self> {
        Self::build(Cow::Borrowed(program), comm, stages)
    }

    fn build(
        checked: Cow<'a, CheckedProgram>,
        comm: &'a dyn Communicator,
        stages: Vec<(u32, &'a dyn Stage)>,
    ) -> Result<Self> {
        let program = checked.program();
        if comm.world_size() != program.num_ranks() {
            return Err(PipelineError::RankCount {
                program: program.num_ranks(),
                group: comm.world_size(),
            }
            .into());
        }
        let rank = comm.rank() as u32;
        let want = program.stages_of_rank(rank);
        let stages: BTreeMap<u32, &dyn Stage> = stages.into_iter().collect();
        let have: Vec<u32> = stages.keys().copied().collect();
        if have != want {
            return Err(PipelineError::StageSetMismatch { rank, want, have }.into());
        }
        Ok(Executor {
            program: checked,
            rank,
            comm,
            stages,
            epoch: Instant::now(),
            recompute: false,
            hooks: None,
        })
    }

    /// Activation recomputation: a forward keeps only the input of each of the stage's
    /// segments ([`Stage::num_segments`]), without their graphs; a backward runs the
    /// segments again, last first, each with autograd just before its own backward. The
    /// same kernels run on the same inputs, so gradients are those without it, for one
    /// more forward per backward.
    pub fn with_recompute(mut self, on: bool) -> Self {
        self.recompute = on;
        self
    }

    /// Runs every stage segment by segment with `hooks` around each segment (see
    /// [`crate::segments`]): under recomputation as without hooks, otherwise keeping one
    /// autograd graph per segment instead of one per stage.
    pub fn with_hooks(mut self, hooks: &'a dyn SegmentHooks) -> Self {
        self.hooks = Some(hooks);
        self
    }

    /// Measures trace times from `epoch` (share one across ranks for one timeline).
    pub fn with_epoch(mut self, epoch: Instant) -> Self {
        self.epoch = epoch;
        self
    }

    /// The (lowered, validated) program this executor runs.
    pub fn program(&self) -> &Program {
        self.program.program()
    }

    fn last_stage(&self) -> u32 {
        self.program().num_stages - 1
    }

    fn peer(&self, a: &Action) -> Result<usize> {
        match self.program().peer_rank(a) {
            Some(r) => Ok(r as usize),
            None => Err(PipelineError::NoPeer {
                rank: self.rank,
                action: *a,
            }
            .into()),
        }
    }

    /// Runs this rank's actions for one step.
    pub fn run(&self, mb: &Microbatches) -> Result<StepOutput> {
        // Every stage hears begin_step before the first action and end_step after the
        // last, whatever happens in between.
        struct EndStep<'a>(Vec<&'a dyn Stage>);
        impl Drop for EndStep<'_> {
            fn drop(&mut self) {
                self.0.iter().for_each(|s| s.end_step());
            }
        }
        let mut begun = EndStep(Vec::new());
        for st in self.stages.values() {
            begun.0.push(*st);
            st.set_loss_scale(mb.loss_scale);
            st.begin_step()?;
        }
        self.run_program(mb)
    }

    fn run_program(&self, mb: &Microbatches) -> Result<StepOutput> {
        let r = self.rank;
        let start = Instant::now();
        let mut stash: HashMap<(u32, u32), Stashed> = HashMap::new();
        let mut acts: HashMap<(u32, u32), Tensor> = HashMap::new(); // inputs of (stage, mb)
        let mut grads_in: HashMap<(u32, u32), Tensor> = HashMap::new(); // output grads of (stage, mb)
        let mut outbox: HashMap<(u32, u32, bool), Tensor> = HashMap::new(); // (stage, mb, is_grad)
        let mut pending_w: HashMap<(u32, u32), SegmentGrads> = HashMap::new();
        let mut acc: BTreeMap<u32, Vec<Option<Tensor>>> = self
            .stages
            .iter()
            .map(|(&s, st)| (s, vec![None; st.params().len()]))
            .collect();
        let mut held: BTreeMap<u32, usize> = self.stages.keys().map(|&s| (s, 0)).collect();
        let mut stats = StepStats {
            peak_per_stage: held.clone(),
            ..StepStats::default()
        };
        let mut losses = Vec::new();
        let last = self.last_stage();
        // The (stage, microbatch) pairs whose backward is split (an `I`): their forward
        // runs split too (`Stage::split_backward`).
        let split: std::collections::HashSet<(u32, u32)> = self.program().ranks[r as usize]
            .iter()
            .filter(|a| a.op == Op::I)
            .map(|a| (a.stage, a.microbatch))
            .collect();

        for a in &self.program().ranks[r as usize] {
            let t0 = Instant::now();
            let (s, m) = (a.stage, a.microbatch);
            let key = (s, m);
            // What each action allocates, for the measured memory of `switchyard-mem`:
            // a forward's outputs and saved tensors are activations; a backward's are
            // gradients (of the parameters, kept, and of the activations, passed on).
            let _category = switchyard_mem::scope(match a.op {
                Op::F => switchyard_mem::Category::Activations,
                _ => switchyard_mem::Category::Gradients,
            });
            match a.op {
                Op::F => {
                    let stage = self.stage(s)?;
                    stage.split_backward(split.contains(&key));
                    stage.microbatch(m);
                    let (x, input) = if s == 0 {
                        let Some(x) = mb.inputs.get(m as usize) else {
                            return Err(PipelineError::MissingMicrobatch {
                                rank: r,
                                action: *a,
                                given: mb.inputs.len(),
                            }
                            .into());
                        };
                        (x.clone(), None)
                    } else {
                        let Some(x) = acts.remove(&key) else {
                            return Err(PipelineError::MissingInput {
                                rank: r,
                                action: *a,
                            }
                            .into());
                        };
                        // Segment by segment, the segments make their own variables.
                        if self.recompute || self.hooks.is_some() {
                            (x, None)
                        } else {
                            let v = Var::from_tensor(&x)?;
                            (v.as_tensor().clone(), Some(v))
                        }
                    };
                    let hooked = self.hooked(s);
                    let (out, stashed) = match (self.recompute, self.hooks.is_some()) {
                        (false, false) => {
                            let out = stage.forward(&x)?;
                            let output = out.clone();
                            (out, Stashed::Graph { input, output })
                        }
                        (false, true) => {
                            let (out, graphs) = forward_graphs(stage, &x, hooked)?;
                            (out, Stashed::Segments(graphs))
                        }
                        (true, _) => {
                            let (out, inputs) = forward_inputs(stage, x, hooked)?;
                            (out, Stashed::Inputs(inputs))
                        }
                    };
                    let stashed = if s == last {
                        let loss = (mb.loss)(&out, m as usize)?;
                        losses.push((
                            m,
                            loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?,
                        ));
                        match stashed {
                            Stashed::Graph { input, .. } => Stashed::Graph {
                                input,
                                output: loss,
                            },
                            Stashed::Segments(mut graphs) => {
                                graphs.last_mut().expect("a segment").output = loss;
                                Stashed::Segments(graphs)
                            }
                            inputs => inputs,
                        }
                    } else {
                        self.hand_off(&mut acts, &mut outbox, s + 1, m, out.detach(), false);
                        stashed
                    };
                    stash.insert(key, stashed);
                    let h = held.get_mut(&s).expect("stage of this rank");
                    *h += 1;
                    let peak = stats
                        .peak_per_stage
                        .get_mut(&s)
                        .expect("stage of this rank");
                    *peak = (*peak).max(*h);
                    stats.peak_activations = stats.peak_activations.max(held.values().sum());
                }
                Op::B | Op::I => {
                    let stage = self.stage(s)?;
                    let Some(st) = stash.remove(&key) else {
                        return Err(PipelineError::BackwardBeforeForward {
                            rank: r,
                            action: *a,
                        }
                        .into());
                    };
                    let g = match s == last {
                        true => None,
                        false => match grads_in.remove(&key) {
                            Some(g) => Some(g),
                            None => {
                                return Err(PipelineError::MissingGradient {
                                    rank: r,
                                    action: *a,
                                }
                                .into())
                            }
                        },
                    };
                    let unused = || -> candle_core::Error {
                        PipelineError::InputUnused {
                            rank: r,
                            action: *a,
                        }
                        .into()
                    };
                    stage.split_backward(a.op == Op::I);
                    stage.microbatch(m);
                    let hooked = self.hooked(s);
                    // With hooks, a `B` hands each segment's gradients over as soon as
                    // its backward is done; otherwise they are collected (and an `I`
                    // keeps them for its `W`).
                    let now = a.op == Op::B && self.hooks.is_some();
                    let acc_s = acc.get_mut(&s).expect("stage of this rank");
                    let mut collected: SegmentGrads = Vec::new();
                    // What the hooks leave of this microbatch's segments, summed before
                    // it joins the accumulator (see `Hooked::take_grads`).
                    let mut rest = vec![None; acc_s.len()];
                    let mut sink = |i: usize, pg: Vec<Option<Tensor>>| -> Result<()> {
                        match now {
                            true => hooked.hand(i, pg, &mut rest),
                            false => {
                                collected.push((i, pg));
                                Ok(())
                            }
                        }
                    };
                    let gi = match st {
                        Stashed::Graph { input, output } => {
                            let grads = backward(&output, g.as_ref(), mb.loss_scale)?;
                            let gi = match &input {
                                Some(v) => Some(grads.get(v.as_tensor()).ok_or_else(unused)?),
                                None => None,
                            }
                            .cloned();
                            sink(0, segments::param_grads(stage, &grads))?;
                            gi
                        }
                        Stashed::Inputs(inputs) => {
                            let loss = |out: &Tensor| (mb.loss)(out, m as usize);
                            let loss = (s == last).then_some(&loss as &LossFn);
                            recompute(stage, inputs, g, loss, mb.loss_scale, hooked, &mut sink)?
                        }
                        Stashed::Segments(graphs) => segments::backward_graphs(
                            stage,
                            graphs,
                            g,
                            mb.loss_scale,
                            hooked,
                            &mut sink,
                        )?,
                    };
                    let gi = match (s, gi) {
                        (0, _) => None,
                        (_, gi) => Some(gi.ok_or_else(unused)?),
                    };
                    if let Some(gi) = gi {
                        self.hand_off(&mut grads_in, &mut outbox, s - 1, m, gi, true);
                    }
                    match a.op {
                        Op::B => {
                            match now {
                                true => segments::add_into(acc_s, rest)?,
                                false => hooked.take_grads(collected, acc_s)?,
                            }
                            *held.get_mut(&s).expect("stage of this rank") -= 1;
                        }
                        _ => {
                            pending_w.insert(key, collected);
                        }
                    }
                }
                Op::W => {
                    let Some(mut pg) = pending_w.remove(&key) else {
                        return Err(PipelineError::WeightBeforeInput {
                            rank: r,
                            action: *a,
                        }
                        .into());
                    };
                    let stage = self.stage(s)?;
                    let computed = stage.backward_weights(m)?;
                    segments::add_weight_grads(stage, &mut pg, computed)?;
                    self.hooked(s)
                        .take_grads(pg, acc.get_mut(&s).expect("stage of this rank"))?;
                    *held.get_mut(&s).expect("stage of this rank") -= 1;
                }
                Op::SendF | Op::SendB => {
                    let is_grad = a.op == Op::SendB;
                    let Some(t) = outbox.remove(&(s, m, is_grad)) else {
                        return Err(PipelineError::NothingToSend {
                            rank: r,
                            action: *a,
                        }
                        .into());
                    };
                    self.comm.send(&t, self.peer(a)?, tag(a))?;
                }
                Op::RecvF => {
                    let t = self.comm.recv(self.peer(a)?, tag(a))?;
                    acts.insert(key, self.on_stage_device(s, t)?);
                }
                Op::RecvB => {
                    let t = self.comm.recv(self.peer(a)?, tag(a))?;
                    grads_in.insert(key, self.on_stage_device(s, t)?);
                }
            }
            let t1 = Instant::now();
            if a.op.is_compute() {
                stats.compute += t1 - t0;
                let by_op = stats.compute_by_op.entry(a.op).or_default();
                by_op.0 += t1 - t0;
                by_op.1 += 1;
            }
            stats.events.push(TraceEvent {
                action: *a,
                start_us: (t0 - self.epoch).as_secs_f64() * 1e6,
                dur_us: (t1 - t0).as_secs_f64() * 1e6,
            });
        }
        if !stash.is_empty() || !pending_w.is_empty() || !outbox.is_empty() {
            let mut left: Vec<String> = stash
                .keys()
                .map(|(s, m)| format!("{s}F{m} without backward"))
                .collect();
            left.extend(
                pending_w
                    .keys()
                    .map(|(s, m)| format!("{s}I{m} without {s}W{m}")),
            );
            left.extend(
                outbox
                    .keys()
                    .map(|(s, m, g)| format!("{s}{}{m} never sent", if *g { "SB" } else { "SF" })),
            );
            left.sort();
            return Err(PipelineError::Unfinished { rank: r, left }.into());
        }
        stats.wall = start.elapsed();
        Ok(StepOutput {
            losses,
            grads: acc,
            stats,
        })
    }

    /// A received tensor on the device of stage `s`'s parameters (a communicator may
    /// hand back host memory); unchanged when the stage has none or it is there already.
    fn on_stage_device(&self, s: u32, t: Tensor) -> Result<Tensor> {
        match self.stage(s)?.params().first().map(|p| p.device()) {
            Some(d) if !d.same_device(t.device()) => t.to_device(d),
            _ => Ok(t),
        }
    }

    fn hooked(&self, stage: u32) -> Hooked<'a> {
        Hooked {
            hooks: self.hooks,
            stage,
        }
    }

    fn stage(&self, s: u32) -> Result<&'a dyn Stage> {
        match self.stages.get(&s) {
            Some(st) => Ok(*st),
            None => Err(PipelineError::StageNotOnRank {
                rank: self.rank,
                stage: s,
            }
            .into()),
        }
    }

    /// Gives `t` (an activation for stage `to`, or a gradient for stage `to`) to the next
    /// action that needs it: directly if stage `to` runs here, else to the outbox of the
    /// send that the lowering placed.
    fn hand_off(
        &self,
        local: &mut HashMap<(u32, u32), Tensor>,
        outbox: &mut HashMap<(u32, u32, bool), Tensor>,
        to: u32,
        m: u32,
        t: Tensor,
        is_grad: bool,
    ) {
        if self.program().rank_of_stage(to) == self.rank {
            local.insert((to, m), t);
        } else {
            let from = if is_grad { to + 1 } else { to - 1 };
            outbox.insert((from, m, is_grad), t);
        }
    }
}
