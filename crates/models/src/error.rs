//! The errors of this crate. Model code returns them as [`candle_core::Error`] (wrapped),
//! so they travel through `?`; configs and splits return them as they are. Every message
//! says what to change.

/// Everything that can be wrong with a model's config, its weights, its stage split or
/// its input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A config that cannot build a model: a zero dimension, a parameter count that
    /// overflows, heads that do not divide the width.
    #[error("{0}")]
    Config(String),
    /// A state dict whose tensors do not describe a model of this kind.
    #[error("{0}")]
    Weights(String),
    /// A layout the model cannot run: a tensor-parallel degree that does not divide
    /// what must be divided, a sequence longer than the model's context.
    #[error("{0}")]
    Layout(String),
    /// A split that does not parse.
    #[error("bad split {0:?}: use `even`, `balanced` or layer counts such as `3,2`")]
    BadSplit(String),
    /// A pipeline of no stages.
    #[error("a pipeline needs at least one stage")]
    NoStages,
    /// More stages than layers: some stage would be empty.
    #[error(
        "the pipeline has {stages} stages but the model has only {layers} layers: \
         every stage needs at least one layer, so use at most {layers} stages \
         (pipeline ranks × virtual stages) or more layers"
    )]
    TooManyStages { stages: usize, layers: usize },
    /// Explicit counts that would drop or duplicate a layer, leave a stage empty, or
    /// give another number of stages than the pipeline has.
    #[error("{0}")]
    Split(String),
    /// An input a stage cannot take (wrong dtype or rank).
    #[error("{0}")]
    Input(String),
    /// A parameter a model needs and was not given.
    #[error("{model}: missing parameter {name}")]
    MissingParam { model: &'static str, name: String },
}

impl From<ModelError> for candle_core::Error {
    fn from(e: ModelError) -> Self {
        // Not `Error::wrap`, which captures a backtrace when RUST_BACKTRACE is set: the
        // message already says what is wrong.
        candle_core::Error::Wrapped(Box::new(e))
    }
}
