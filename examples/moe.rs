//! Chapter 12, "Mixture of experts" (`docs/tutorial/12-mixture-of-experts.md`): a GPT
//! whose every other block routes each token to 2 of 4 expert MLPs, trained with its
//! experts spread over two data-parallel replicas (expert parallelism), checked against
//! the same run without the spread, with a look at where the tokens went.
//!
//! ```text
//! cargo run --release --example moe
//! ```

use anyhow::ensure;
use switchyard::models::{GptConfig, MoeConfig};
use switchyard::train::data::Corpus;
use switchyard::train::{train, TrainConfig, TrainOptions};

fn main() -> anyhow::Result<()> {
    let base = TrainConfig {
        model: GptConfig {
            n_layer: 4,
            d_model: 64,
            n_head: 4,
            block_size: 32,
            moe: MoeConfig {
                experts: 4,
                top_k: 2,
                every: 2,
                // Each expert half as wide as the dense MLP: with 2 experts a token,
                // the same products as the dense model.
                ffn_hidden: 128,
                ..MoeConfig::default()
            },
            ..GptConfig::default()
        },
        seq_len: 32,
        batch: 8,
        steps: 30,
        dp: 2,
        pp: 1,
        tp: 1,
        threads_per_worker: 1,
        ..TrainConfig::default()
    };
    let corpus = Corpus::bundled();
    let quiet = TrainOptions {
        progress: false,
        ..TrainOptions::default()
    };

    // 1. Every replica computes every expert for its own tokens (ep 1), or each of the
    //    two computes 2 experts for the tokens of both (ep 2, an all-to-all each way).
    let mut runs = Vec::new();
    for ep in [1, 2] {
        let cfg = TrainConfig { ep, ..base.clone() };
        let report = train(&cfg, &corpus, &quiet)?;
        let first = &report.steps[0];
        let last = report.steps.last().expect("steps");
        println!(
            "ep {ep}: loss {:.4} → {:.4}, balancing loss {:.5} → {:.5}",
            first.loss, last.loss, first.model["moe/aux_loss"], last.model["moe/aux_loss"]
        );
        runs.push(report);
    }
    for (a, b) in runs[0].steps.iter().zip(&runs[1].steps) {
        let e = (a.loss - b.loss).abs() / a.loss;
        ensure!(
            e <= 1e-4,
            "step {}: ep 2 gives {} against {} (rel {e:.1e})",
            a.step,
            b.loss,
            a.loss
        );
    }
    let last = runs[1].steps.last().expect("steps");
    ensure!(
        last.loss < runs[1].steps[0].loss - 0.5,
        "the model must learn"
    );
    println!("expert parallelism trains the same model: every step within 1e-4");

    // 2. Where the tokens of the last step went: each expert of block 1.
    let tokens: Vec<f64> = (0..4)
        .map(|e| last.model[&format!("transformer.h.1.mlp.experts.{e}.tokens")])
        .collect();
    println!("block 1, tokens per expert in the last step: {tokens:?}");
    let choices = last.model["moe/choices"];
    ensure!(
        choices == (2 * 8 * 32 * 2) as f64,
        "2 mixtures × 8 × 32 tokens × 2 choices"
    );

    // 3. A capacity: each expert takes at most ⌈1.0 · 2 · 32 / 4⌉ = 16 tokens of a
    //    sequence; the rest pass through the residual.
    let mut capped = base.clone();
    capped.model.moe.capacity_factor = 1.0;
    capped.steps = 5;
    let report = train(&capped, &corpus, &quiet)?;
    let m = &report.steps[4].model;
    let dropped = m["moe/dropped"] / m["moe/choices"];
    println!(
        "capacity factor 1.0: {:.1} % of the choices dropped at step 5",
        100.0 * dropped
    );
    ensure!(dropped < 0.5, "a capacity factor of 1 drops a minority");
    Ok(())
}
