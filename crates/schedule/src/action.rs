//! Actions: one step of one rank, with a compact text form (`1F3`, `2SB0`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Result, ScheduleError};

/// What an action does.
///
/// `F`, `B`, `I` and `W` are compute; the other four are the point-to-point
/// messages that [`lower`](crate::lower) inserts between stages on different
/// ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// Forward pass of one stage on one microbatch.
    F,
    /// Full backward pass (input gradient and weight gradient together).
    B,
    /// Input-gradient half of a split backward (zero-bubble schedules).
    I,
    /// Weight-gradient half of a split backward; needs the `I` before it.
    W,
    /// Send the activation of stage `s` to stage `s + 1` (text `SF`).
    SendF,
    /// Stage `s` receives its input activation from stage `s - 1` (text `RF`).
    RecvF,
    /// Send the input gradient of stage `s` to stage `s - 1` (text `SB`).
    SendB,
    /// Stage `s` receives its output gradient from stage `s + 1` (text `RB`).
    RecvB,
}

impl Op {
    /// All ops, in a fixed order (the order of [`Op::index`]).
    pub const ALL: [Op; 8] = [
        Op::F,
        Op::B,
        Op::I,
        Op::W,
        Op::SendF,
        Op::RecvF,
        Op::SendB,
        Op::RecvB,
    ];

    /// The op's text code: `F`, `B`, `I`, `W`, `SF`, `RF`, `SB`, `RB`.
    pub fn code(self) -> &'static str {
        match self {
            Op::F => "F",
            Op::B => "B",
            Op::I => "I",
            Op::W => "W",
            Op::SendF => "SF",
            Op::RecvF => "RF",
            Op::SendB => "SB",
            Op::RecvB => "RB",
        }
    }

    /// A dense index in `0..8`, the position in [`Op::ALL`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// `F`, `B`, `I` or `W`.
    pub fn is_compute(self) -> bool {
        matches!(self, Op::F | Op::B | Op::I | Op::W)
    }

    /// One of the four communication ops.
    pub fn is_comm(self) -> bool {
        !self.is_compute()
    }

    /// `SendF` or `SendB`.
    pub fn is_send(self) -> bool {
        matches!(self, Op::SendF | Op::SendB)
    }

    /// `RecvF` or `RecvB`.
    pub fn is_recv(self) -> bool {
        matches!(self, Op::RecvF | Op::RecvB)
    }

    /// `B`, `I` or `W`: a backward computation.
    pub fn is_backward(self) -> bool {
        matches!(self, Op::B | Op::I | Op::W)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.code())
    }
}

impl FromStr for Op {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self> {
        let up = s.trim().to_ascii_uppercase();
        Op::ALL
            .into_iter()
            .find(|op| op.code() == up)
            .ok_or_else(|| {
                ScheduleError::Parse(format!(
                    "unknown op {s:?}: expected one of F, B, I, W, SF, RF, SB, RB"
                ))
            })
    }
}

/// One step of one rank: `op` applied to `microbatch` at `stage`.
///
/// The text form is `<stage><op><microbatch>`: `1F3` is stage 1's forward of
/// microbatch 3, `1SF3` stage 1 sending that activation to stage 2 and `2RF3`
/// stage 2 receiving it; `2SB3` stage 2 sends the input gradient of
/// microbatch 3 to stage 1, which receives it with `1RB3`.
///
/// ```
/// use switchyard_schedule::{Action, Op};
/// let a: Action = "1SF3".parse().unwrap();
/// assert_eq!(a, Action::new(1, Op::SendF, 3));
/// assert_eq!(a.to_string(), "1SF3");
/// assert!("x1F".parse::<Action>().is_err());
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Action {
    /// The pipeline stage (model chunk) the action belongs to.
    pub stage: u32,
    /// What it does.
    pub op: Op,
    /// The microbatch.
    pub microbatch: u32,
}

impl Action {
    /// Builds an action.
    pub const fn new(stage: u32, op: Op, microbatch: u32) -> Self {
        Action {
            stage,
            op,
            microbatch,
        }
    }

