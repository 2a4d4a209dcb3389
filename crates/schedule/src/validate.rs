//! [`validate`]: the rules every program must follow, and the deadlock check.

use crate::action::{Action, Op};
use crate::engine::{self, grad_producer, Index, Semantics};
use crate::error::{Result, ScheduleError};
use crate::program::Program;

/// Checks that a program is a complete, correctly ordered, deadlock-free
/// training step.
///
/// The rules:
/// * shape: at least one stage and microbatch, `stage_to_rank` has one
///   entry per stage naming an existing rank, every action's stage and
///   microbatch in range, and every action on the rank that owns its stage;
/// * every (stage, microbatch) has exactly one `F`, and either exactly one
///   `B` or exactly one `I` and one `W` (not both forms), no action twice;
/// * on its rank, `F` comes before `B`/`I`, and `I` before `W`; data between
///   stages on the same rank (a local handoff) is produced before it is used;
/// * a lowered program (one with any communication op) carries every
///   cross-rank message: `sSFm` after `sFm` on the sender and the matching
///   `(s+1)RFm` before `(s+1)Fm` on the receiver; `sSBm` after the `B`/`I`
///   of `(s, m)` and `(s−1)RBm` before the `B`/`I` of `(s−1, m)`; a message
///   between stages on the same rank is an error (use a local handoff);
/// * the program runs to completion in an event simulation where every send
///   blocks until its receive is posted (rendezvous), and every compute
///   action waits for its cross-stage inputs (for an un-lowered program this
///   is the only check of cross-rank dependencies). If it gets stuck the
///   error is [`ScheduleError::Deadlock`], naming every stuck rank, the
///   action it is stuck at and what that action waits for, e.g.
///   `deadlock: rank 0 stuck at 0RB0 (waiting for 1SB0 on rank 1), rank 1
///   stuck at 1RF0 (waiting for 0SF0 on rank 0)`.
pub fn validate(program: &Program) -> Result<()> {
    check_structure(program)?;
    engine::run(program, Semantics::Rendezvous, &|_| 1.0)?;
    Ok(())
}

fn invalid<T>(msg: String) -> Result<T> {
    Err(ScheduleError::Invalid(msg))
}

/// Everything but the deadlock check.
pub(crate) fn check_structure(program: &Program) -> Result<()> {
    let (ns, nm, nr) = (
        program.num_stages,
        program.num_microbatches,
        program.num_ranks(),
    );
    if ns == 0 || nm == 0 {
        return invalid(format!(
            "a program needs at least one stage and one microbatch, got {ns} stages and {nm} microbatches"
        ));
    }
    if program.stage_to_rank.len() != ns as usize {
        return invalid(format!(
            "stage_to_rank has {} entries for {ns} stages",
            program.stage_to_rank.len()
        ));
    }
    if let Some((s, r)) = program
        .stage_to_rank
        .iter()
        .enumerate()
        .find(|(_, &r)| r as usize >= nr)
    {
        return invalid(format!(
            "stage {s} is mapped to rank {r}, but the program has {nr} ranks"
        ));
    }
    // Every (stage, microbatch) needs its own forward: a program with fewer compute
    // actions than that is incomplete, and its tables (sized by the product) could be
    // larger than memory.
    let compute = program
        .ranks
        .iter()
        .flatten()
        .filter(|a| a.op.is_compute())
        .count();
    if u64::from(ns) * u64::from(nm) > compute as u64 {
        return invalid(format!(
            "{ns} stages × {nm} microbatches need at least {} forwards, but the program has only {compute} compute actions",
            u64::from(ns) * u64::from(nm)
        ));
    }
    let ix = Index::new(program);
    // pos[index] = (rank, position) of each action.
    let mut pos: Vec<Option<(usize, usize)>> = vec![None; ix.len()];
    for (r, actions) in program.ranks.iter().enumerate() {
        for (k, a) in actions.iter().enumerate() {
            if a.stage >= ns || a.microbatch >= nm {
                return invalid(format!(
                    "{a} on rank {r} is out of range: the program has {ns} stages and {nm} microbatches"
                ));
            }
            let owner = program.rank_of_stage(a.stage) as usize;
            if owner != r {
                return invalid(format!(
                    "{a} is on rank {r}, but stage {} runs on rank {owner}",
                    a.stage
                ));
            }
            if a.op.is_comm() {
                check_comm_op(program, a)?;
            }
            if let Some((r0, k0)) = pos[ix.of(a)].replace((r, k)) {
                return invalid(format!(
                    "{a} appears twice (rank {r0} position {k0} and rank {r} position {k})"
                ));
            }
        }
    }
    let at = |a: &Action| pos[ix.of(a)];
    let present: Vec<bool> = pos.iter().map(Option::is_some).collect();
    for s in 0..ns {
        for mb in 0..nm {
            let [f, b, i, w] = [Op::F, Op::B, Op::I, Op::W].map(|op| Action::new(s, op, mb));
            let Some(fp) = at(&f) else {
                return invalid(format!(
                    "{f} is missing: every stage runs every microbatch forward once"
                ));
            };
            match (at(&b), at(&i), at(&w)) {
                (Some(_), None, None) | (None, Some(_), Some(_)) => {}
                (None, None, None) => {
                    return invalid(format!("{b} is missing (or the split pair {i} and {w})"))
                }
                (Some(_), _, _) => {
                    return invalid(format!(
                        "{b} and a split backward ({i}/{w}) are both present; use one form"
                    ))
                }
                (None, Some(_), None) => {
                    return invalid(format!("{w} is missing ({i} is present)"))
                }
                (None, None, Some(_)) => {
                    return invalid(format!("{i} is missing ({w} is present)"))
                }
            }
            let back = if at(&b).is_some() { b } else { i };
            let bp = at(&back).unwrap_or_default();
            if bp.1 < fp.1 {
                return invalid(format!(
                    "{back} on rank {} comes before its forward {f}",
                    bp.0
                ));
            }
            if let (Some(ip), Some(wp)) = (at(&i), at(&w)) {
                if wp.1 < ip.1 {
                    return invalid(format!("{w} on rank {} comes before {i}", wp.0));
                }
            }
        }
    }
    let lowered = program.is_lowered();
    for s in 0..ns.saturating_sub(1) {
        for mb in 0..nm {
            // Forward edge s -> s+1.
            let producer = Action::new(s, Op::F, mb);
            let consumer = Action::new(s + 1, Op::F, mb);
            let msg = (
                Action::new(s, Op::SendF, mb),
                Action::new(s + 1, Op::RecvF, mb),
            );
            check_edge(program, lowered, producer, consumer, msg, &at)?;
            // Backward edge s+1 -> s.
            let producer = grad_producer(s + 1, mb, &present, &ix);
            let consumer = grad_producer(s, mb, &present, &ix);
            let msg = (
                Action::new(s + 1, Op::SendB, mb),
                Action::new(s, Op::RecvB, mb),
            );
            check_edge(program, lowered, producer, consumer, msg, &at)?;
        }
    }
    Ok(())
}

