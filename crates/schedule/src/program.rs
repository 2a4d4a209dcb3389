//! [`Program`]: per-rank ordered action lists, and its text form.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::action::{Action, Op};
use crate::error::{Result, ScheduleError};

/// A pipeline schedule as plain data: for every rank, the ordered list of
/// actions it performs in one training step.
///
/// Stage `s` runs on rank `stage_to_rank[s]`; one rank may own several stages
/// (interleaving). A program is *lowered* when it also lists the sends and
/// receives between stages on different ranks (see [`lower`](crate::lower)).
///
/// The text form ([`Display`](fmt::Display) / [`FromStr`]) is one line per
/// rank, `rank 0: 0F0 0F1 0B0 0B1`. Parsing infers `stage_to_rank`,
/// `num_stages` and `num_microbatches` like [`Program::from_rank_actions`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Program {
    /// Number of pipeline stages (model chunks), across all ranks.
    pub num_stages: u32,
    /// Number of microbatches in one step.
    pub num_microbatches: u32,
    /// `stage_to_rank[s]` is the rank that runs stage `s`.
    pub stage_to_rank: Vec<u32>,
    /// `ranks[r]` is rank `r`'s actions, in execution order.
    pub ranks: Vec<Vec<Action>>,
}

impl Program {
    /// Builds a program from per-rank action lists, inferring the rest:
    /// `stage_to_rank` from which rank holds each stage's compute actions
    /// (an error if a stage's compute actions are on two ranks, or if a stage
    /// below the highest has none), `num_stages` and `num_microbatches` from
    /// the largest indices plus one. Communication ops are ignored for the
    /// inference (they are checked by [`validate`](crate::validate)).
    pub fn from_rank_actions(ranks: Vec<Vec<Action>>) -> Result<Program> {
        // Every stage up to the highest needs a compute action of its own, and every
        // microbatch a forward on every stage, so no index of a program can reach the
        // number of its compute actions. Bounding the tables by that count keeps a typo
        // such as `4294967295F0` an error rather than an overflow or a huge allocation.
        let compute = ranks.iter().flatten().filter(|a| a.op.is_compute()).count();
        let mut owner: Vec<Option<u32>> = Vec::new();
        let mut max_stage = None::<u32>;
        let mut max_mb = None::<u32>;
        for (r, actions) in ranks.iter().enumerate() {
            let r = u32::try_from(r).map_err(|_| {
                ScheduleError::Invalid(format!("{} ranks is too many", ranks.len()))
            })?;
            for a in actions {
                if a.microbatch as usize >= compute {
                    return Err(ScheduleError::Invalid(format!(
                        "{a} on rank {r}: microbatch {} is out of range: the program has {compute} \
                         compute actions, too few for {} microbatches",
                        a.microbatch,
                        u64::from(a.microbatch) + 1
                    )));
                }
                max_stage = max_stage.max(Some(a.stage));
                max_mb = max_mb.max(Some(a.microbatch));
                let s = a.stage as usize;
                // A stage beyond the compute actions leaves a lower stage without one:
                // the loop below names it.
                if !a.op.is_compute() || s > compute {
                    continue;
                }
                if owner.len() <= s {
                    owner.resize(s + 1, None);
                }
                match owner[s] {
                    None => owner[s] = Some(r),
                    Some(o) if o != r => {
                        return Err(ScheduleError::Invalid(format!(
                        "stage {} has compute actions on two ranks: rank {o} and rank {r} ({a})",
                        a.stage
                    )))
                    }
                    Some(_) => {}
                }
            }
        }
        let num_stages = max_stage.map_or(0, |s| s as usize + 1);
        owner.resize(num_stages.min(compute + 1), None);
        let stage_to_rank = owner
            .iter()
            .enumerate()
            .map(|(s, o)| {
                o.ok_or_else(|| {
                    ScheduleError::Invalid(format!(
                        "stage {s} has no compute action on any rank, so its rank is unknown"
                    ))
                })
            })
            .collect::<Result<Vec<u32>>>()?;
        // Both below `compute + 1`, itself at most `u32::MAX + 1` here.
        let num_stages = u32::try_from(stage_to_rank.len())
            .map_err(|_| ScheduleError::Invalid("too many stages".into()))?;
        let num_microbatches = max_mb.map_or(0, |m| m + 1);
        Ok(Program {
            num_stages,
            num_microbatches,
            stage_to_rank,
            ranks,
        })
    }

    /// Number of ranks (`ranks.len()`).
    pub fn num_ranks(&self) -> usize {
        self.ranks.len()
    }

