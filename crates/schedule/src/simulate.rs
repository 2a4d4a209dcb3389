//! [`simulate`]: timing a program under a cost model.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::action::{Action, Op};
use crate::engine::{self, Semantics};
use crate::error::{Result, ScheduleError};
use crate::program::Program;

/// Duration of each kind of action, in arbitrary time units.
///
/// The default is `F=1, B=2, I=1, W=1, comm=0`. Costs are per action, and an
/// action is one stage: in an interleaved program a stage is `1/v` of a
/// rank's layers, so set `F=1/v` etc. to compare absolute times with a
/// non-interleaved schedule (fractions such as the bubble do not depend on
/// this scale).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Costs {
    /// Forward.
    pub f: f64,
    /// Full backward.
    pub b: f64,
    /// Input-gradient half of a split backward.
    pub i: f64,
    /// Weight-gradient half of a split backward.
    pub w: f64,
    /// Every send and every receive.
    pub comm: f64,
}

impl Default for Costs {
    fn default() -> Self {
        Costs {
            f: 1.0,
            b: 2.0,
            i: 1.0,
            w: 1.0,
            comm: 0.0,
        }
    }
}

impl Costs {
    /// The duration of one action of `op`.
    pub fn of(&self, op: Op) -> f64 {
        match op {
            Op::F => self.f,
            Op::B => self.b,
            Op::I => self.i,
            Op::W => self.w,
            _ => self.comm,
        }
    }

    fn check(&self) -> Result<()> {
        for (k, v) in [
            ("F", self.f),
            ("B", self.b),
            ("I", self.i),
            ("W", self.w),
            ("comm", self.comm),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(ScheduleError::InvalidInput(format!(
                    "cost {k}={v} must be a finite number >= 0"
                )));
            }
        }
        Ok(())
    }
}

impl fmt::Display for Costs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "F={},B={},I={},W={},comm={}",
            self.f, self.b, self.i, self.w, self.comm
        )
    }
}

impl FromStr for Costs {
    type Err = ScheduleError;

    /// Parses `F=1,B=2,I=1,W=1,comm=0`: keys case-insensitive, any subset
    /// (the rest keep their defaults), whitespace allowed.
    fn from_str(s: &str) -> Result<Self> {
        let mut c = Costs::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (k, v) = part.split_once('=').ok_or_else(|| {
                ScheduleError::Parse(format!(
                    "costs {s:?}: {part:?} is not KEY=VALUE (like F=1,B=2,I=1,W=1,comm=0)"
                ))
            })?;
            let value = v.trim().parse::<f64>().map_err(|_| {
                ScheduleError::Parse(format!("costs {s:?}: {:?} is not a number", v.trim()))
            })?;
            let slot = match k.trim().to_ascii_lowercase().as_str() {
                "f" => &mut c.f,
                "b" => &mut c.b,
                "i" => &mut c.i,
                "w" => &mut c.w,
                "comm" | "c" => &mut c.comm,
                other => {
                    return Err(ScheduleError::Parse(format!(
                        "costs {s:?}: unknown key {other:?}, expected F, B, I, W or comm"
                    )))
                }
            };
            *slot = value;
        }
        c.check()?;
        Ok(c)
    }
}

/// One action with its start and end time.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TimedAction {
    /// The action.
    pub action: Action,
    /// When it started executing (after any wait for its inputs).
    pub start: f64,
    /// When it finished.
    pub end: f64,
}

/// One rank's part of a [`Timeline`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankTimeline {
    /// The rank.
    pub rank: u32,
    /// Time spent computing (`F`, `B`, `I`, `W`).
    pub busy: f64,
    /// Time spent in sends and receives (0 when `comm = 0`).
    pub comm: f64,
    /// Time spent waiting: `makespan − busy − comm`.
    pub idle: f64,
    /// `idle / makespan`.
    pub bubble_fraction: f64,
    /// The most microbatches whose activations this rank holds at once,
    /// across all its stages (see [`simulate`]).
    pub peak_activations: u32,
    /// The rank's actions with their times, in program order.
    pub actions: Vec<TimedAction>,
}

/// The result of [`simulate`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Number of stages of the simulated program.
    pub num_stages: u32,
    /// Number of microbatches of the simulated program.
    pub num_microbatches: u32,
    /// The costs used.
    pub costs: Costs,
    /// When the last action ends.
    pub makespan: f64,
    /// Total idle time over `num_ranks · makespan`.
    pub bubble_fraction: f64,
    /// Per-rank results.
    pub ranks: Vec<RankTimeline>,
}

