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

use std::time::Instant;

use candle_core::{Result, Tensor};
use switchyard_comm::local::Launcher;
use switchyard_schedule::{simulate_by_stage, Costs, Program, Timeline};

use crate::{CheckedProgram, Executor, Microbatches, Stage};

mod clock;
mod comm;
mod stage;

pub use clock::{SyntheticClock, SyntheticMode};
pub use comm::SyntheticComm;
pub use stage::SyntheticStage;

use comm::RankRun;
use stage::microbatch_of;

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
    // Sleeping, a message's wall time is the clock's count, not the span of its action.
    let comm: Option<Vec<f64>> = match mode {
        SyntheticMode::Sleep { .. } => Some(per_rank.iter().map(|r| r.2).collect()),
        SyntheticMode::Virtual => None,
    };
    let peaks: Vec<u32> = per_rank
        .iter()
        .map(|r| r.0.peak_activations as u32)
        .collect();
    let measured = Timeline::from_times(program, simulated.costs, &times, comm.as_deref(), &peaks);
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
