//! `switchyard bench`: the reference workload on one worker and on every parallel layout,
//! as a table (see `switchyard::bench` and `docs/PERFORMANCE.md`).
//!
//! Each row runs in a fresh child process (this same binary with `--row`), so that every
//! layout starts from a clean allocator and its peak memory is its own; `--in-process`
//! runs them all here instead.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{anyhow, bail, Context};
use clap::Args;
use switchyard::bench::{calibrate, cases, fma_peak_gflops, run_case, Preset, Report, Row};

#[derive(Args)]
pub struct BenchArgs {
    /// reference (the GPT: d 256, 8 layers, T 128, 32 sequences), small or tiny
    #[arg(long, default_value = "reference")]
    preset: String,
    /// Timed steps per row (median reported); default from the preset
    #[arg(long)]
    steps: Option<usize>,
    /// Untimed steps first; default from the preset
    #[arg(long)]
    warmup: Option<usize>,
    /// Microbatches of the pipeline rows; default 8
    #[arg(long)]
    microbatches: Option<usize>,
    /// Only the rows whose name contains one of these (comma-separated), e.g. "1 worker,1f1b"
    #[arg(long)]
    only: Option<String>,
    /// Run the rows this many times, round-robin, and keep each row's fastest run (on a
    /// machine shared with other work, contention only ever slows a run down)
    #[arg(long, default_value_t = 1)]
    repeat: usize,
    /// Write the table as JSON here
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run every row in this process instead of one child process per row
    #[arg(long)]
    in_process: bool,
    /// Run one row and print it as JSON (used by the parent process)
    #[arg(long, hide = true)]
    row: Option<String>,
}

fn preset(a: &BenchArgs) -> anyhow::Result<Preset> {
    let mut p = Preset::named(&a.preset).map_err(anyhow::Error::msg)?;
    if let Some(s) = a.steps {
        p.steps = s;
    }
    if let Some(w) = a.warmup {
        p.warmup = w;
    }
    if let Some(m) = a.microbatches {
        p.microbatches = m;
    }
    p.check().map_err(anyhow::Error::msg)?;
    if a.repeat == 0 {
        bail!("--repeat must be at least 1: it is how many times each row runs");
    }
    Ok(p)
}

/// Runs row `name` in a child process and reads its JSON.
fn run_child(a: &BenchArgs, p: &Preset, name: &str, threads: usize) -> anyhow::Result<Row> {
    // The running binary; if a rebuild replaced it meanwhile, the one at its path.
    let exe = std::env::current_exe()
        .ok()
        .filter(|p| p.exists())
        .or_else(|| std::env::args_os().next().map(PathBuf::from))
        .ok_or_else(|| anyhow!("cannot find the switchyard binary"))?;
    let out = Command::new(exe)
        .args(["bench", "--preset", &a.preset, "--row", name])
        .args(["--steps", &p.steps.to_string()])
        .args(["--warmup", &p.warmup.to_string()])
        .args(["--microbatches", &p.microbatches.to_string()])
        .env("RAYON_NUM_THREADS", threads.to_string())
        // Read by mimalloc when the process starts: only then does it also cover the
        // memory mimalloc maps before `main` (the option set at run time does not).
        .env(switchyard::KEEP_FREED_MEMORY_ENV, "-1")
        .output()
        .context("cannot start a benchmark child process")?;
    if !out.status.success() {
        bail!(
            "row {name} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .ok_or_else(|| anyhow!("row {name} printed no result"))?;
    serde_json::from_str(line).with_context(|| format!("row {name}: unreadable result"))
}

pub fn run(a: BenchArgs) -> anyhow::Result<()> {
    let p = preset(&a)?;
    let all = cases(&p);
    if let Some(name) = &a.row {
        let Some(c) = all.iter().find(|c| &c.name == name) else {
            bail!("no row named {name}");
        };
        super::set_gemm_threads(c.threads_per_worker);
        println!("{}", serde_json::to_string(&run_case(&p, c)?)?);
        return Ok(());
    }
    let wanted: Vec<String> = match &a.only {
        Some(s) => s.split(',').map(|x| x.trim().to_string()).collect(),
        None => vec![],
    };
    let selected: Vec<_> = all
        .iter()
        .enumerate()
        .filter(|(i, c)| *i == 0 || wanted.is_empty() || wanted.iter().any(|w| c.name.contains(w)))
        .map(|(_, c)| c)
        .collect();
    let peak = fma_peak_gflops();
    eprintln!(
        "switchyard bench: preset {}, {} rows, peak {peak:.0} GFLOP/s per core",
        p.name,
        selected.len()
    );
    // Before any row, on a quiet machine: the rates the predictions divide by.
    let t0 = std::time::Instant::now();
    let models = calibrate(&selected)?;
    for (compute, tm) in &models {
        let curves: Vec<String> = tm
            .curves
            .iter()
            .map(|c| {
                let e = c.thread_efficiency.last().map_or(0.0, |e| 100.0 * e);
                format!(
                    "d {}: {:.0} µs + {:.1} GFLOP/s, +{e:.0}%",
                    c.width,
                    1e6 * c.overhead(),
                    c.rate() / 1e9
                )
            })
            .collect();
        eprintln!(
            "  time model ({}, calibrated): a part per thread {}; second thread at the largest \
             size; p2p {:.1} µs + {:.1} GB/s, all-reduce {:.1} µs + {:.1} GB/s; a step {:.0} µs \
             + {:.0} µs with several workers",
            switchyard::bench::compute_name(*compute),
            curves.join(", "),
            tm.p2p.alpha_s * 1e6,
            tm.p2p.bytes_per_s / 1e9,
            tm.collective.alpha_s * 1e6,
            tm.collective.bytes_per_s / 1e9,
            tm.step_overhead_s * 1e6,
            tm.world_overhead_s * 1e6,
        );
    }
    eprintln!("  calibration took {:.1} s", t0.elapsed().as_secs_f64());
    let mut rows: Vec<Option<Row>> = vec![None; selected.len()];
    for round in 0..a.repeat {
        for (slot, c) in rows.iter_mut().zip(&selected) {
            let row = match a.in_process {
                true => run_case(&p, c)?,
                false => run_child(&a, &p, &c.name, c.threads_per_worker)?,
            };
            eprintln!(
                "  {:<22} {:>8.0} tokens/s  ({:.2} s a step){}",
                c.name,
                row.tokens_per_s,
                row.step_s,
                if a.repeat > 1 {
                    format!(", round {}", round + 1)
                } else {
                    String::new()
                }
            );
            if slot
                .as_ref()
                .is_none_or(|best| row.tokens_per_s > best.tokens_per_s)
            {
                *slot = Some(row);
            }
        }
    }
    let rows: Vec<Row> = rows.into_iter().flatten().collect();
    let mut report = Report::new(p, peak, rows);
    report.predict(&models)?;
    print!("{}", report.render());
    if let Some(path) = &a.json {
        std::fs::write(path, serde_json::to_vec_pretty(&report)?)
            .with_context(|| format!("cannot write {}", path.display()))?;
        println!("json: {}", path.display());
    }
    Ok(())
}
