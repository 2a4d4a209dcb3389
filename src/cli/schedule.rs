//! `switchyard schedule`: see a pipeline schedule before spending a cluster on it.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use switchyard_schedule::{generate, lower, report, Costs, Format, Program, ScheduleKind};
use switchyard_train::MAX_SCHEDULE_PAIRS;

#[derive(Args)]
pub struct ScheduleArgs {
    /// gpipe, 1f1b, interleaved or zb-h1
    #[arg(long, default_value = "1f1b")]
    kind: String,
    /// Pipeline ranks
    #[arg(long, default_value_t = 4)]
    stages: usize,
    #[arg(long, default_value_t = 8)]
    microbatches: usize,
    /// Model chunks per rank (interleaved)
    #[arg(long)]
    virtual_stages: Option<usize>,
    /// Per-op costs, e.g. F=1,B=2,I=1,W=1,comm=0
    #[arg(long, default_value = "F=1,B=2,I=1,W=1,comm=0")]
    costs: String,
    /// text, json or svg
    #[arg(long, default_value = "text")]
    format: String,
    /// Write here instead of standard output
    #[arg(long)]
    out: Option<PathBuf>,
    /// Validate and simulate a custom schedule (one row per rank: `0,0F0,0F1,0B0,0B1`)
    #[arg(long)]
    from_csv: Option<PathBuf>,
    /// Show the sends and receives between stages too
    #[arg(long)]
    lowered: bool,
}

pub fn run(a: ScheduleArgs) -> anyhow::Result<()> {
    let costs: Costs = a.costs.parse()?;
    let format: Format = a.format.parse()?;
    let program = match &a.from_csv {
        Some(path) => Program::load_csv(path)?,
        None => {
            let kind = ScheduleKind::from_name(&a.kind, a.virtual_stages)?;
            let v = match kind {
                ScheduleKind::Interleaved { virtual_stages } => virtual_stages,
                _ => 1,
            };
            let pairs = a.stages.saturating_mul(v).saturating_mul(a.microbatches);
            if pairs > MAX_SCHEDULE_PAIRS {
                anyhow::bail!(
                    "--stages {} × --microbatches {} (× {v} virtual stages) is more than \
                     {MAX_SCHEDULE_PAIRS} forwards, a schedule too large to build and draw: \
                     use fewer stages or microbatches",
                    a.stages,
                    a.microbatches
                );
            }
            generate(kind, a.stages, a.microbatches)?
        }
    };
    let program = if a.lowered && !program.is_lowered() && program.num_ranks() > 1 {
        lower(&program)?
    } else {
        program
    };
    let text = report(&program, &costs, format)?;
    match &a.out {
        Some(path) => std::fs::write(path, text)
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => print!("{text}"),
    }
    Ok(())
}
