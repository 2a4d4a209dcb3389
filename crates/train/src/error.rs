//! The trainer's one error type.
//!
//! Every variant's `Display` is the whole message, as the command line prints it
//! (`context: cause`); wrapped errors of the other crates are shown as they are
//! (`transparent`). Nothing here is a `String` error or an `anyhow::Error`: a caller can
//! match on what went wrong, and a binary can still wrap it in `anyhow`.

use std::fmt::Display;

use switchyard_comm::local::LaunchError;
use switchyard_comm::CommError;
use switchyard_models::ModelError;
use switchyard_schedule::ScheduleError;

/// What went wrong in the trainer.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TrainError {
    /// A configuration or layout the trainer cannot run, found before any work starts.
    #[error("{0}")]
    Config(String),
    /// Data that cannot be read or used: missing, too short, a token id beyond the
    /// vocabulary (naming its offset).
    #[error("{0}")]
    Data(String),
    /// A checkpoint or checkpoint directory that cannot be written, read or resumed.
    #[error("{0}")]
    Checkpoint(String),
    /// A weights file (an export, `--init`) that cannot be read, written or used.
    #[error("{0}")]
    Weights(String),
    /// `--init` weights of another model than the run builds.
    #[error("{path} holds a model {have}, but this run builds {want}: build the same model")]
    ModelMismatch {
        path: String,
        /// The weights' model (its config, debug-printed).
        have: String,
        /// The run's model.
        want: String,
    },
    /// Two runs that should agree do not (the `testing` module's parity checks).
    #[error("{0}")]
    Parity(String),
    /// A loss or gradient that is not finite; every rank stops at the same step, and the
    /// rank where it first appeared says so.
    #[error("step {step}: non-finite values first appeared on rank {rank} (pp {pp}, dp {dp}, tp {tp}): {detail}")]
    NonFinite {
        step: usize,
        rank: usize,
        pp: usize,
        dp: usize,
        tp: usize,
        detail: String,
    },
    /// A file-system operation, and what it was for.
    #[error("{what}: {error}")]
    Io { what: String, error: std::io::Error },
    /// Another error, and what the trainer was doing when it happened.
    #[error("{context}: {inner}")]
    Context {
        context: String,
        inner: Box<TrainError>,
    },
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Launch(#[from] LaunchError),
    #[error(transparent)]
    Schedule(#[from] ScheduleError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error(transparent)]
    Json(#[from] serde_json::Error),
}

/// The trainer's result.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

/// An error the trainer can put in context: its own, the other crates', and I/O (which
/// becomes [`TrainError::Io`] with the context as what it was for).
pub trait IntoTrainError {
    fn into_train_error(self, context: String) -> TrainError;
}

impl IntoTrainError for std::io::Error {
    fn into_train_error(self, what: String) -> TrainError {
        TrainError::Io { what, error: self }
    }
}

macro_rules! into_context {
    ($($t:ty),*) => {$(
        impl IntoTrainError for $t {
            fn into_train_error(self, context: String) -> TrainError {
                TrainError::Context { context, inner: Box::new(self.into()) }
            }
        }
    )*};
}
into_context!(
    TrainError,
    ModelError,
    CommError,
    LaunchError,
    ScheduleError,
    candle_core::Error,
    serde_json::Error
);

/// `anyhow`-style context on the trainer's results.
pub trait Context<T> {
    /// Says what was being done when the error happened.
    fn context(self, context: impl Display) -> Result<T>;
    /// [`Context::context`], computed only on error.
    fn with_context<C: Display, F: FnOnce() -> C>(self, f: F) -> Result<T>;
}

impl<T, E: IntoTrainError> Context<T> for std::result::Result<T, E> {
    fn context(self, context: impl Display) -> Result<T> {
        self.map_err(|e| e.into_train_error(context.to_string()))
    }
    fn with_context<C: Display, F: FnOnce() -> C>(self, f: F) -> Result<T> {
        self.map_err(|e| e.into_train_error(f().to_string()))
    }
}

/// Returns early with a [`TrainError`] of the given kind and a formatted message:
/// `fail!(Checkpoint, "{} is not a checkpoint", path.display())`.
macro_rules! fail {
    ($kind:ident, $($fmt:tt)*) => {
        return Err($crate::error::TrainError::$kind(format!($($fmt)*)).into())
    };
}

/// A [`TrainError`] of the given kind with a formatted message.
macro_rules! err {
    ($kind:ident, $($fmt:tt)*) => {
        $crate::error::TrainError::$kind(format!($($fmt)*))
    };
}

pub(crate) use {err, fail};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_read_as_context_then_cause() {
        let io = std::fs::read("/nonexistent/switchyard")
            .context("cannot read /nonexistent/switchyard")
            .unwrap_err();
        assert!(matches!(io, TrainError::Io { .. }));
        assert!(io
            .to_string()
            .starts_with("cannot read /nonexistent/switchyard: No such file"));
        let nested: Result<()> = Err(err!(Data, "token 300 at offset 7"));
        let e = nested.context("--data x.bin").unwrap_err();
        assert_eq!(e.to_string(), "--data x.bin: token 300 at offset 7");
        let e = TrainError::from(ModelError::Layout("--tp 3 does not divide 4".into()));
        assert_eq!(e.to_string(), "--tp 3 does not divide 4");
    }

    #[test]
    fn fail_returns_the_kind_asked_for() {
        fn f() -> Result<()> {
            fail!(Checkpoint, "{} is not a checkpoint", "dir");
        }
        assert!(matches!(f(), Err(TrainError::Checkpoint(m)) if m == "dir is not a checkpoint"));
    }
}
