//! [`lower`]: inserting the sends and receives between ranks.

use crate::action::{Action, Op};
use crate::engine::{self, grad_producer, Index, Semantics};
use crate::error::{Result, ScheduleError};
use crate::program::Program;
use crate::simulate::Costs;
use crate::validate::check_structure;

/// Adds the communication ops to an un-lowered program, planned with the
/// default [`Costs`]. See [`lower_with_costs`].
///
/// ```
/// use switchyard_schedule::{generate, lower, validate, ScheduleKind};
/// let p = lower(&generate(ScheduleKind::OneFOneB, 2, 2).unwrap()).unwrap();
/// assert_eq!(
///     p.to_string(),
///     "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\n\
///      rank 1: 1RF0 1F0 1RF1 1B0 1SB0 1F1 1B1 1SB1\n"
/// );
/// // Rank 1 posts 1RF1 before 1B0: with blocking sends, rank 0's 0SF1 must
/// // not wait for rank 1 to finish 1B0 while rank 1's 1SB0 waits for rank 0.
/// validate(&p).unwrap();
/// ```
pub fn lower(program: &Program) -> Result<Program> {
    lower_with_costs(program, &Costs::default())
}

/// Adds the communication ops to an un-lowered program.
///
/// For every pair of adjacent stages on *different* ranks and every
/// microbatch it inserts
/// * `sSFm` on the rank of stage `s`, after `sFm`, and `(s+1)RFm` on the
///   rank of stage `s + 1`, before `(s+1)Fm` (so stage 0 never receives an
///   activation and the last stage never sends one); with interleaving this
///   includes the loop-around from the last rank to rank 0 between virtual
///   stages `p − 1` and `p`, `2p − 1` and `2p`, ...;
/// * `(s+1)SBm` on the rank of stage `s + 1` after its `B` (or after its `I`
///   for a split backward: `W` sends nothing), and `sRBm` before the `B`/`I`
///   of `(s, m)` (the last stage never receives a gradient: its backward
///   starts from the loss).
///
/// Adjacent stages on the same rank hand data over locally and get no
/// messages.
///
/// **Ordering.** The un-lowered program is simulated under `costs` (compute
/// costs must be positive; `comm` is ignored). Each message is stamped with
/// the time its producer ends, and messages are sorted globally by (stamp,
/// sending stage, direction, microbatch). On each rank a send or receive is placed
/// among the compute actions at its stamp: after the actions that start
/// before it, before those that start at or after it. Then every rank sees
/// its messages in the same global order, each send follows the action that
/// produces its data, and each receive precedes the action that consumes it.
/// That makes the program deadlock-free even if every send blocks until its
/// receive is posted: the first unfinished message in the global order
/// always has both ends reachable. With eager sends and `comm = 0`, the
/// lowered program also keeps the un-lowered timing under `costs`
/// (receives are placed exactly when their data is ready).
///
/// Errors if the program is already lowered or is invalid.
pub fn lower_with_costs(program: &Program, costs: &Costs) -> Result<Program> {
    if program.is_lowered() {
        return Err(ScheduleError::InvalidInput(
            "the program is already lowered; call Program::without_comm() first to re-plan its messages"
                .into(),
        ));
    }
    if [costs.f, costs.b, costs.i, costs.w]
        .iter()
        .any(|c| !(c.is_finite() && *c > 0.0))
    {
        return Err(ScheduleError::InvalidInput(format!(
            "lowering needs positive compute costs to order messages, got {costs}"
        )));
    }
    check_structure(program)?;
    let times = engine::run(program, Semantics::Eager, &|a| costs.of(a.op))?;

    let ix = Index::new(program);
    let mut present = vec![false; ix.len()];
    let mut end = vec![0.0f64; ix.len()];
    for (actions, ts) in program.ranks.iter().zip(&times) {
        for (a, &(_, e)) in actions.iter().zip(ts) {
            present[ix.of(a)] = true;
            end[ix.of(a)] = e;
        }
    }

    // (stamp, send, recv); ties are broken by the send action's order
    // (stage, then SendF before SendB, then microbatch).
    let mut messages: Vec<(f64, Action, Action)> = Vec::new();
    for s in 0..program.num_stages.saturating_sub(1) {
        if !program.crosses_ranks(s, s + 1) {
            continue;
        }
        for mb in 0..program.num_microbatches {
            let f = Action::new(s, Op::F, mb);
            messages.push((
                end[ix.of(&f)],
                Action::new(s, Op::SendF, mb),
                Action::new(s + 1, Op::RecvF, mb),
            ));
            let g = grad_producer(s + 1, mb, &present, &ix);
            messages.push((
                end[ix.of(&g)],
                Action::new(s + 1, Op::SendB, mb),
                Action::new(s, Op::RecvB, mb),
            ));
        }
    }
    messages.sort_by(|a, b| a.0.total_cmp(&b.0).then_with(|| a.1.cmp(&b.1)));

    // Per rank: (time, class, tiebreak, action); messages (class 0) go
    // before compute actions (class 1) starting at the same time.
    let mut items: Vec<Vec<(f64, u8, usize, Action)>> = program
        .ranks
        .iter()
        .zip(&times)
        .map(|(actions, ts)| {
            actions
                .iter()
                .zip(ts)
                .enumerate()
                .map(|(k, (&a, &(s, _)))| (s, 1, k, a))
                .collect()
        })
        .collect();
    for (g, &(stamp, send, recv)) in messages.iter().enumerate() {
        for a in [send, recv] {
            let r = program.rank_of_stage(a.stage) as usize;
            items[r].push((stamp, 0, g, a));
        }
    }
    let ranks = items
        .into_iter()
        .map(|mut list| {
            list.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
            list.into_iter().map(|(_, _, _, a)| a).collect()
        })
        .collect();
    Ok(Program {
        ranks,
        ..program.clone()
    })
}
