//! Errors of this crate.

use std::fmt;

use crate::action::Action;

/// Result alias used throughout the crate.
pub type Result<T, E = ScheduleError> = std::result::Result<T, E>;

/// One rank that cannot make progress in a deadlocked program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stuck {
    /// The rank that is stuck.
    pub rank: u32,
    /// The action at the head of that rank's list, which cannot run.
    pub action: Action,
    /// What it waits for: the action (and the rank that owns it) that has to
    /// happen first. For a send or receive this is the matching receive or
    /// send; for a compute action it is the missing cross-stage input.
    pub waiting_for: Option<(Action, u32)>,
}

impl fmt::Display for Stuck {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} stuck at {}", self.rank, self.action)?;
        if let Some((a, r)) = &self.waiting_for {
            write!(f, " (waiting for {a} on rank {r})")?;
        }
        Ok(())
    }
}

/// Everything that can go wrong when building, parsing, checking or
/// simulating a schedule. Messages name the offending actions.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    /// Bad arguments to a generator or a cost model (zero ranks, a
    /// microbatch count interleaving cannot use, a negative cost...).
    #[error("{0}")]
    InvalidInput(String),
    /// Text, CSV or JSON that could not be parsed.
    #[error("{0}")]
    Parse(String),
    /// The program breaks a rule: a missing or duplicated action, a backward
    /// before its forward, a send without its receive...
    #[error("invalid schedule: {0}")]
    Invalid(String),
    /// The program cannot finish: every listed rank waits on another.
    #[error("deadlock: {}", display_stuck(.0))]
    Deadlock(Vec<Stuck>),
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The underlying error.
        source: std::io::Error,
    },
}

fn display_stuck(stuck: &[Stuck]) -> String {
    stuck
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}
