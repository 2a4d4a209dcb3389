//! Schedule generators: GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-H2.
//!
//! Every generator takes the number of ranks `p` (pipeline-parallel size)
//! and of microbatches `m` and returns an un-lowered [`Program`] (compute
//! actions only); [`lower`](crate::lower) adds the messages.

use std::fmt;
use std::str::FromStr;

use crate::action::{Action, Op};
use crate::error::{Result, ScheduleError};
use crate::program::Program;

/// The built-in schedules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleKind {
    /// All forwards, then all backwards (arXiv 1811.06965).
    GPipe,
    /// PipeDream-Flush / 1F1B: warm-up forwards, then alternate, then
    /// cool-down backwards.
    OneFOneB,
    /// Megatron's interleaved 1F1B with `virtual_stages` model chunks per
    /// rank (arXiv 2104.04473). Needs `m` to be a multiple of `p` when
    /// `virtual_stages > 1`.
    Interleaved {
        /// Model chunks per rank (`v`); `v = 1` is plain 1F1B.
        virtual_stages: usize,
    },
    /// Zero-bubble ZB-H1 (arXiv 2401.10241): backward split into `I` and
    /// `W`, with `W` deferred to fill the bubbles.
    ZbH1,
    /// Zero-bubble ZB-H2 (arXiv 2401.10241): ZB-H1 with more warm-up forwards
    /// and `W`s deferred further, for `2p − 1` microbatches of activations a
    /// rank instead of `p`.
    ZbH2,
}

impl ScheduleKind {
    /// Parses a kind name (`gpipe`, `1f1b`, `interleaved`, `zb-h1`) with an
    /// optional `--virtual-stages` value, as a CLI receives them. The value
    /// defaults to 2 for `interleaved` and is refused for the other kinds.
    pub fn from_name(name: &str, virtual_stages: Option<usize>) -> Result<ScheduleKind> {
        let kind: ScheduleKind = name.parse()?;
        match (kind, virtual_stages) {
            (ScheduleKind::Interleaved { .. }, Some(v)) => {
                Ok(ScheduleKind::Interleaved { virtual_stages: v })
            }
            (k, None) => Ok(k),
            (k, Some(v)) => Err(ScheduleError::InvalidInput(format!(
                "virtual stages ({v}) only apply to the interleaved schedule, not {k}"
            ))),
        }
    }

    /// Generates the program for `ranks` ranks and `microbatches`
    /// microbatches (same as [`generate`]).
    pub fn program(&self, ranks: usize, microbatches: usize) -> Result<Program> {
        generate(*self, ranks, microbatches)
    }
}

impl fmt::Display for ScheduleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ScheduleKind::GPipe => f.write_str("gpipe"),
            ScheduleKind::OneFOneB => f.write_str("1f1b"),
            ScheduleKind::Interleaved { virtual_stages } => {
                write!(f, "interleaved:{virtual_stages}")
            }
            ScheduleKind::ZbH1 => f.write_str("zb-h1"),
            ScheduleKind::ZbH2 => f.write_str("zb-h2"),
        }
    }
}

impl FromStr for ScheduleKind {
    type Err = ScheduleError;

