//! The one error type of the transport. Every variant names the operation, the rank that
//! saw the problem and the peer or group involved, so a failure in a 64-rank job can be
//! traced without a debugger.

use std::fmt;
use std::time::Duration;

/// Who a blocked operation was waiting for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    /// A point-to-point partner, by its rank in the communicator.
    Rank(usize),
    /// All members of a group, described as `"<name>[global ranks]"`.
    Group(String),
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Peer::Rank(r) => write!(f, "peer rank {r}"),
            Peer::Group(g) => write!(f, "group {g}"),
        }
    }
}

/// An error from a communicator operation.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CommError {
    /// Another rank of the job failed (returned an error, panicked or timed out) and this
    /// operation was abandoned instead of waiting forever.
    #[error(
        "{op} on rank {rank} (waiting for {peer}) abandoned: rank {failed_rank} failed: {cause}"
    )]
    PeerFailed {
        op: &'static str,
        rank: usize,
        peer: Peer,
        failed_rank: usize,
        cause: String,
    },
    /// The operation did not complete within the communicator's timeout.
    #[error("{op} on rank {rank} timed out after {after:?} waiting for {peer}")]
    Timeout {
        op: &'static str,
        rank: usize,
        peer: Peer,
        after: Duration,
    },
    /// The caller passed something that cannot work (a rank out of range, a dim that does
    /// not exist, a shape that does not split).
    #[error("{op} on rank {rank}: invalid argument: {reason}")]
    Invalid {
        op: &'static str,
        rank: usize,
        reason: String,
    },
    /// The ranks of a group called a collective with arguments that do not agree
    /// (different operations, shapes, dtypes, roots or split keys).
    #[error("{op} on rank {rank} in group {group}: ranks disagree: {reason}")]
    Mismatch {
        op: &'static str,
        rank: usize,
        group: String,
        reason: String,
    },
    /// The backend itself failed (a tensor operation, an MPI call).
    #[error("{op} on rank {rank}: {reason}")]
    Backend {
        op: &'static str,
        rank: usize,
        reason: String,
    },
    /// The requested backend is not compiled into this build.
    #[error("{0}")]
    Unavailable(String),
}

impl From<CommError> for candle_core::Error {
    fn from(e: CommError) -> Self {
        candle_core::Error::wrap(e)
    }
}

pub type Result<T> = std::result::Result<T, CommError>;
