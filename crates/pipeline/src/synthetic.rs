//! A synthetic stage: runs a schedule with the real [`Executor`] and the real
//! communicator at sizes no real model reaches on a small machine.
//!
//! The simulator (`switchyard_schedule::simulate`) predicts a program's makespan and
//! bubble from per-action [`Costs`]. To check that the executor really runs a program as
//! the simulator times it (its ordering, the lowering of messages, the hand-offs between
//! stages on one rank), a [`SyntheticStage`] *costs* its actions instead of computing:
//! `F` costs `costs.f`, a backward `costs.b` (or `costs.i` when the program splits it),
//! and `W` costs `costs.w` (through [`Stage::backward_weights`], the executor's hook for
//! `W`). Messages cost `costs.comm` on each side, charged by a [`SyntheticComm`] that
//! wraps the real communicator. Every rank is a thread, so `p = 32` ranks run on two
//! cores.
//!
//! What "costs" means depends on the [`SyntheticMode`] of the rank's [`SyntheticClock`]
//! (one per rank, shared by all its stages, since an interleaved program puts several
//! stages on a rank, and by its communicator):
//!
//! * [`SyntheticMode::Virtual`]: a logical clock. Every action advances it by its cost.
//!   A send stamps the message with the clock after the send; a receive sets the clock to
//!   `max(clock, stamp) + comm`. This is exactly the simulator's eager-send model, so the
//!   measured timeline is deterministic, independent of the machine's load, and equals
//!   the simulator's action by action when the executor runs the program faithfully. The
//!   tests use this mode.
//! * [`SyntheticMode::Sleep`]: every action sleeps `cost × unit` of wall time (a send
//!   sleeps before it sends; a receive sleeps after its message arrives), and the timeline
//!   is read from the executor's own trace. A rank sleeps to deadlines: an action ends
//!   `cost × unit` after the previous action's deadline (or after its message arrived),
//!   so the timer's overshoot does not add up over thousands of actions; the wake-up
//!   of a rank blocked on a message still counts, as do the executor's own costs where
//!   they exceed an action's slack. This shows real timing, threads, channels and
//!   scheduler included; it is what `switchyard schedule --execute` runs by default.
//!
//! The activations and gradients are tiny `[time, microbatch]` tensors: a candle
//! custom op ([`SyntheticStage::forward`]) charges `F` in its forward and the backward's
//! cost in its `bwd`, which candle's autograd calls from the executor's backward pass,
//! and writes the clock into the tensor it returns; the communicator overwrites the time
//! with the send's end. The microbatch index travels with the tensor so that the backward
//! knows whether its program splits it into `I` and `W`.
//!
//! Why the messages are costed by a communicator wrapper and not by the stage: sends and
//! receives are the executor's actions, placed by the lowering, and a receive's time
//! depends on where it stands in the rank's order (`max(clock, stamp)` at that point),
//! not on when the stage later consumes its tensor. Wrapping the communicator charges
//! them where the executor performs them, with no hook in the executor beyond `W`'s.
//!
//! What this does not check: the stages' own computation (there is none), and memory
//! (the tensors are two numbers); the executor's count of held activations is still
//! compared with the simulator's.
//!
//! [`run_synthetic`] does it all: lowers and validates a program, simulates it, runs it
//! on threads and returns both timelines.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Result, Shape, Tensor, Var};
use switchyard_comm::local::Launcher;
use switchyard_comm::{CommError, Communicator, ReduceOp, Tag};
use switchyard_schedule::{
    simulate_by_stage, Costs, Op, Program, RankTimeline, TimedAction, Timeline,
};

use crate::{CheckedProgram, Executor, Microbatches, Stage, StepStats};

/// How a [`SyntheticClock`] spends an action's cost.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SyntheticMode {
    /// A logical clock in cost units: deterministic, equal to the simulator's timeline.
    Virtual,
    /// Real sleeps of `cost × unit`, timed by the executor's trace.
    Sleep {
        /// The wall time of one cost unit.
        unit: Duration,
    },
}

/// One rank's clock, shared by its [`SyntheticStage`]s and its [`SyntheticComm`].
#[derive(Debug)]
pub struct SyntheticClock {
    mode: SyntheticMode,
    state: Mutex<ClockState>,
}