    /// `gpipe`, `1f1b` (also `pipedream-flush`), `interleaved` (2 virtual
    /// stages) or `interleaved:V`, `zb-h1` (also `zbh1`, `zb`), `zb-h2` (also
    /// `zbh2`); case-insensitive.
    fn from_str(s: &str) -> Result<Self> {
        let lower = s.trim().to_ascii_lowercase();
        let (name, arg) = match lower.split_once([':', '=']) {
            Some((n, a)) => (n, Some(a)),
            None => (lower.as_str(), None),
        };
        let kind = match name {
            "gpipe" => ScheduleKind::GPipe,
            "1f1b" | "one-f-one-b" | "pipedream-flush" => ScheduleKind::OneFOneB,
            "interleaved" | "interleaved-1f1b" => {
                let virtual_stages = match arg {
                    None => 2,
                    Some(a) => a.parse().map_err(|_| {
                        ScheduleError::Parse(format!(
                            "schedule {s:?}: virtual stages must be a number, like interleaved:2"
                        ))
                    })?,
                };
                return Ok(ScheduleKind::Interleaved { virtual_stages });
            }
            "zb-h1" | "zbh1" | "zb" | "zero-bubble" => ScheduleKind::ZbH1,
            "zb-h2" | "zbh2" => ScheduleKind::ZbH2,
            _ => {
                return Err(ScheduleError::Parse(format!(
                    "unknown schedule {s:?}: expected gpipe, 1f1b, interleaved, zb-h1 or zb-h2"
                )))
            }
        };
        if arg.is_some() {
            return Err(ScheduleError::Parse(format!(
                "schedule {s:?}: only interleaved takes a parameter"
            )));
        }
        Ok(kind)
    }
}

/// Generates the program of `kind` for `ranks` ranks (`p`) and
/// `microbatches` microbatches (`m`).
///
/// ```
/// use switchyard_schedule::{generate, ScheduleKind};
/// let p = generate(ScheduleKind::OneFOneB, 2, 3).unwrap();
/// assert_eq!(p.to_string(), "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2\nrank 1: 1F0 1B0 1F1 1B1 1F2 1B2\n");
/// ```
pub fn generate(kind: ScheduleKind, ranks: usize, microbatches: usize) -> Result<Program> {
    match kind {
        ScheduleKind::GPipe => gpipe(ranks, microbatches),
        ScheduleKind::OneFOneB => one_f_one_b(ranks, microbatches),
        ScheduleKind::Interleaved { virtual_stages } => {
            interleaved(ranks, virtual_stages, microbatches)
        }
        ScheduleKind::ZbH1 => zb_h1(ranks, microbatches),
        ScheduleKind::ZbH2 => zb_h2(ranks, microbatches),
    }
}

fn check_sizes(p: usize, m: usize) -> Result<(u32, u32)> {
    if p == 0 {
        return Err(ScheduleError::InvalidInput(
            "a pipeline needs at least 1 rank (stage), got 0".into(),
        ));
    }
    if m == 0 {
        return Err(ScheduleError::InvalidInput(
            "a schedule needs at least 1 microbatch, got 0".into(),
        ));
    }
    let p32 = u32::try_from(p)
        .map_err(|_| ScheduleError::InvalidInput(format!("{p} ranks is too many")))?;
    let m32 = u32::try_from(m)
        .map_err(|_| ScheduleError::InvalidInput(format!("{m} microbatches is too many")))?;
    Ok((p32, m32))
}

fn one_stage_per_rank(p: u32, m: u32, ranks: Vec<Vec<Action>>) -> Program {
    Program {
        num_stages: p,
        num_microbatches: m,
        stage_to_rank: (0..p).collect(),
        ranks,
    }
}

/// GPipe: every rank runs all its forwards, then all its backwards (in
/// microbatch order). Stage `r` is rank `r`. Holds all `m` activations.
pub fn gpipe(ranks: usize, microbatches: usize) -> Result<Program> {
    let (p, m) = check_sizes(ranks, microbatches)?;
    let lists = (0..p)
        .map(|r| {
            let fwd = (0..m).map(|mb| Action::new(r, Op::F, mb));
            fwd.chain((0..m).map(|mb| Action::new(r, Op::B, mb)))
                .collect()
        })
        .collect();
    Ok(one_stage_per_rank(p, m, lists))
}

