//! Chapter 1, "Quickstart" (`docs/tutorial/01-quickstart.md`): `switchyard train` as a
//! library call.
//!
//! Trains a tiny GPT with pipeline × tensor parallelism (pp 2 × tp 2, four threads) on
//! the bundled text, prints the same report as the command, and writes the metrics (JSON
//! lines) and the Chrome trace that opens in <https://ui.perfetto.dev>.
//!
//! ```text
//! cargo run --release --example quickstart            # 30 steps
//! cargo run --release --example quickstart -- 300     # more steps
//! ```

use std::path::PathBuf;

use anyhow::{ensure, Context};
use switchyard::models::GptConfig;
use switchyard::train::data::Corpus;
use switchyard::train::{train, TrainConfig, TrainOptions};

fn main() -> anyhow::Result<()> {
    let steps: usize = match std::env::args().nth(1) {
        Some(s) => s
            .parse()
            .context("the only argument is the number of steps")?,
        None => 30,
    };

    // The defaults are the README's run (pp 2 × tp 2, 1F1B, 4 microbatches); only the
    // model and the batch are made smaller so that this finishes in seconds.
    let cfg = TrainConfig {
        model: GptConfig {
            n_layer: 2,
            d_model: 32,
            block_size: 32,
            ..GptConfig::default()
        },
        seq_len: 32,
        batch: 8,
        steps,
        warmup: 5,
        threads_per_worker: 1,
        ..TrainConfig::default()
    };
    let out = out_dir("quickstart")?;
    let opts = TrainOptions {
        metrics: Some(out.join("metrics.jsonl")),
        trace: Some(out.join("trace.json")),
        progress: false,
        ..TrainOptions::default()
    };

    let report = train(&cfg, &Corpus::bundled(), &opts)?;
    print!("{}", report.render(&cfg));

    // What the report says, checked.
    let first = report.steps[0].loss;
    ensure!(
        (first - 256f64.ln()).abs() < 0.1,
        "an untrained byte model starts near ln 256 = 5.545 nats, got {first}"
    );
    ensure!(
        report.final_loss() < first - 0.5,
        "the loss did not fall: {first} → {}",
        report.final_loss()
    );
    ensure!(
        report.pipeline.len() == cfg.pp,
        "one report row per pipeline rank"
    );
    for p in &report.pipeline {
        ensure!(
            p.peak_activations as u32 == p.peak_activations_predicted,
            "pipeline rank {}: measured {} stashed activations, the simulator predicts {}",
            p.pp_rank,
            p.peak_activations,
            p.peak_activations_predicted
        );
    }

    // The metrics file: one JSON object per step.
    let metrics = std::fs::read_to_string(out.join("metrics.jsonl"))?;
    let last: serde_json::Value = serde_json::from_str(metrics.lines().last().unwrap_or("{}"))?;
    ensure!(
        metrics.lines().count() == steps,
        "one metrics line per step"
    );
    println!("last metrics line: {last}");

    // The trace: one "X" (complete) event per action of every rank and step.
    let trace: serde_json::Value = serde_json::from_slice(&std::fs::read(out.join("trace.json"))?)?;
    let events = trace["traceEvents"].as_array().context("traceEvents")?;
    let actions = events.iter().filter(|e| e["ph"] == "X").count();
    let per_step: usize =
        cfg.program().map_err(anyhow::Error::msg)?.num_actions() * cfg.dp * cfg.tp;
    ensure!(actions == per_step * steps, "{actions} trace events");
    println!(
        "trace: {} ({actions} actions; open it in https://ui.perfetto.dev)",
        out.join("trace.json").display()
    );
    Ok(())
}

/// A fresh scratch directory for this example's files.
fn out_dir(name: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join("switchyard-examples").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}
