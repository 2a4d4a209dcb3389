//! The event simulation shared by validation (rendezvous sends) and the
//! timeline simulation (eager sends).
//!
//! Each rank walks its list in order. A compute action starts when its rank
//! is free and its cross-stage inputs exist (`F` of stage `s` needs `F` of
//! `s − 1`; `B`/`I` of `s` needs its own `F` and the `B`/`I` of `s + 1`; `W`
//! needs its `I`). Under [`Semantics::Rendezvous`] a send and its receive
//! complete together, only when both ranks have reached them; under
//! [`Semantics::Eager`] a send completes on its own and the receive waits
//! for it. The program must be structurally valid (indices in range).

use crate::action::{Action, Op};
use crate::error::{Result, ScheduleError, Stuck};
use crate::program::Program;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Semantics {
    Rendezvous,
    Eager,
}

/// Dense index of (stage, microbatch, op).
pub(crate) struct Index {
    m: usize,
    len: usize,
}

impl Index {
    pub(crate) fn new(program: &Program) -> Index {
        let m = program.num_microbatches as usize;
        Index {
            m,
            len: program.num_stages as usize * m * 8,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn of(&self, a: &Action) -> usize {
        ((a.stage as usize * self.m) + a.microbatch as usize) * 8 + a.op.index()
    }
}

/// The cross-stage (and same-stage) inputs of a compute action, given which
/// actions exist (`present`, by [`Index`]).
pub(crate) fn deps(a: &Action, num_stages: u32, present: &[bool], ix: &Index) -> Vec<Action> {
    let (s, mb) = (a.stage, a.microbatch);
    match a.op {
        Op::F if s > 0 => vec![Action::new(s - 1, Op::F, mb)],
        Op::B | Op::I => {
            let mut d = vec![Action::new(s, Op::F, mb)];
            if s + 1 < num_stages {
                d.push(grad_producer(s + 1, mb, present, ix));
            }
            d
        }
        Op::W => vec![Action::new(s, Op::I, mb)],
        _ => vec![],
    }
}

/// The action that produces the input gradient of `stage` for `mb`: its `I`
/// when it uses a split backward, else its `B`.
pub(crate) fn grad_producer(stage: u32, mb: u32, present: &[bool], ix: &Index) -> Action {
    let i = Action::new(stage, Op::I, mb);
    if present[ix.of(&i)] {
        i
    } else {
        Action::new(stage, Op::B, mb)
    }
}

/// Start and end time of every action, `times[r][k]` for `ranks[r][k]`.
pub(crate) type Times = Vec<Vec<(f64, f64)>>;

/// Runs the program. `cost` gives each action's duration.
pub(crate) fn run(
    program: &Program,
    sem: Semantics,
    cost: &dyn Fn(&Action) -> f64,
) -> Result<Times> {
    let ix = Index::new(program);
    let mut present = vec![false; ix.len()];
    for a in program.ranks.iter().flatten() {
        present[ix.of(a)] = true;
    }
    let n = program.num_ranks();
    let mut done: Vec<Option<f64>> = vec![None; ix.len()];
    let mut ptr = vec![0usize; n];
    let mut free = vec![0.0f64; n];
    let mut times: Times = program
        .ranks
        .iter()
        .map(|r| Vec::with_capacity(r.len()))
        .collect();
    let rank_of = |s: u32| program.stage_to_rank[s as usize] as usize;
    loop {
        let mut progress = false;
        for r in 0..n {
            while let Some(&a) = program.ranks[r].get(ptr[r]) {
                let (start, end) = if a.op.is_compute() {
                    let mut start = free[r];
                    let mut ready = true;
                    for d in deps(&a, program.num_stages, &present, &ix) {
                        match done[ix.of(&d)] {
                            Some(t) => start = start.max(t),
                            None => {
                                ready = false;
                                break;
                            }
                        }
                    }
                    if !ready {
                        break;
                    }
                    (start, start + cost(&a))
                } else {
                    let Some(peer) = a.matching().filter(|p| p.stage < program.num_stages) else {
                        break;
                    };
                    match (sem, a.op.is_send()) {
                        (Semantics::Eager, true) => (free[r], free[r] + cost(&a)),
                        (Semantics::Eager, false) => match done[ix.of(&peer)] {
                            Some(t) => {
                                let start = free[r].max(t);
                                (start, start + cost(&a))
                            }
                            None => break,
                        },
                        (Semantics::Rendezvous, _) => {
                            let q = rank_of(peer.stage);
                            if q == r || program.ranks[q].get(ptr[q]) != Some(&peer) {
                                break;
                            }
                            let start = free[r].max(free[q]);
                            let end = start + cost(&a);
                            let peer_end = start + cost(&peer);
                            times[q].push((start, peer_end));
                            free[q] = peer_end;
                            done[ix.of(&peer)] = Some(peer_end);
                            ptr[q] += 1;
                            (start, end)
                        }
                    }
                };
                times[r].push((start, end));
                free[r] = end;
                done[ix.of(&a)] = Some(end);
                ptr[r] += 1;
                progress = true;
            }
        }
        if !progress {
            break;
        }
    }
    let stuck: Vec<Stuck> = (0..n)
        .filter_map(|r| {
            let a = *program.ranks[r].get(ptr[r])?;
            let waiting_for = if a.op.is_compute() {
                deps(&a, program.num_stages, &present, &ix)
                    .into_iter()
                    .find(|d| done[ix.of(d)].is_none())
            } else {
                a.matching()
            };
            Some(Stuck {
                rank: r as u32,
                action: a,
                waiting_for: waiting_for.and_then(|d| {
                    let q = *program.stage_to_rank.get(d.stage as usize)?;
                    Some((d, q))
                }),
            })
        })
        .collect();
    if stuck.is_empty() {
        Ok(times)
    } else {
        Err(ScheduleError::Deadlock(stuck))
    }
}
