//! The errors of this crate. They are returned as [`candle_core::Error`] (wrapped), so
//! they travel through `?` in model code; their messages name the parameter or layer.

/// Everything that can go wrong when sharding, creating parameters or building layers.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShardError {
    /// A dim whose size is not a multiple of `blocks × ranks`.
    #[error("dim {dim} of {what} (size {size}) does not split into {}", split_desc(*.blocks, *.ranks))]
    Indivisible {
        /// The parameter name, or a description of the tensor.
        what: String,
        dim: usize,
        size: usize,
        blocks: usize,
        ranks: usize,
    },
    /// A count (heads, vocabulary, features) that does not divide as a layer needs.
    #[error("{layer}: {what} ({count}) is not divisible by {by} ({why})")]
    NotDivisible {
        layer: String,
        what: &'static str,
        count: usize,
        by: usize,
        why: String,
    },
    /// A layer given a communicator that is not the tensor-parallel group it was built for.
    #[error(
        "{layer}: built for rank {expected_rank} of a tensor-parallel group of {expected} ranks, \
         but given communicator {group} where this is rank {got_rank} of {got}"
    )]
    GroupMismatch {
        layer: String,
        expected: usize,
        expected_rank: usize,
        group: String,
        got: usize,
        got_rank: usize,
    },
    /// A parameter that cannot be created: missing from the source tensors, a wrong full
    /// shape, a duplicate name.
    #[error("parameter {name}: {reason}")]
    Param { name: String, reason: String },
    /// Any other invalid argument.
    #[error("{0}")]
    Invalid(String),
}

fn split_desc(blocks: usize, ranks: usize) -> String {
    if blocks > 1 {
        format!("{blocks} blocks × {ranks} ranks")
    } else {
        format!("{ranks} ranks")
    }
}

impl From<ShardError> for candle_core::Error {
    fn from(e: ShardError) -> Self {
        // Not `Error::wrap`, which captures a backtrace when RUST_BACKTRACE is set: the
        // message already names the parameter or layer.
        candle_core::Error::Wrapped(Box::new(e))
    }
}

/// Shorthand for an [`ShardError::Invalid`] converted to a candle error.
pub(crate) fn invalid(msg: impl Into<String>) -> candle_core::Error {
    ShardError::Invalid(msg.into()).into()
}