    /// For a communication op, the other half of the message: `1SF3` ↔
    /// `2RF3`, `2SB3` ↔ `1RB3`. `None` for compute ops and for messages that
    /// would leave the pipeline (`SendB` of stage 0, `RecvF` of stage 0).
    pub fn matching(&self) -> Option<Action> {
        let (s, mb) = (self.stage, self.microbatch);
        match self.op {
            Op::SendF => Some(Action::new(s.checked_add(1)?, Op::RecvF, mb)),
            Op::RecvF => Some(Action::new(s.checked_sub(1)?, Op::SendF, mb)),
            Op::SendB => Some(Action::new(s.checked_sub(1)?, Op::RecvB, mb)),
            Op::RecvB => Some(Action::new(s.checked_add(1)?, Op::SendB, mb)),
            _ => None,
        }
    }

    /// For a communication op, the stage on the other end of the message.
    pub fn peer_stage(&self) -> Option<u32> {
        self.matching().map(|a| a.stage)
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}{}", self.stage, self.op.code(), self.microbatch)
    }
}

impl FromStr for Action {
    type Err = ScheduleError;

    fn from_str(text: &str) -> Result<Self> {
        let err = |why: &str| {
            ScheduleError::Parse(format!(
                "invalid action {text:?}: {why}; expected <stage><op><microbatch> like 1F3 or 2SB0 \
                 (op one of F, B, I, W, SF, RF, SB, RB)"
            ))
        };
        let s = text.trim();
        let op_start = s
            .find(|c: char| !c.is_ascii_digit())
            .ok_or_else(|| err("no op"))?;
        let op_end = s[op_start..]
            .find(|c: char| c.is_ascii_digit())
            .map(|i| op_start + i)
            .ok_or_else(|| err("no microbatch after the op"))?;
        if op_start == 0 {
            return Err(err("it does not start with a stage number"));
        }
        let stage = s[..op_start]
            .parse::<u32>()
            .map_err(|_| err("stage number out of range"))?;
        let op = s[op_start..op_end]
            .parse::<Op>()
            .map_err(|_| err(&format!("unknown op {:?}", &s[op_start..op_end])))?;
        let mb_text = &s[op_end..];
        if !mb_text.bytes().all(|b| b.is_ascii_digit()) {
            return Err(err("trailing characters after the microbatch"));
        }
        let microbatch = mb_text
            .parse::<u32>()
            .map_err(|_| err("microbatch number out of range"))?;
        Ok(Action::new(stage, op, microbatch))
    }
}

impl Serialize for Action {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Action {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// A message tag shared by a send and its matching receive.
///
/// Layout: `tag = (receiving_stage << 33) | (microbatch << 1) | kind`, where
/// `kind` is 0 for an activation travelling forward (`SendF`/`RecvF`) and 1
/// for a gradient travelling backward (`SendB`/`RecvB`), and the receiving
/// stage is `s + 1` for `sSFm`, `s` for `sRFm`, `s - 1` for `sSBm` and `s`
/// for `sRBm`. So `1SF3` and `2RF3` share `tag = 2 << 33 | 3 << 1`, and
/// `2SB3` and `1RB3` share `1 << 33 | 3 << 1 | 1`. The tag is unique per
/// message within one program (one training step) for any `u32` microbatch
/// and any stage below 2^31.
///
/// For a compute action (which sends nothing) it returns the tag of the
/// message the action's data would travel in, i.e. it treats `F` like
/// `SendF` and `B`/`I` like `SendB`; executors should only call it on
/// communication ops.
///
/// ```
/// use switchyard_schedule::{tag, Action};
/// let s: Action = "1SF3".parse().unwrap();
/// let r: Action = "2RF3".parse().unwrap();
/// assert_eq!(tag(&s), tag(&r));
/// assert_ne!(tag(&"2SB3".parse().unwrap()), tag(&r));
/// ```
pub fn tag(action: &Action) -> u64 {
    let s = u64::from(action.stage);
    let (kind, recv_stage) = match action.op {
        Op::SendF | Op::F => (0u64, s + 1),
        Op::RecvF => (0, s),
        Op::SendB | Op::B | Op::I | Op::W => (1, s.wrapping_sub(1)),
        Op::RecvB => (1, s),
    };
    (recv_stage << 33) | (u64::from(action.microbatch) << 1) | kind
}
