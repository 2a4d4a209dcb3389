//! The errors of this crate. They are returned as [`candle_core::Error`] (wrapped), so
//! they travel through `?` in stage and training code next to candle's own errors; each
//! message names the rank and the action (`1B3`) that failed.

use switchyard_schedule::{Action, Op, ScheduleError};

/// Everything the executor refuses: a program that does not validate, stages that do not
/// match the program, and a program whose actions come in an order it cannot run.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PipelineError {
    /// The program did not lower or validate. The validator's error is kept in the
    /// message, not as a source, so that a chain printed with `{:#}` names it once.
    #[error("invalid pipeline program: {0}")]
    InvalidProgram(ScheduleError),
    /// The pipeline communicator's size is not the program's rank count.
    #[error("the program has {program} ranks but the pipeline group has {group}")]
    RankCount {
        /// Ranks of the program.
        program: usize,
        /// Ranks of the pipeline communicator.
        group: usize,
    },
    /// The stages given to the executor are not those the program puts on this rank.
    #[error("rank {rank} runs stages {want:?} of the program but was given stages {have:?}")]
    StageSetMismatch {
        rank: u32,
        /// The stages of this rank in the program.
        want: Vec<u32>,
        /// The stages given.
        have: Vec<u32>,
    },
    /// An action names a stage that does not run on this rank.
    #[error("rank {rank}: stage {stage} does not run on this rank")]
    StageNotOnRank { rank: u32, stage: u32 },
    /// A send or receive whose peer stage does not exist.
    #[error("rank {rank}: {action} has no peer stage")]
    NoPeer { rank: u32, action: Action },
    /// A first-stage forward of a microbatch beyond the inputs given.
    #[error("rank {rank}: {action} needs input microbatch {}, but only {given} were given", .action.microbatch)]
    MissingMicrobatch {
        rank: u32,
        action: Action,
        /// How many input microbatches were given.
        given: usize,
    },
    /// A forward whose input activation has not been received or computed.
    #[error(
        "rank {rank}: {action} has no input activation (no {}RF{} before it, and stage {} is not on this rank)",
        .action.stage, .action.microbatch, .action.stage - 1
    )]
    MissingInput { rank: u32, action: Action },
    /// A backward (`B` or `I`) before the forward of its stage and microbatch.
    #[error("rank {rank}: {action} runs before the forward {}F{}", .action.stage, .action.microbatch)]
    BackwardBeforeForward { rank: u32, action: Action },
    /// A backward whose output gradient has not been received or computed.
    #[error(
        "rank {rank}: {action} has no output gradient (no {}RB{} before it, and stage {} is not on this rank)",
        .action.stage, .action.microbatch, .action.stage + 1
    )]
    MissingGradient { rank: u32, action: Action },
    /// A backward of a stage whose output does not depend on its input, so there is no
    /// input gradient to pass on.
    #[error("rank {rank}: {action}: the stage output does not depend on its input")]
    InputUnused { rank: u32, action: Action },
    /// A weight-gradient half `W` before its input-gradient half `I`.
    #[error(
        "rank {rank}: {action} runs before its input-gradient half {}I{}",
        .action.stage, .action.microbatch
    )]
    WeightBeforeInput { rank: u32, action: Action },
    /// A send before the forward or backward that computes what it sends.
    #[error(
        "rank {rank}: {action} has nothing to send (its {} has not run)",
        if .action.op == Op::SendB { "backward" } else { "forward" }
    )]
    NothingToSend { rank: u32, action: Action },
    /// The program ended with forwards never backed up, `I`s without their `W`, or
    /// outputs never sent.
    #[error("rank {rank}: the program left work unfinished: {}", .left.join(", "))]
    Unfinished {
        rank: u32,
        /// What was left, sorted: `1F3 without backward`, `1I3 without 1W3`,
        /// `1SF3 never sent`.
        left: Vec<String>,
    },
}

impl From<PipelineError> for candle_core::Error {
    fn from(e: PipelineError) -> Self {
        // Not `Error::wrap`, which captures a backtrace when RUST_BACKTRACE is set: the
        // message already names the rank and the action.
        candle_core::Error::Wrapped(Box::new(e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn act(s: &str) -> Action {
        s.parse().unwrap()
    }

    #[test]
    fn display_texts() {
        let cases: Vec<(PipelineError, &str)> = vec![
            (
                PipelineError::RankCount { program: 4, group: 2 },
                "the program has 4 ranks but the pipeline group has 2",
            ),
            (
                PipelineError::StageSetMismatch { rank: 1, want: vec![1, 3], have: vec![1] },
                "rank 1 runs stages [1, 3] of the program but was given stages [1]",
            ),
            (
                PipelineError::StageNotOnRank { rank: 0, stage: 2 },
                "rank 0: stage 2 does not run on this rank",
            ),
            (
                PipelineError::NoPeer { rank: 0, action: act("0SF1") },
                "rank 0: 0SF1 has no peer stage",
            ),
            (
                PipelineError::MissingMicrobatch { rank: 0, action: act("0F5"), given: 4 },
                "rank 0: 0F5 needs input microbatch 5, but only 4 were given",
            ),
            (
                PipelineError::MissingInput { rank: 1, action: act("1F3") },
                "rank 1: 1F3 has no input activation (no 1RF3 before it, and stage 0 is not on this rank)",
            ),
            (
                PipelineError::BackwardBeforeForward { rank: 1, action: act("1B3") },
                "rank 1: 1B3 runs before the forward 1F3",
            ),
            (
                PipelineError::MissingGradient { rank: 0, action: act("0I2") },
                "rank 0: 0I2 has no output gradient (no 0RB2 before it, and stage 1 is not on this rank)",
            ),
            (
                PipelineError::InputUnused { rank: 1, action: act("1B0") },
                "rank 1: 1B0: the stage output does not depend on its input",
            ),
            (
                PipelineError::WeightBeforeInput { rank: 0, action: act("0W1") },
                "rank 0: 0W1 runs before its input-gradient half 0I1",
            ),
            (
                PipelineError::NothingToSend { rank: 0, action: act("0SF1") },
                "rank 0: 0SF1 has nothing to send (its forward has not run)",
            ),
            (
                PipelineError::NothingToSend { rank: 1, action: act("1SB1") },
                "rank 1: 1SB1 has nothing to send (its backward has not run)",
            ),
            (
                PipelineError::Unfinished {
                    rank: 0,
                    left: vec!["0F1 without backward".into(), "0SF2 never sent".into()],
                },
                "rank 0: the program left work unfinished: 0F1 without backward, 0SF2 never sent",
            ),
        ];
        for (e, want) in cases {
            assert_eq!(e.to_string(), want);
            // Wrapped into a candle error, the text is the same.
            assert_eq!(candle_core::Error::from(e).to_string(), want);
        }
    }

    #[test]
    fn invalid_program_names_the_validator_error() {
        let e = PipelineError::InvalidProgram(ScheduleError::Invalid("1B0 before 1F0".into()));
        assert_eq!(
            e.to_string(),
            "invalid pipeline program: invalid schedule: 1B0 before 1F0"
        );
        // Not a source: `{:#}` of a chain names the validator's error once.
        assert!(std::error::Error::source(&e).is_none());
    }
}