/// A communication op must connect two existing stages on different ranks.
fn check_comm_op(program: &Program, a: &Action) -> Result<()> {
    let Some(peer) = a.matching().filter(|p| p.stage < program.num_stages) else {
        let why = match a.op {
            Op::SendF | Op::RecvB => "the last stage has no next stage",
            _ => "stage 0 has no previous stage",
        };
        return invalid(format!("{a} leaves the pipeline: {why}"));
    };
    if !program.crosses_ranks(a.stage, peer.stage) {
        return invalid(format!(
            "{a} is a message between stages {} and {} on the same rank {}; \
             a local handoff needs no send or receive",
            a.stage,
            peer.stage,
            program.rank_of_stage(a.stage)
        ));
    }
    Ok(())
}

/// Checks one data dependency `producer -> consumer` carried by `msg`
/// (send, receive) when the stages are on different ranks.
fn check_edge(
    program: &Program,
    lowered: bool,
    producer: Action,
    consumer: Action,
    (send, recv): (Action, Action),
    at: &dyn Fn(&Action) -> Option<(usize, usize)>,
) -> Result<()> {
    let (Some(pp), Some(cp)) = (at(&producer), at(&consumer)) else {
        return Ok(());
    };
    if !program.crosses_ranks(producer.stage, consumer.stage) {
        if cp.1 < pp.1 {
            return invalid(format!(
                "{consumer} on rank {} comes before {producer}, which produces its input on the same rank",
                cp.0
            ));
        }
        return Ok(());
    }
    if !lowered {
        return Ok(());
    }
    let (sender, receiver) = (pp.0, cp.0);
    match (at(&send), at(&recv)) {
        (Some(_), None) => invalid(format!(
            "{send} on rank {sender} has no matching receive {recv} on rank {receiver}"
        )),
        (None, Some(_)) => invalid(format!(
            "{recv} on rank {receiver} has no matching send {send} on rank {sender}"
        )),
        (None, None) => invalid(format!(
            "the lowered program has no message for {producer} -> {consumer}: \
             expected {send} on rank {sender} and {recv} on rank {receiver}"
        )),
        (Some(sp), Some(rp)) => {
            if sp.1 < pp.1 {
                return invalid(format!(
                    "{send} on rank {sender} comes before {producer}, which produces the data it sends"
                ));
            }
            if cp.1 < rp.1 {
                return invalid(format!(
                    "{consumer} on rank {receiver} comes before {recv}, which receives its input"
                ));
            }
            Ok(())
        }
    }
}
