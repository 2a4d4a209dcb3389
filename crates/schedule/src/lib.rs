//! Pipeline schedules as plain data.
//!
//! A schedule is a [`Program`]: for every rank, the ordered list of
//! [`Action`]s it performs in one training step — `1F3` (stage 1 forward of
//! microbatch 3), `0B2` (backward), `2I0`/`2W0` (the input- and
//! weight-gradient halves of a split backward) and, once
//! [lowered](lower), the messages between ranks (`1SF3` sends stage 1's
//! activation of microbatch 3 to stage 2, which receives it with `2RF3`;
//! `2SB3`/`1RB3` carry the gradient back). The executor elsewhere in
//! switchyard runs whatever program it is given, rank by rank, in order; it
//! knows nothing about GPipe or 1F1B. Everything about a schedule therefore
//! lives here, where it can be generated, checked and looked at without a
//! GPU:
//!
//! * [`generate`] builds GPipe, 1F1B, interleaved 1F1B, ZB-H1 and ZB-H2 programs;
//!   [`Program::load_csv`] reads a hand-written one, and a [`ScheduleChoice`]
//!   names either (`1f1b`, or `mine.csv`) as a trainer's setting;
//! * [`lower`] inserts sends and receives, ordered so that the program
//!   cannot deadlock even if every send blocks until its receive is posted;
//! * [`validate`] checks completeness, ordering and message matching, and
//!   runs a rendezvous simulation that names every stuck rank and action if
//!   the program deadlocks;
//! * [`simulate`] times a program under [`Costs`] and reports the makespan,
//!   the bubble and each rank's peak number of stashed activations;
//! * [`render_text`], [`render_svg`] and [`to_json`] show the result, and
//!   [`report`] bundles it all for a CLI.
//!
//! Architecture invariant: this crate is pure data and arithmetic — no
//! candle, no threads, no rayon. Keep it that way, so that a schedule can be
//! tested exhaustively in milliseconds and its bugs never need a device.
//!
//! ```
//! use switchyard_schedule::{generate, lower, render_text, simulate, validate, Costs, ScheduleKind};
//!
//! let program = generate(ScheduleKind::OneFOneB, 2, 3)?;
//! assert_eq!(program.to_string(), "rank 0: 0F0 0F1 0B0 0F2 0B1 0B2\nrank 1: 1F0 1B0 1F1 1B1 1F2 1B2\n");
//!
//! let lowered = lower(&program)?;
//! validate(&lowered)?;
//! let timeline = simulate(&lowered, &Costs::default())?;
//! assert_eq!(timeline.makespan, 12.0); // 3 (m + p - 1) with F=1, B=2
//! assert!((timeline.bubble_fraction - 1.0 / 4.0).abs() < 1e-12); // (p-1)/(m+p-1)
//! assert_eq!(timeline.peak_activations(), vec![2, 1]); // min(p - r, m)
//! print!("{}", render_text(&timeline));
//! # Ok::<(), switchyard_schedule::ScheduleError>(())
//! ```
//!
//! ## Tutorials and reference
//!
//! * [Chapter 2, "Pipeline parallelism"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/02-pipeline-parallelism.md):
//!   the four schedules side by side, with their bubbles and activations (example
//!   `pipeline`).
//! * [Chapter 6, "A custom schedule as CSV"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/06-custom-schedule.md):
//!   write, validate, simulate and run your own (example `custom_schedule`).
//! * [Pipeline schedules](https://github.com/switchyard-rs/switchyard/blob/main/docs/schedules.md): every formula, how activations are
//!   counted, how lowering orders the messages, the CSV format.

#![warn(missing_docs)]

mod action;
mod choice;
mod csv;
mod engine;
mod error;
mod generate;
mod lower;
mod program;
mod render;
mod report;
mod simulate;
mod validate;

pub use action::{tag, Action, Op};
pub use choice::ScheduleChoice;
pub use error::{Result, ScheduleError, Stuck};
pub use generate::{generate, gpipe, interleaved, one_f_one_b, zb_h1, zb_h2, ScheduleKind};
pub use lower::{lower, lower_with_costs};
pub use program::Program;
pub use render::{
    render_svg, render_svg_titled, render_svg_with, render_text, to_json, SvgOptions,
};
pub use report::{report, Format};
pub use simulate::{
    peak_activations, simulate, simulate_by_stage, Costs, RankTimeline, TimedAction, Timeline,
};
pub use validate::validate;
