//! [`report`]: what a `switchyard schedule` command prints.

use std::fmt;
use std::str::FromStr;

use crate::error::{Result, ScheduleError};
use crate::program::Program;
use crate::render::{render_svg_titled, render_text, to_json};
use crate::simulate::{simulate, Costs};

/// Output format of [`report`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Format {
    /// [`render_text`]: the terminal grid and summary.
    #[default]
    Text,
    /// [`to_json`](crate::to_json), pretty-printed.
    Json,
    /// [`render_svg`](crate::render_svg).
    Svg,
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Text => "text",
            Format::Json => "json",
            Format::Svg => "svg",
        })
    }
}

impl FromStr for Format {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "text" | "txt" => Ok(Format::Text),
            "json" => Ok(Format::Json),
            "svg" => Ok(Format::Svg),
            _ => Err(ScheduleError::Parse(format!(
                "unknown format {s:?}: expected text, json or svg"
            ))),
        }
    }
}

/// Validates and simulates `program` under `costs` and renders the result.
/// The program is simulated as given: [`lower`](crate::lower) it first to
/// see (and cost) the messages.
///
/// A CLI needs only this:
///
/// ```
/// use switchyard_schedule::{generate, report, Costs, Format, ScheduleKind};
/// let kind = ScheduleKind::from_name("interleaved", Some(2)).unwrap();
/// let program = generate(kind, 4, 8).unwrap();   // or Program::load_csv(path)
/// let costs: Costs = "F=1,B=2,comm=0".parse().unwrap();
/// let text = report(&program, &costs, "text".parse::<Format>().unwrap()).unwrap();
/// assert!(text.contains("makespan"));
/// ```
pub fn report(program: &Program, costs: &Costs, format: Format) -> Result<String> {
    let tl = simulate(program, costs)?;
    Ok(match format {
        Format::Text => render_text(&tl),
        Format::Json => {
            let mut s =
                serde_json::to_string_pretty(&to_json(&tl)).expect("a JSON value always prints");
            s.push('\n');
            s
        }
        Format::Svg => render_svg_titled(
            &tl,
            &format!(
                "{} ranks, {} stages, {} microbatches",
                program.num_ranks(),
                program.num_stages,
                program.num_microbatches
            ),
        ),
    })
}
