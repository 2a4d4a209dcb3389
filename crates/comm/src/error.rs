//! The one error type of the transport. Every variant names the operation, the rank that
//! saw the problem and the peer or group involved, so a failure in a 64-rank job can be
//! traced without a debugger.

use std::fmt;
use std::time::Duration;

use crate::MeshShape;

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
    /// A mesh with an empty axis ([`MeshShape::validate`]).
    #[error("every mesh axis needs at least 1 rank, got {0}")]
    EmptyMeshAxis(MeshShape),
    /// A rank's compute pool could not be built ([`crate::threads::worker_pool`]).
    #[error("cannot build a compute pool of {threads} threads: {reason}")]
    Threads {
        /// The threads asked for.
        threads: usize,
        /// Rayon's error.
        reason: String,
    },
    /// A check of the [conformance suite](crate::conformance) failed: a backend's result
    /// differs from the reference, or an operation that should succeed failed (or one
    /// that should fail succeeded). The reason starts with the operation checked.
    #[error("{reason}")]
    Conformance {
        /// The suite's function that failed (`all_reduce`, `misuse`, ...).
        check: &'static str,
        /// What differed, from the operation and its arguments on.
        reason: String,
    },
}

impl From<CommError> for candle_core::Error {
    fn from(e: CommError) -> Self {
        candle_core::Error::wrap(e)
    }
}

pub type Result<T> = std::result::Result<T, CommError>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_thread_and_conformance_texts() {
        assert_eq!(
            CommError::EmptyMeshAxis(MeshShape::new(2, 0, 1)).to_string(),
            "every mesh axis needs at least 1 rank, got dp=2 pp=0 tp=1"
        );
        let e = CommError::Threads {
            threads: 4,
            reason: "out of threads".into(),
        };
        assert_eq!(
            e.to_string(),
            "cannot build a compute pool of 4 threads: out of threads"
        );
        let e = CommError::Conformance {
            check: "all_reduce",
            reason: "all_reduce Sum len 7 F32: element 3 is 1, want 2".into(),
        };
        assert_eq!(
            e.to_string(),
            "all_reduce Sum len 7 F32: element 3 is 1, want 2"
        );
    }
}