    /// The rank that runs stage `stage`.
    ///
    /// # Panics
    /// If `stage >= num_stages`.
    pub fn rank_of_stage(&self, stage: u32) -> u32 {
        match self.stage_to_rank.get(stage as usize) {
            Some(&r) => r,
            None => panic!(
                "stage {stage} out of range: the program has {} stages",
                self.stage_to_rank.len()
            ),
        }
    }

    /// The stages rank `rank` runs, ascending.
    pub fn stages_of_rank(&self, rank: u32) -> Vec<u32> {
        (0..self.stage_to_rank.len() as u32)
            .filter(|&s| self.stage_to_rank[s as usize] == rank)
            .collect()
    }

    /// Whether the program contains communication ops.
    pub fn is_lowered(&self) -> bool {
        self.ranks.iter().flatten().any(|a| a.op.is_comm())
    }

    /// For a communication op, the rank on the other end of the message
    /// (`RecvF` of stage `s` receives from `rank_of_stage(s - 1)`, `RecvB`
    /// from `rank_of_stage(s + 1)`, sends symmetrically). `None` for compute
    /// ops or when the peer stage does not exist.
    pub fn peer_rank(&self, action: &Action) -> Option<u32> {
        let peer = action.peer_stage()?;
        self.stage_to_rank.get(peer as usize).copied()
    }

    /// Whether stages `a` and `b` run on different ranks, so that data
    /// between them travels as a message rather than a local handoff.
    pub fn crosses_ranks(&self, a: u32, b: u32) -> bool {
        self.stage_to_rank.get(a as usize) != self.stage_to_rank.get(b as usize)
    }

    /// Total number of actions over all ranks.
    pub fn num_actions(&self) -> usize {
        self.ranks.iter().map(Vec::len).sum()
    }

    /// The same program without its communication ops (the inverse of
    /// [`lower`](crate::lower)).
    pub fn without_comm(&self) -> Program {
        Program {
            ranks: self
                .ranks
                .iter()
                .map(|r| r.iter().copied().filter(|a| a.op.is_compute()).collect())
                .collect(),
            ..self.clone()
        }
    }

    /// Whether any (stage, microbatch) uses a split backward (`I` + `W`).
    pub fn has_split_backward(&self) -> bool {
        self.ranks
            .iter()
            .flatten()
            .any(|a| matches!(a.op, Op::I | Op::W))
    }

    /// Parses one text line `rank R: a a a` (or `R: a a a`), returning the
    /// rank index and its actions.
    fn parse_line(line: &str) -> Result<(usize, Vec<Action>)> {
        let (head, rest) = line.split_once(':').ok_or_else(|| {
            ScheduleError::Parse(format!("line {line:?}: expected `rank <index>: <actions>`"))
        })?;
        let idx = head.trim();
        let idx = idx.strip_prefix("rank").unwrap_or(idx).trim();
        let rank = idx
            .parse::<usize>()
            .map_err(|_| ScheduleError::Parse(format!("line {line:?}: bad rank index {idx:?}")))?;
        let actions = rest
            .split_whitespace()
            .map(str::parse)
            .collect::<Result<Vec<Action>>>()?;
        Ok((rank, actions))
    }
}

/// Puts per-rank rows given in any order into rank order; every rank from 0
/// to the largest index must appear exactly once.
pub(crate) fn assemble_ranks(rows: Vec<(usize, Vec<Action>)>) -> Result<Vec<Vec<Action>>> {
    // With n rows the ranks are 0..n; a larger index (however large) means a rank
    // below it is missing, which is the error to report.
    let n = rows.len();
    let mut out: Vec<Option<Vec<Action>>> = vec![None; n];
    let mut beyond = false;
    for (r, actions) in rows {
        match out.get_mut(r) {
            Some(slot) => {
                if slot.replace(actions).is_some() {
                    return Err(ScheduleError::Parse(format!("rank {r} is listed twice")));
                }
            }
            None => beyond = true,
        }
    }
    if beyond {
        let r = out.iter().position(Option::is_none).unwrap_or(n);
        return Err(ScheduleError::Parse(format!("rank {r} is missing")));
    }
    out.into_iter()
        .enumerate()
        .map(|(r, a)| a.ok_or_else(|| ScheduleError::Parse(format!("rank {r} is missing"))))
        .collect()
}

impl fmt::Display for Program {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (r, actions) in self.ranks.iter().enumerate() {
            write!(f, "rank {r}:")?;
            for a in actions {
                write!(f, " {a}")?;
            }
            writeln!(f)?;
        }
        Ok(())
    }
}

impl FromStr for Program {
    type Err = ScheduleError;

    /// Parses the text form. Blank lines and lines starting with `#` are
    /// skipped.
    fn from_str(s: &str) -> Result<Self> {
        let rows = s
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .map(Program::parse_line)
            .collect::<Result<Vec<_>>>()?;
        Program::from_rank_actions(assemble_ranks(rows)?)
    }
}
