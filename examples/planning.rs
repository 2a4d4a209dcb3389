//! Chapter 10, "Planning a run" (`docs/tutorial/10-planning-a-run.md`): predict memory
//! before a run, pick a layout that fits a budget, train it, and compare the measured
//! peak with the prediction.
//!
//! ```text
//! cargo run --release --example planning
//! ```

use anyhow::{ensure, Context};
use switchyard::models::GptConfig;
use switchyard::train::data::Corpus;
use switchyard::train::estimate::memory::estimate_memory;
use switchyard::train::estimate::plan::{plan, Verdict};
use switchyard::train::{train, TrainConfig, TrainOptions};

// Measured memory needs the counting allocator (the `switchyard` binary's).
#[global_allocator]
static ALLOC: switchyard::Allocator = switchyard::ALLOCATOR;

fn main() -> anyhow::Result<()> {
    let base = TrainConfig {
        model: GptConfig {
            n_layer: 4,
            d_model: 128,
            n_head: 4,
            block_size: 64,
            ..GptConfig::default()
        },
        seq_len: 64,
        batch: 16,
        steps: 2,
        threads_per_worker: 1,
        ..TrainConfig::default()
    };

    // 1. Every layout of 4 workers, by predicted memory (no time model here: `switchyard
    //    plan --calibrate` adds step times). The budget: the middle of the range.
    let all = plan(&base, 4, None, &|_| None);
    let peaks: Vec<u64> = all
        .iter()
        .filter(|c| c.verdict == Verdict::Fits)
        .map(|c| c.peak_bytes())
        .collect();
    let budget = (peaks[0] + peaks[peaks.len() - 1]) / 2;
    let ranked = plan(&base, 4, Some(budget), &|_| None);
    let fitting = ranked.iter().filter(|c| c.verdict == Verdict::Fits).count();
    println!(
        "{} layouts of 4 workers, {fitting} fit {:.1} MiB per worker:",
        ranked.len(),
        budget as f64 / 1048576.0
    );
    for c in ranked.iter().take(5) {
        println!(
            "  {:<30} {:>8.1} MiB ({})",
            c.layout.to_string(),
            c.peak_bytes() as f64 / 1048576.0,
            c.dominant().map(|d| d.name()).unwrap_or("-")
        );
    }

    // 2. Train the layout that needs the most memory among those that fit (the
    //    largest microbatches: usually the fastest), and compare.
    let chosen = ranked
        .iter()
        .filter(|c| c.verdict == Verdict::Fits)
        .max_by_key(|c| c.peak_bytes())
        .context("a layout fits")?;
    let cfg = chosen.layout.apply(&base);
    let predicted = estimate_memory(&cfg)?;
    let report = train(&cfg, &Corpus::bundled(), &TrainOptions::default())?;
    println!("trained {}:", chosen.layout);
    for m in &report.memory {
        let p = predicted[m.coords.pp].peak_bytes;
        let err = (p as f64 - m.peak_bytes as f64) / m.peak_bytes as f64;
        println!(
            "  rank {}: measured {:.2} MiB, predicted {:.2} MiB ({:+.1} %)",
            m.rank,
            m.peak_bytes as f64 / 1048576.0,
            p as f64 / 1048576.0,
            100.0 * err
        );
        ensure!(
            m.peak_bytes as u64 <= budget + budget / 10,
            "rank {} measured over the budget",
            m.rank
        );
    }
    Ok(())
}