#[derive(Debug, Default)]
struct ClockState {
    /// The logical time (virtual mode).
    now: f64,
    /// `(start, end)` of every charge, in order: one per action (virtual mode).
    log: Vec<(f64, f64)>,
    /// Time spent on message costs, in cost units (both modes).
    comm: f64,
    /// When the last action is due to end (sleep mode).
    deadline: Option<Instant>,
}

impl ClockState {
    /// An action from `start` to `start + cost`; returns its end.
    fn charge(&mut self, start: f64, cost: f64) -> f64 {
        let end = start + cost;
        self.now = end;
        self.log.push((start, end));
        end
    }
}

impl SyntheticClock {
    /// A clock at time 0.
    pub fn new(mode: SyntheticMode) -> Arc<SyntheticClock> {
        Arc::new(SyntheticClock {
            mode,
            state: Mutex::new(ClockState::default()),
        })
    }

    /// The mode.
    pub fn mode(&self) -> SyntheticMode {
        self.mode
    }

    /// The logical time (always 0 in sleep mode).
    pub fn now(&self) -> f64 {
        self.lock().now
    }

    /// The `(start, end)` of every action charged so far, in order (virtual mode; empty
    /// in sleep mode).
    pub fn log(&self) -> Vec<(f64, f64)> {
        self.lock().log.clone()
    }

    /// The time spent on message costs so far, in cost units (in sleep mode: measured).
    pub fn comm_time(&self) -> f64 {
        self.lock().comm
    }

    fn lock(&self) -> MutexGuard<'_, ClockState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Spends `cost` on a compute action; returns the time after it.
    fn compute(&self, cost: f64) -> f64 {
        match self.mode {
            SyntheticMode::Virtual => {
                let mut st = self.lock();
                let start = st.now;
                st.charge(start, cost)
            }
            SyntheticMode::Sleep { unit } => {
                self.sleep(unit, cost, None);
                0.0
            }
        }
    }

    /// Spends `cost` on a send; returns the stamp the message carries (its end).
    fn send(&self, cost: f64) -> f64 {
        match self.mode {
            SyntheticMode::Virtual => {
                let mut st = self.lock();
                let start = st.now;
                st.comm += cost;
                st.charge(start, cost)
            }
            SyntheticMode::Sleep { unit } => {
                let spent = self.sleep(unit, cost, None);
                self.lock().comm += spent;
                0.0
            }
        }
    }

    /// Spends `cost` on a receive of a message stamped `sent`.
    fn recv(&self, cost: f64, sent: f64) {
        match self.mode {
            SyntheticMode::Virtual => {
                let mut st = self.lock();
                let start = st.now.max(sent);
                st.comm += cost;
                st.charge(start, cost);
            }
            SyntheticMode::Sleep { unit } => {
                let spent = self.sleep(unit, cost, Some(Instant::now()));
                self.lock().comm += spent;
            }
        }
    }

    /// Sleeps until the action's deadline: `cost × unit` after the previous action's
    /// deadline, or after `arrived` (a message's arrival) when that is later. Sleeping
    /// to a deadline rather than for a duration keeps the timer's overshoot (tens of
    /// microseconds per sleep) from adding up over a rank's thousands of actions, as a
    /// device running at a fixed speed would. Returns the time spent, in cost units,
    /// from the later of the call and `arrived` on.
    fn sleep(&self, unit: Duration, cost: f64, arrived: Option<Instant>) -> f64 {
        let now = Instant::now();
        let from = arrived.map_or(now, |a| a.max(now));
        let start = {
            let st = self.lock();
            match (st.deadline, arrived) {
                (Some(d), Some(a)) => d.max(a),
                (Some(d), None) => d,
                (None, _) => from,
            }
        };
        let end = start + unit.mul_f64(cost);
        let now = Instant::now();
        if end > now {
            std::thread::sleep(end - now);
        }
        self.lock().deadline = Some(end);
        from.elapsed().as_secs_f64() / unit.as_secs_f64()
    }
}

/// What the custom op and the stage share.
struct Inner {
    costs: Costs,
    /// Per microbatch: whether the program splits this stage's backward into `I` and `W`.
    split: Vec<bool>,
    clock: Arc<SyntheticClock>,
}