/// 1F1B (PipeDream-Flush): rank `r` warms up with `min(p - r - 1, m)`
/// forwards, then alternates one forward and one backward, then drains the
/// remaining backwards. Holds at most `min(p - r, m)` activations.
pub fn one_f_one_b(ranks: usize, microbatches: usize) -> Result<Program> {
    let (p, m) = check_sizes(ranks, microbatches)?;
    let lists = (0..p)
        .map(|r| {
            let warmup = (p - r - 1).min(m);
            let mut list: Vec<Action> = (0..warmup).map(|mb| Action::new(r, Op::F, mb)).collect();
            for i in 0..m - warmup {
                list.push(Action::new(r, Op::F, warmup + i));
                list.push(Action::new(r, Op::B, i));
            }
            list.extend((m - warmup..m).map(|mb| Action::new(r, Op::B, mb)));
            list
        })
        .collect();
    Ok(one_stage_per_rank(p, m, lists))
}

/// Interleaved 1F1B (Megatron-LM's `forward_backward_pipelining_with_interleaving`).
///
/// There are `p·v` stages; stage `s` runs on rank `s mod p`, so rank `r`
/// holds chunks `r, r + p, ..., r + (v−1)p` and the activation of stage
/// `p − 1` loops around from the last rank to rank 0. Each rank walks `m·v`
/// "virtual microbatches" `k`: forward `k` is chunk `(k mod pv) div p` of
/// microbatch `(k div pv)·p + k mod p`; backward `k` is the same microbatch
/// of chunk `v − 1 − (k mod pv) div p`. Rank `r` warms up with
/// `min(2(p − r − 1) + (v − 1)p, m·v)` forwards, then alternates forward and
/// backward, then drains.
///
/// With `v > 1`, `m` must be a multiple of `p` (Megatron's constraint: the
/// microbatches go through the chunks in groups of `p`); other values are
/// refused with an error that suggests the nearest valid counts. `v = 1` is
/// plain [`one_f_one_b`].
pub fn interleaved(ranks: usize, virtual_stages: usize, microbatches: usize) -> Result<Program> {
    if virtual_stages == 0 {
        return Err(ScheduleError::InvalidInput(
            "interleaved 1F1B needs at least 1 virtual stage per rank, got 0".into(),
        ));
    }
    let (p, m) = check_sizes(ranks, microbatches)?;
    if virtual_stages == 1 {
        return one_f_one_b(ranks, microbatches);
    }
    let v = u32::try_from(virtual_stages).map_err(|_| {
        ScheduleError::InvalidInput(format!("{virtual_stages} virtual stages is too many"))
    })?;
    if m % p != 0 {
        let below = m / p * p;
        let above = below + p;
        let suggestion = if below == 0 {
            format!("use {above}")
        } else {
            format!("use {below} or {above}")
        };
        return Err(ScheduleError::InvalidInput(format!(
            "interleaved 1F1B with {p} ranks needs the number of microbatches to be a multiple \
             of {p}, got {m}; {suggestion} (or use --virtual-stages 1, which is plain 1F1B)"
        )));
    }
    let num_stages = p.checked_mul(v).ok_or_else(|| {
        ScheduleError::InvalidInput(format!("{p} ranks x {v} virtual stages is too many"))
    })?;
    let group = p * v;
    let total = m * v;
    let slot = |k: u32, forward: bool| {
        let chunk = (k % group) / p;
        let chunk = if forward { chunk } else { v - 1 - chunk };
        let mb = (k / group) * p + k % p;
        (chunk, mb)
    };
    let lists = (0..p)
        .map(|r| {
            let fwd = |k: u32| {
                let (c, mb) = slot(k, true);
                Action::new(c * p + r, Op::F, mb)
            };
            let bwd = |k: u32| {
                let (c, mb) = slot(k, false);
                Action::new(c * p + r, Op::B, mb)
            };
            let warmup = (2 * (p - r - 1) + (v - 1) * p).min(total);
            let mut list: Vec<Action> = (0..warmup).map(fwd).collect();
            for i in 0..total - warmup {
                list.push(fwd(warmup + i));
                list.push(bwd(i));
            }
            list.extend((total - warmup..total).map(bwd));
            list
        })
        .collect();
    Ok(Program {
        num_stages,
        num_microbatches: m,
        stage_to_rank: (0..num_stages).map(|s| s % p).collect(),
        ranks: lists,
    })
}

