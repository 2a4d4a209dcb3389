//! `switchyard schedule`: see a pipeline schedule before spending a cluster on it.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use switchyard_pipeline::{run_synthetic, SyntheticMode, SyntheticRun};
use switchyard_schedule::{
    generate, lower, lower_with_costs, report, Costs, Format, Program, ScheduleKind,
};
use switchyard_train::MAX_SCHEDULE_PAIRS;

#[derive(Args)]
pub struct ScheduleArgs {
    /// gpipe, 1f1b, interleaved, zb-h1 or zb-h2
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
    /// Show the sends and receives between stages too, placed for the --costs
    /// (`switchyard train` plans with F=1,B=2,I=1.25,W=0.75)
    #[arg(long)]
    lowered: bool,
    /// Run the (lowered) program with the real executor on threads, one per rank, with
    /// synthetic stages whose actions take the --costs, and print the measured makespan
    /// and bubble next to the simulator's: `sleep` (the default) sleeps cost × --unit-ms,
    /// `virtual` runs a logical clock and must match the simulator exactly
    #[arg(long, num_args = 0..=1, default_missing_value = "sleep", value_name = "sleep|virtual")]
    execute: Option<String>,
    /// With --execute sleep: the wall time of one cost unit, in milliseconds
    #[arg(long, default_value_t = 2.0)]
    unit_ms: f64,
}

/// The most ranks (threads) `--execute` starts.
const MAX_EXECUTE_RANKS: usize = 256;
/// The most forwards (stages × microbatches) `--execute` runs.
const MAX_EXECUTE_PAIRS: usize = 1 << 16;

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
    // Planned with the given costs (where each receive waits depends on them: `switchyard
    // train` lowers with F=1,B=2,I=1.25,W=0.75); a zero cost plans with the defaults.
    let program = if a.lowered && !program.is_lowered() && program.num_ranks() > 1 {
        match [costs.f, costs.b, costs.i, costs.w].contains(&0.0) {
            true => lower(&program)?,
            false => lower_with_costs(&program, &costs)?,
        }
    } else {
        program
    };
    let text = match &a.execute {
        Some(mode) => {
            if format != Format::Text {
                anyhow::bail!("--execute prints a text table: leave out --format {format}");
            }
            execute(&program, &costs, mode, a.unit_ms)?
        }
        None => report(&program, &costs, format)?,
    };
    match &a.out {
        Some(path) => std::fs::write(path, text)
            .with_context(|| format!("cannot write {}", path.display()))?,
        None => print!("{text}"),
    }
    Ok(())
}

/// `--execute`: runs `program` with synthetic stages and compares it with the simulator.
fn execute(program: &Program, costs: &Costs, mode: &str, unit_ms: f64) -> anyhow::Result<String> {
    let mode = match mode.trim().to_ascii_lowercase().as_str() {
        "sleep" => {
            if !(unit_ms.is_finite() && unit_ms > 0.0 && unit_ms <= 60_000.0) {
                anyhow::bail!("--unit-ms {unit_ms}: give a time above 0 ms (at most a minute)");
            }
            SyntheticMode::Sleep {
                unit: Duration::from_secs_f64(unit_ms / 1e3),
            }
        }
        "virtual" => SyntheticMode::Virtual,
        other => anyhow::bail!("--execute {other:?}: expected sleep or virtual"),
    };
    let ranks = program.num_ranks();
    let pairs = (program.num_stages as usize).saturating_mul(program.num_microbatches as usize);
    if ranks > MAX_EXECUTE_RANKS || pairs > MAX_EXECUTE_PAIRS {
        anyhow::bail!(
            "--execute runs one thread per rank: {ranks} ranks and {pairs} forwards (stages × \
             microbatches) is more than {MAX_EXECUTE_RANKS} ranks or {MAX_EXECUTE_PAIRS} \
             forwards; use fewer stages or microbatches"
        );
    }
    let run = run_synthetic(program, &[*costs], mode)?;
    Ok(render_execution(&run, mode))
}

/// The measured timeline next to the simulated one, with their ratio.
fn render_execution(run: &SyntheticRun, mode: SyntheticMode) -> String {
    let (sim, got) = (&run.simulated, &run.measured);
    let ratio = |m: f64, s: f64| match s > 0.0 {
        true => format!("{:.3}", m / s),
        false => "-".to_string(),
    };
    let mut t = String::new();
    let how = match mode {
        SyntheticMode::Virtual => "virtual clock (exact)".to_string(),
        SyntheticMode::Sleep { unit } => {
            format!("sleeping, 1 unit = {} ms", unit.as_secs_f64() * 1e3)
        }
    };
    let _ = writeln!(
        t,
        "executed with synthetic stages on {} thread{} (one per rank), {how}: {} stages, {} \
         microbatches, costs {}",
        sim.num_ranks(),
        if sim.num_ranks() == 1 { "" } else { "s" },
        sim.num_stages,
        sim.num_microbatches,
        sim.costs
    );
    let _ = writeln!(
        t,
        "{:<10} {:>12} {:>12} {:>8}",
        "", "simulated", "measured", "ratio"
    );
    let _ = writeln!(
        t,
        "{:<10} {:>12.3} {:>12.3} {:>8}",
        "makespan",
        sim.makespan,
        got.makespan,
        ratio(got.makespan, sim.makespan)
    );
    let _ = writeln!(
        t,
        "{:<10} {:>11.1}% {:>11.1}% {:>8}",
        "bubble",
        100.0 * sim.bubble_fraction,
        100.0 * got.bubble_fraction,
        ratio(got.bubble_fraction, sim.bubble_fraction)
    );
    let _ = writeln!(
        t,
        "\n{:<5} {:>10} {:>10} {:>7} {:>10} {:>10} {:>7}",
        "rank", "end sim", "end meas", "ratio", "bubble sim", "bubble meas", "ratio"
    );
    let end = |r: &switchyard_schedule::RankTimeline| r.actions.last().map_or(0.0, |a| a.end);
    for (s, m) in sim.ranks.iter().zip(&got.ranks) {
        let _ = writeln!(
            t,
            "{:<5} {:>10.3} {:>10.3} {:>7} {:>9.1}% {:>10.1}% {:>7}",
            s.rank,
            end(s),
            end(m),
            ratio(end(m), end(s)),
            100.0 * s.bubble_fraction,
            100.0 * m.bubble_fraction,
            ratio(m.bubble_fraction, s.bubble_fraction)
        );
    }
    let _ = writeln!(
        t,
        "\ntimes in cost units; the bubble is idle time over the makespan, messages excluded"
    );
    t
}