/// A pipeline stage that costs its actions on a [`SyntheticClock`] instead of computing
/// (see the [module documentation](self)). Its input and output are `[time, microbatch]`
/// `f64` tensors; [`SyntheticStage::input`] makes the first stage's inputs.
pub struct SyntheticStage {
    inner: Arc<Inner>,
    params: Vec<Var>,
}

impl SyntheticStage {
    /// Stage `stage` of `program`, costing its actions with `costs` on `clock`.
    pub fn new(
        program: &Program,
        stage: u32,
        costs: Costs,
        clock: Arc<SyntheticClock>,
    ) -> Result<SyntheticStage> {
        if stage >= program.num_stages {
            candle_core::bail!(
                "synthetic stage {stage} of a program of {} stages",
                program.num_stages
            );
        }
        let mut split = vec![false; program.num_microbatches as usize];
        for a in program.ranks.iter().flatten() {
            if a.stage == stage && a.op == Op::I {
                if let Some(s) = split.get_mut(a.microbatch as usize) {
                    *s = true;
                }
            }
        }
        // One parameter, so that autograd tracks the op (and calls its backward) even
        // on the first stage, whose input is not a variable.
        let w = Var::new(&[0f64], &Device::Cpu)?;
        Ok(SyntheticStage {
            inner: Arc::new(Inner {
                costs,
                split,
                clock,
            }),
            params: vec![w],
        })
    }

    /// The first stage's input for `microbatch`.
    pub fn input(microbatch: u32) -> Result<Tensor> {
        Tensor::new(&[0.0, f64::from(microbatch)], &Device::Cpu)
    }
}

impl Stage for SyntheticStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.apply_op2(
            self.params[0].as_tensor(),
            Timed {
                inner: self.inner.clone(),
            },
        )
    }

    fn params(&self) -> &[Var] {
        &self.params
    }

    fn backward_weights(&self, _microbatch: u32) -> Result<()> {
        self.inner.clock.compute(self.inner.costs.w);
        Ok(())
    }
}

/// The op `x ↦ [time, microbatch]`: its forward charges `F`, its backward `B` or `I`.
struct Timed {
    inner: Arc<Inner>,
}

/// The microbatch index stored in a `[time, microbatch]` tensor.
fn microbatch_of(values: &[f64]) -> Result<f64> {
    match values {
        [_, m] => Ok(*m),
        _ => candle_core::bail!(
            "a synthetic stage's tensors are [time, microbatch], got {} values",
            values.len()
        ),
    }
}

impl CustomOp2 for Timed {
    fn name(&self) -> &'static str {
        "synthetic-stage"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let values = match (s1, l1.contiguous_offsets()) {
            (CpuStorage::F64(v), Some((a, b))) => &v[a..b],
            _ => candle_core::bail!("a synthetic stage's input is a contiguous f64 tensor"),
        };
        let m = microbatch_of(values)?;
        let now = self.inner.clock.compute(self.inner.costs.f);
        Ok((CpuStorage::F64(vec![now, m]), Shape::from(2)))
    }

    fn bwd(
        &self,
        arg1: &Tensor,
        arg2: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let m = microbatch_of(&arg1.to_vec1::<f64>()?)?;
        let split = self.inner.split.get(m as usize).copied().unwrap_or(false);
        let cost = match split {
            true => self.inner.costs.i,
            false => self.inner.costs.b,
        };
        let now = self.inner.clock.compute(cost);
        let grad = Tensor::new(&[now, m], arg1.device())?;
        Ok((Some(grad), Some(arg2.zeros_like()?)))
    }
}

/// A communicator that charges each message's cost on a [`SyntheticClock`] and
/// delegates the transfer to the real one. Point-to-point only: the collectives (which a
/// pipeline's executor does not use) are delegated uncharged.
///
/// Each side of a message costs the `comm` of the stage of its action, as in
/// `simulate_by_stage`; the stage is read from the message's tag (the layout of
/// `switchyard_schedule::tag`). In virtual mode the message's `[time, microbatch]`
/// tensor carries the send's end time.
pub struct SyntheticComm<'a> {
    inner: &'a dyn Communicator,
    clock: Arc<SyntheticClock>,
    comm: Vec<f64>,
}