impl Timeline {
    /// The timeline of `program` from each action's `(start, end)`, rank by rank, as
    /// [`simulate`] computes them or an executor measures them: a rank is busy during its
    /// compute actions, communicates during the others (or for `comm[r]`, when given) and
    /// is idle for the rest of the makespan; `peaks[r]` is its peak activation count.
    pub fn from_times(
        program: &Program,
        costs: Costs,
        times: &[Vec<(f64, f64)>],
        comm: Option<&[f64]>,
        peaks: &[u32],
    ) -> Timeline {
        let makespan = times
            .iter()
            .flatten()
            .map(|&(_, e)| e)
            .fold(0.0f64, f64::max);
        let fraction = |idle: f64, of: f64| if of > 0.0 { idle / of } else { 0.0 };
        let ranks: Vec<RankTimeline> = program
            .ranks
            .iter()
            .zip(times)
            .enumerate()
            .map(|(r, (actions, ts))| {
                let (mut busy, mut in_comm) = (0.0, 0.0);
                for (a, &(s, e)) in actions.iter().zip(ts) {
                    match a.op.is_compute() {
                        true => busy += e - s,
                        false => in_comm += e - s,
                    }
                }
                let comm = comm.map_or(in_comm, |c| c[r]);
                let idle = (makespan - busy - comm).max(0.0);
                RankTimeline {
                    rank: r as u32,
                    busy,
                    comm,
                    idle,
                    bubble_fraction: fraction(idle, makespan),
                    peak_activations: peaks.get(r).copied().unwrap_or(0),
                    actions: actions
                        .iter()
                        .zip(ts)
                        .map(|(&action, &(start, end))| TimedAction { action, start, end })
                        .collect(),
                }
            })
            .collect();
        let total_idle: f64 = ranks.iter().map(|r| r.idle).sum();
        Timeline {
            num_stages: program.num_stages,
            num_microbatches: program.num_microbatches,
            costs,
            makespan,
            bubble_fraction: fraction(total_idle, ranks.len() as f64 * makespan),
            ranks,
        }
    }

    /// Number of ranks.
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// Each rank's peak activation count.
    pub fn peak_activations(&self) -> Vec<u32> {
        self.ranks.iter().map(|r| r.peak_activations).collect()
    }

    /// The JSON form (see [`to_json`](crate::to_json)).
    pub fn to_json(&self) -> serde_json::Value {
        crate::render::to_json(self)
    }

    /// Parses the JSON form back.
    pub fn from_json(value: &serde_json::Value) -> Result<Timeline> {
        Timeline::deserialize(value)
            .map_err(|e| ScheduleError::Parse(format!("timeline JSON: {e}")))
    }
}

/// Simulates one step of `program` under `costs`.
///
/// The program is first checked with [`validate`](crate::validate), so a
/// program that would deadlock with blocking (rendezvous) sends is refused
/// with the same [`ScheduleError::Deadlock`]. Timing then follows the comm
/// layer's eager sends: a send takes `comm` and does not wait for the
/// receiver; a receive starts once it is reached *and* its send has ended,
/// and takes `comm`. A compute action starts when its rank is free and its
/// cross-stage inputs have ended (in a lowered program the receive already
/// guarantees this). Works for un-lowered programs (no comm at all) and
/// lowered ones; with `comm = 0` a program lowered by
/// [`lower`](crate::lower) has exactly the timing of its un-lowered form
/// under the costs the lowering was planned with (the default costs for
/// `lower`, see [`lower_with_costs`](crate::lower_with_costs)).
///
/// **Activations** are counted per rank in program order: `+1` at each `F`,
/// `−1` when that (stage, microbatch)'s backward is complete, which is its
/// `B`, or its `W` for a split backward (the weight gradient still needs the
/// stashed input). For interleaving the count is per rank, over all of its
/// stages.
pub fn simulate(program: &Program, costs: &Costs) -> Result<Timeline> {
    simulate_by_stage(program, &vec![*costs; program.num_stages as usize])
}

/// [`simulate`] with costs of its own for each stage: `costs[s]` times the actions of
/// stage `s` and the messages it sends and receives (a stage with a larger share of
/// the model, or the embeddings or the head, is slower). The timeline's
/// [`Timeline::costs`] is the largest of each field over the stages.
///
/// Errors when `costs` does not have one entry per stage.
pub fn simulate_by_stage(program: &Program, costs: &[Costs]) -> Result<Timeline> {
    if costs.len() != program.num_stages as usize {
        return Err(ScheduleError::InvalidInput(format!(
            "{} stage costs for a program of {} stages: give one per stage",
            costs.len(),
            program.num_stages
        )));
    }
    for c in costs {
        c.check()?;
    }
    crate::validate(program)?;
    let times = engine::run(program, Semantics::Eager, &|a| {
        costs[a.stage as usize].of(a.op)
    })?;
    let max = |f: fn(&Costs) -> f64| costs.iter().map(f).fold(0.0f64, f64::max);
    let costs = Costs {
        f: max(|c| c.f),
        b: max(|c| c.b),
        i: max(|c| c.i),
        w: max(|c| c.w),
        comm: max(|c| c.comm),
    };
    let peaks: Vec<u32> = program.ranks.iter().map(|a| peak_activations(a)).collect();
    Ok(Timeline::from_times(program, costs, &times, None, &peaks))
}

/// Peak number of held activations over one rank's action list: `+1` at
/// `F`, `−1` at `B` or `W`.
pub fn peak_activations(actions: &[Action]) -> u32 {
    let (mut held, mut peak) = (0i64, 0i64);
    for a in actions {
        match a.op {
            Op::F => held += 1,
            Op::B | Op::W => held -= 1,
            _ => {}
        }
        peak = peak.max(held);
    }
    peak as u32
}