/// ZB-H1 (zero bubble, "handcrafted 1", arXiv 2401.10241).
///
/// The backward is split into `I` (input gradient, on the critical path to
/// the previous stage) and `W` (weight gradient, local). Rank `r` runs the
/// 1F1B order with `I` in place of `B` — `min(p − r − 1, m)` warm-up
/// forwards, then forward/`I` pairs, then the remaining `I`s — and places
/// the `W`s behind: in the steady phase rank `r` runs `W` of microbatch
/// `i − r` after the `i`-th pair, so the last ranks keep up to `r` weight
/// gradients pending while their `I`s hurry upstream; in the cool-down each
/// `I` is followed by one pending `W`, and the rest close the step, filling
/// the cool-down bubble. Every rank then holds at most `min(p, m)` stashed
/// microbatches, the same bound as 1F1B's first stage (counting an
/// activation as held until its `W`).
pub fn zb_h1(ranks: usize, microbatches: usize) -> Result<Program> {
    let (p, m) = check_sizes(ranks, microbatches)?;
    let lists = (0..p)
        .map(|r| split_backward_list(r, (p - r - 1).min(m), r, m))
        .collect();
    Ok(one_stage_per_rank(p, m, lists))
}

/// ZB-H2 (zero bubble, "handcrafted 2", arXiv 2401.10241): ZB-H1 that spends
/// memory on the bubble.
///
/// Rank `r` runs `min(2(p − r) − 1, m)` forwards before its first `I` (ZB-H1:
/// `p − r`), so the first rank has work while the first gradient comes back,
/// and keeps its `W`s up to `2r` behind its `I`s (ZB-H1: `r`), so the last
/// ranks send their input gradients upstream sooner and fill the cool-down with
/// `W`s. Every rank then holds at most `min(2p − 1, m)` stashed microbatches
/// (ZB-H1: `min(p, m)`), and the bubble comes down to about the last rank's wait
/// for its first forward, `(p − 1)·F`: with `F = 1, I = 1.2, W = 0.9`, 3.9 %
/// against ZB-H1's 5.0 % at `p = 2, m = 8`, and 6.6 % against 8.4 % at
/// `p = 8, m = 32` (the same 26.8 % at `p = m = 8`: the extra forwards need
/// microbatches to run).
pub fn zb_h2(ranks: usize, microbatches: usize) -> Result<Program> {
    let (p, m) = check_sizes(ranks, microbatches)?;
    let lists = (0..p)
        .map(|r| split_backward_list(r, (2 * (p - r) - 1).min(m) - 1, 2 * r, m))
        .collect();
    Ok(one_stage_per_rank(p, m, lists))
}

/// A zero-bubble rank's actions: `warmup` forwards, then forward/`I` pairs with a
/// `W` after each pair once `lag` pairs have run, then the remaining `I`s, each
/// followed by one pending `W`, then the `W`s left.
fn split_backward_list(r: u32, warmup: u32, lag: u32, m: u32) -> Vec<Action> {
    let mut list: Vec<Action> = (0..warmup).map(|mb| Action::new(r, Op::F, mb)).collect();
    let mut next_w = 0;
    for i in 0..m - warmup {
        list.push(Action::new(r, Op::F, warmup + i));
        list.push(Action::new(r, Op::I, i));
        if i >= lag {
            list.push(Action::new(r, Op::W, next_w));
            next_w += 1;
        }
    }
    for mb in m - warmup..m {
        list.push(Action::new(r, Op::I, mb));
        if next_w < m {
            list.push(Action::new(r, Op::W, next_w));
            next_w += 1;
        }
    }
    list.extend((next_w..m).map(|mb| Action::new(r, Op::W, mb)));
    list
}
