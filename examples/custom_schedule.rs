//! Chapter 6, "A custom schedule as CSV" (`docs/tutorial/06-custom-schedule.md`).
//!
//! 1. Writes a hand-made two-rank schedule ("eager 1F1B") to a CSV file, loads it,
//!    validates it, lowers it (adds the sends and receives) and simulates it beside 1F1B,
//!    with free and with costly messages.
//! 2. Shows what the validator says about two broken files: an order that can never
//!    run, and messages placed so that they deadlock.
//! 3. Trains the tiny GPT with the CSV file as its schedule and with 1F1B, and checks
//!    that the two runs have the same loss curve.
//!
//! ```text
//! cargo run --release --example custom_schedule
//! ```

use std::path::PathBuf;

use anyhow::{ensure, Context};
use switchyard::models::GptConfig;
use switchyard::schedule::{
    generate, lower, render_text, simulate, validate, Costs, Program, ScheduleChoice, ScheduleKind,
    Timeline,
};
use switchyard::train::data::Corpus;
use switchyard::train::{train, TrainConfig, TrainOptions};

/// "Eager 1F1B" on two ranks with four microbatches: 1F1B with one more warm-up forward
/// on rank 0, so that a forward is ready while a message is in flight. Rank 1 is 1F1B.
const MINE: &str = "\
# rank, then its actions in order: sFm = forward of stage s on microbatch m, sBm = backward
0,0F0,0F1,0F2,0B0,0F3,0B1,0B2,0B3
1,1F0,1B0,1F1,1B1,1F2,1B2,1F3,1B3
";

/// Stage 0 needs the gradient of microbatch 0 before it sends microbatch 1, but rank 1
/// insists on microbatch 1 first: a cycle.
const CYCLIC: &str = "0,0F0,0B0,0F1,0B1\n1,1F1,1B1,1F0,1B0\n";

/// Already lowered, with the naive message order: each send right after its producer,
/// each receive right before its consumer. Hangs if sends block.
const NAIVE: &str = "\
0,0F0,0SF0,0F1,0SF1,0RB1,0B1,0RB0,0B0
1,1RF0,1F0,1B0,1SB0,1RF1,1F1,1B1,1SB1
";

fn main() -> anyhow::Result<()> {
    let dir = out_dir("custom-schedule")?;
    let path = dir.join("mine.csv");
    std::fs::write(&path, MINE)?;

    println!("== 1. {}\n", path.display());
    let mine = Program::load_csv(&path)?;
    validate(&mine)?;
    println!("{mine}");
    let lowered = lower(&mine)?;
    validate(&lowered)?;
    println!("lowered, as the executor runs it:\n{lowered}");
    println!("{}", lowered.to_csv());
    // Simulate both lowered programs, free messages and messages that cost a forward.
    let f1b = lower(&generate(ScheduleKind::OneFOneB, 2, 4)?)?;
    for comm in [0.0, 1.0] {
        let costs = Costs {
            comm,
            ..Costs::default()
        };
        let (a, b) = (simulate(&lowered, &costs)?, simulate(&f1b, &costs)?);
        println!("F = 1, B = 2, every send and receive {comm}:");
        println!("  eager 1F1B: {}", summary(&a));
        println!("  1F1B:       {}", summary(&b));
        ensure!(a.peak_activations() == [3, 1] && b.peak_activations() == [2, 1]);
        if comm > 0.0 {
            ensure!(
                a.makespan < b.makespan,
                "the eager forward hides message time"
            );
            println!("\n{}", render_text(&a));
        }
    }

    println!("== 2. What the validator says about broken schedules\n");
    for (name, csv) in [("cyclic.csv", CYCLIC), ("naive.csv", NAIVE)] {
        let broken = dir.join(name);
        std::fs::write(&broken, csv)?;
        let program = Program::load_csv(&broken)?;
        // What the trainer does with a CSV schedule: lower it unless it has messages, then
        // validate. Both steps run the program in an event simulation and name every stuck
        // rank.
        let checked = match program.is_lowered() {
            true => validate(&program),
            false => lower(&program).and_then(|l| validate(&l)),
        };
        let err = checked.expect_err("the schedule must be refused");
        println!("{name}: {err}");
        ensure!(err.to_string().contains("deadlock"), "{err}");
    }

    println!("\n== 3. Training with the CSV schedule (pp 2 × tp 2) and with 1F1B\n");
    let base = TrainConfig {
        model: GptConfig {
            n_layer: 2,
            d_model: 32,
            block_size: 32,
            ..GptConfig::default()
        },
        seq_len: 32,
        batch: 8,
        microbatches: 4,
        steps: 8,
        warmup: 2,
        threads_per_worker: 1,
        ..TrainConfig::default()
    };
    let with_csv = TrainConfig {
        schedule: ScheduleChoice::File(path.clone()),
        ..base.clone()
    };
    let corpus = Corpus::bundled();
    let a = train(&with_csv, &corpus, &TrainOptions::default())?;
    print!("{}", a.render(&with_csv));
    let b = train(&base, &corpus, &TrainOptions::default())?;
    print!("{}", b.render(&base));
    for (x, y) in a.steps.iter().zip(&b.steps) {
        let rel = (x.loss - y.loss).abs() / y.loss;
        ensure!(
            rel <= 1e-5,
            "step {}: {} vs {} ({rel:.1e})",
            x.step,
            x.loss,
            y.loss
        );
    }
    println!("\nsame loss curve with the hand-written schedule as with 1F1B");
    Ok(())
}

/// The last line of the text rendering: makespan, bubble, peak activations.
fn summary(tl: &Timeline) -> String {
    render_text(tl)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string()
}

fn out_dir(name: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join("switchyard-examples").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}