impl<'a> SyntheticComm<'a> {
    /// Wraps `inner`; `comm[s]` is the cost of a send or receive of stage `s`.
    pub fn new(
        inner: &'a dyn Communicator,
        clock: Arc<SyntheticClock>,
        comm: Vec<f64>,
    ) -> SyntheticComm<'a> {
        SyntheticComm { inner, clock, comm }
    }

    fn cost(&self, op: &'static str, stage: u64) -> switchyard_comm::Result<f64> {
        usize::try_from(stage)
            .ok()
            .and_then(|s| self.comm.get(s).copied())
            .ok_or_else(|| CommError::Invalid {
                op,
                rank: self.inner.rank(),
                reason: format!("tag names stage {stage}, which has no synthetic cost"),
            })
    }

    fn backend(&self, op: &'static str) -> impl Fn(candle_core::Error) -> CommError + '_ {
        move |e| CommError::Backend {
            op,
            rank: self.inner.rank(),
            reason: e.to_string(),
        }
    }
}

/// The stage that receives a message with `tag`, and whether it is a gradient.
fn receiver(tag: Tag) -> (u64, bool) {
    (tag >> 33, tag & 1 == 1)
}

impl Communicator for SyntheticComm<'_> {
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

    fn send(&self, t: &Tensor, dst: usize, tag: Tag) -> switchyard_comm::Result<()> {
        let (to, is_grad) = receiver(tag);
        let from = match is_grad {
            true => to + 1,
            false => to.wrapping_sub(1),
        };
        let stamp = self.clock.send(self.cost("send", from)?);
        match self.clock.mode() {
            SyntheticMode::Virtual => {
                let err = self.backend("send");
                let m = microbatch_of(&t.to_vec1::<f64>().map_err(&err)?).map_err(&err)?;
                let stamped = Tensor::new(&[stamp, m], t.device()).map_err(&err)?;
                self.inner.send(&stamped, dst, tag)
            }
            SyntheticMode::Sleep { .. } => self.inner.send(t, dst, tag),
        }
    }

    fn recv(&self, src: usize, tag: Tag) -> switchyard_comm::Result<Tensor> {
        let t = self.inner.recv(src, tag)?;
        let cost = self.cost("recv", receiver(tag).0)?;
        let sent = match self.clock.mode() {
            SyntheticMode::Virtual => {
                let err = self.backend("recv");
                t.to_vec1::<f64>()
                    .map_err(&err)?
                    .first()
                    .copied()
                    .unwrap_or(0.0)
            }
            SyntheticMode::Sleep { .. } => 0.0,
        };
        self.clock.recv(cost, sent);
        Ok(t)
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> switchyard_comm::Result<Tensor> {
        self.inner.all_reduce(t, op)
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> switchyard_comm::Result<Tensor> {
        self.inner.all_gather(t, dim)
    }

    fn reduce_scatter(
        &self,
        t: &Tensor,
        dim: usize,
        op: ReduceOp,
    ) -> switchyard_comm::Result<Tensor> {
        self.inner.reduce_scatter(t, dim, op)
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> switchyard_comm::Result<Tensor> {
        self.inner.broadcast(t, root)
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> switchyard_comm::Result<Vec<Tensor>> {
        self.inner.all_to_all(parts)
    }

    fn barrier(&self) -> switchyard_comm::Result<()> {
        self.inner.barrier()
    }

    /// The real communicator's split: the new group is not synthetic.
    fn split_named(
        &self,
        color: usize,
        key: usize,
        name: &str,
    ) -> switchyard_comm::Result<Arc<dyn Communicator>> {
        self.inner.split_named(color, key, name)
    }
}

/// What one rank of [`run_synthetic`] brings back: the executor's statistics, the
/// clock's log and its time on messages.
type RankRun = (StepStats, Vec<(f64, f64)>, f64);

/// The result of [`run_synthetic`].
#[derive(Debug, Clone)]
pub struct SyntheticRun {
    /// The program that ran: lowered (when it spans several ranks) and validated.
    pub program: Program,
    /// The simulator's timeline of [`SyntheticRun::program`].
    pub simulated: Timeline,
    /// The measured timeline, in cost units: in virtual mode from the ranks' clocks, in
    /// sleep mode from the executor's trace (time 0 is the first action's start). Its
    /// `comm` is the time charged to messages (in sleep mode, their measured sleeps), so
    /// `idle` is waiting, as in the simulator; a receive's duration in sleep mode
    /// includes its wait for the message.
    pub measured: Timeline,
}

/// Runs `program` with [`SyntheticStage`]s, the [`Executor`] and the in-process threads
/// communicator (one thread per rank), with `costs[s]` for stage `s` (one entry, or one
/// per stage), and returns the simulated and the measured timelines.
///
/// In [`SyntheticMode::Virtual`] the two are equal when the executor runs the program as
/// simulated (see the [module documentation](self)).
pub fn run_synthetic(
    program: &Program,
    costs: &[Costs],
    mode: SyntheticMode,
) -> Result<SyntheticRun> {
    let checked = CheckedProgram::new(program)?;
    let program = checked.program();
    let costs: Vec<Costs> = match costs.len() {
        1 => vec![costs[0]; program.num_stages as usize],
        _ => costs.to_vec(),
    };
    let simulated = simulate_by_stage(program, &costs).map_err(candle_core::Error::wrap)?;
    if let SyntheticMode::Sleep { unit } = mode {
        if unit.is_zero() {
            candle_core::bail!("the time unit of a synthetic run must be above 0");
        }
    }
    let m = program.num_microbatches;
    let comm_costs: Vec<f64> = costs.iter().map(|c| c.comm).collect();
    let epoch = Instant::now();
    let per_rank = Launcher::new(program.num_ranks())
        .threads_per_worker(1)
        .run(|comm| -> Result<RankRun> {
            let rank = comm.rank() as u32;
            let clock = SyntheticClock::new(mode);
            let stages = program
                .stages_of_rank(rank)
                .into_iter()
                .map(|s| {
                    let st = SyntheticStage::new(program, s, costs[s as usize], clock.clone())?;
                    Ok((s, st))
                })
                .collect::<Result<Vec<_>>>()?;
            let scomm = SyntheticComm::new(&*comm, clock.clone(), comm_costs.clone());
            let refs: Vec<(u32, &dyn Stage)> = stages
                .iter()
                .map(|(s, st)| (*s, st as &dyn Stage))
                .collect();
            let exec = Executor::with_checked(&checked, &scomm, refs)?.with_epoch(epoch);
            let inputs = match stages.first() {
                Some((0, _)) => (0..m).map(SyntheticStage::input).collect::<Result<_>>()?,
                _ => Vec::new(),
            };
            let loss = |out: &Tensor, _mb: usize| out.sum_all();
            let out = exec.run(&Microbatches {
                inputs,
                loss: &loss,
                loss_scale: 1.0,
            })?;
            Ok((out.stats, clock.log(), clock.comm_time()))
        })
        .map_err(candle_core::Error::wrap)?;
    let mut times: Vec<Vec<(f64, f64)>> = Vec::with_capacity(per_rank.len());
    for (r, (stats, log, _)) in per_rank.iter().enumerate() {
        let n = program.ranks[r].len();
        let t = match mode {
            SyntheticMode::Virtual => log.clone(),
            SyntheticMode::Sleep { unit } => {
                let u = unit.as_secs_f64() * 1e6;
                let t: Vec<(f64, f64)> = stats
                    .events
                    .iter()
                    .map(|e| (e.start_us / u, (e.start_us + e.dur_us) / u))
                    .collect();
                t
            }
        };
        if t.len() != n {
            candle_core::bail!(
                "synthetic run: rank {r} timed {} actions, but its program has {n}",
                t.len()
            );
        }
        times.push(t);
    }
    if let SyntheticMode::Sleep { .. } = mode {
        let t0 = times
            .iter()
            .flatten()
            .map(|&(s, _)| s)
            .fold(f64::INFINITY, f64::min);
        let t0 = if t0.is_finite() { t0 } else { 0.0 };
        times
            .iter_mut()
            .flatten()
            .for_each(|(s, e)| (*s, *e) = (*s - t0, *e - t0));
    }
    let makespan = times
        .iter()
        .flatten()
        .map(|&(_, e)| e)
        .fold(0.0f64, f64::max);
    let ranks: Vec<RankTimeline> = program
        .ranks
        .iter()
        .zip(&times)
        .zip(&per_rank)
        .enumerate()
        .map(|(r, ((actions, ts), (stats, _, comm_time)))| {
            let mut busy = 0.0;
            let mut comm = 0.0;
            for (a, &(s, e)) in actions.iter().zip(ts) {
                if a.op.is_compute() {
                    busy += e - s;
                } else {
                    comm += e - s;
                }
            }
            if let SyntheticMode::Sleep { .. } = mode {
                comm = *comm_time;
            }
            let idle = (makespan - busy - comm).max(0.0);
            RankTimeline {
                rank: r as u32,
                busy,
                comm,
                idle,
                bubble_fraction: if makespan > 0.0 { idle / makespan } else { 0.0 },
                peak_activations: stats.peak_activations as u32,
                actions: actions
                    .iter()
                    .zip(ts)
                    .map(|(&action, &(start, end))| TimedAction { action, start, end })
                    .collect(),
            }
        })
        .collect();
    let total_idle: f64 = ranks.iter().map(|r| r.idle).sum();
    let denom = ranks.len() as f64 * makespan;
    let measured = Timeline {
        num_stages: program.num_stages,
        num_microbatches: program.num_microbatches,
        costs: simulated.costs,
        makespan,
        bubble_fraction: if denom > 0.0 { total_idle / denom } else { 0.0 },
        ranks,
    };
    Ok(SyntheticRun {
        program: program.clone(),
        simulated,
        measured,
    })
}

/// The largest relative difference between two timelines' makespans, per-rank busy,
/// comm and idle times and action start and end times (relative to the makespan), or
/// an error naming the first quantity that differs in kind (rank or action count, an
/// action). Virtual-mode runs of a faithful executor give 0.
pub fn timeline_difference(simulated: &Timeline, measured: &Timeline) -> Result<f64> {
    if simulated.ranks.len() != measured.ranks.len() {
        candle_core::bail!(
            "{} simulated ranks, {} measured",
            simulated.ranks.len(),
            measured.ranks.len()
        );
    }
    let scale = simulated.makespan.abs().max(1e-12);
    let mut worst = (simulated.makespan - measured.makespan).abs() / scale;
    for (s, m) in simulated.ranks.iter().zip(&measured.ranks) {
        if s.actions.len() != m.actions.len() {
            candle_core::bail!(
                "rank {}: {} simulated actions, {} measured",
                s.rank,
                s.actions.len(),
                m.actions.len()
            );
        }
        let mut d = [s.busy - m.busy, s.comm - m.comm, s.idle - m.idle]
            .into_iter()
            .fold(0.0f64, |w, x| w.max(x.abs() / scale));
        for (a, b) in s.actions.iter().zip(&m.actions) {
            if a.action != b.action {
                candle_core::bail!(
                    "rank {}: simulated {} where {} was measured",
                    s.rank,
                    a.action,
                    b.action
                );
            }
            d = d.max((a.start - b.start).abs() / scale);
            d = d.max((a.end - b.end).abs() / scale);
        }
        worst = worst.max(d);
    }
    Ok(worst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_virtual_clock_follows_eager_sends() {
        let c = SyntheticClock::new(SyntheticMode::Virtual);
        assert_eq!(c.compute(1.0), 1.0);
        assert_eq!(c.send(0.5), 1.5);
        c.recv(0.5, 4.0); // waits for a message sent at 4
        assert_eq!(c.now(), 4.5);
        c.recv(0.5, 1.0); // already there
        assert_eq!(c.now(), 5.0);
        assert_eq!(
            c.log(),
            vec![(0.0, 1.0), (1.0, 1.5), (4.0, 4.5), (4.5, 5.0)]
        );
        assert_eq!(c.comm_time(), 1.5);
    }

    #[test]
    fn dtype_of_inputs() {
        let x = SyntheticStage::input(3).unwrap();
        assert_eq!(x.dtype(), candle_core::DType::F64);
        assert_eq!(x.to_vec1::<f64>().unwrap(), vec![0.0, 3.0]);
    }
}
