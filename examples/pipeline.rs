//! Chapter 2, "Pipeline parallelism" (`docs/tutorial/02-pipeline-parallelism.md`).
//!
//! 1. Simulates GPipe, 1F1B, interleaved 1F1B and ZB-H1 for p = 4 ranks and m = 8
//!    microbatches, prints each text grid, and checks the bubble and activation formulas.
//! 2. Runs each schedule for real: four threads, each a pipeline rank running small
//!    `ModuleStage`s with `switchyard::pipeline::Executor`. Checks that every schedule
//!    computes the gradients of the serial chain, prints the counted peak of stashed
//!    microbatches (from the executed order) beside the simulator's, and writes the 1F1B run's trace for Perfetto.
//!
//! ```text
//! cargo run --release --example pipeline
//! ```

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{ensure, Context};
use candle_core::{DType, Device, Module, Result, Tensor, Var};
use switchyard::comm::local;
use switchyard::pipeline::{Executor, Microbatches, ModuleStage, Stage, TraceEvent};
use switchyard::schedule::{generate, render_text, simulate, Costs, Op, Program, ScheduleKind};

/// Pipeline ranks.
const P: usize = 4;
/// Microbatches per step.
const M: usize = 8;
/// Width of every stage, and rows of every microbatch.
const D: usize = 16;
const ROWS: usize = 4;

fn main() -> anyhow::Result<()> {
    let kinds = [
        ("GPipe", ScheduleKind::GPipe),
        ("1F1B", ScheduleKind::OneFOneB),
        (
            "Interleaved 1F1B (v=2)",
            ScheduleKind::Interleaved { virtual_stages: 2 },
        ),
        ("ZB-H1", ScheduleKind::ZbH1),
        ("ZB-H2", ScheduleKind::ZbH2),
    ];

    println!("== 1. Simulated: p = {P} ranks, m = {M} microbatches, F = 1, B = 2, I = W = 1\n");
    let (p, m) = (P as f64, M as f64);
    for (name, kind) in kinds {
        let program = generate(kind, P, M)?;
        // An interleaved stage is half a rank's layers: half the cost, same time axis.
        let costs = match kind {
            ScheduleKind::Interleaved { virtual_stages: v } => Costs {
                f: 1.0 / v as f64,
                b: 2.0 / v as f64,
                ..Costs::default()
            },
            _ => Costs::default(),
        };
        let tl = simulate(&program, &costs)?;
        println!("{name}\n{}", render_text(&tl));
        let (bubble, peaks): (f64, Vec<u32>) = match kind {
            ScheduleKind::GPipe => ((p - 1.0) / (m + p - 1.0), vec![M as u32; P]),
            ScheduleKind::OneFOneB => (
                (p - 1.0) / (m + p - 1.0),
                (0..P).map(|r| (P - r).min(M) as u32).collect(),
            ),
            ScheduleKind::Interleaved { virtual_stages } => {
                let v = virtual_stages;
                (
                    (p - 1.0) / (m * v as f64 + p - 1.0),
                    (0..P)
                        .map(|r| (2 * (P - r - 1) + (v - 1) * P + 1).min(M * v) as u32)
                        .collect(),
                )
            }
            ScheduleKind::ZbH1 => ((p - 1.0) / (3.0 * m + p - 1.0), vec![P.min(M) as u32; P]),
            // With I = W, no faster than ZB-H1; more activations held (it pays where
            // I costs more than W, chapter 2).
            ScheduleKind::ZbH2 => (
                (p - 1.0) / (3.0 * m + p - 1.0),
                vec![(2 * P - 1).min(M) as u32; P],
            ),
        };
        ensure!(
            (tl.bubble_fraction - bubble).abs() < 1e-12,
            "{name}: bubble {} vs formula {bubble}",
            tl.bubble_fraction
        );
        ensure!(tl.peak_activations() == peaks, "{name}: peak activations");
    }

    println!("== 2. Executed on {P} threads: a chain of tanh(x·W) stages, f64\n");
    println!("schedule                  stages  peak activations per rank   max |grad − serial|");
    println!("                                  counted      predicted");
    println!("{}", "-".repeat(82));
    let out = out_dir("pipeline")?;
    for (name, kind) in kinds {
        let program = generate(kind, P, M)?;
        let predicted = simulate(&program, &Costs::default())?.peak_activations();
        let (serial_grads, serial_loss) = serial(program.num_stages)?;
        let ranks = run(&program)?;

        let mut max_diff = 0f64;
        let mut losses = Vec::new();
        for r in &ranks {
            losses.extend(r.losses.iter().map(|(_, l)| *l));
            for (s, g) in &r.grads {
                let d = (g - &serial_grads[*s as usize])?
                    .abs()?
                    .max_all()?
                    .to_scalar::<f64>()?;
                max_diff = max_diff.max(d);
            }
        }
        let loss = losses.iter().sum::<f64>() / losses.len() as f64;
        let counted: Vec<u32> = ranks.iter().map(|r| r.peak as u32).collect();
        println!(
            "{name:<25} {:>6}  {:<12} {:<12}  {max_diff:.1e}",
            program.num_stages,
            join(&counted),
            join(&predicted)
        );
        ensure!(max_diff < 1e-12, "{name}: gradients differ by {max_diff}");
        ensure!(
            (loss - serial_loss).abs() < 1e-12,
            "{name}: loss {loss} vs {serial_loss}"
        );
        ensure!(
            counted == predicted,
            "{name}: counted peaks differ from the simulator's"
        );

        if kind == ScheduleKind::ZbH1 {
            // How the executor splits a backward: `I` runs autograd once (input and weight
            // gradients together) and keeps the weight gradients; `W` only adds them in.
            let total = |op: Op| -> f64 {
                ranks
                    .iter()
                    .flat_map(|r| &r.events)
                    .filter(|e| e.action.op == op)
                    .map(|e| e.dur_us)
                    .sum()
            };
            println!(
                "{:<25} time in F {:.0} µs, in I {:.0} µs, in W {:.0} µs (all ranks)",
                "",
                total(Op::F),
                total(Op::I),
                total(Op::W)
            );
        }
        if kind == ScheduleKind::OneFOneB {
            let path = out.join("trace-1f1b.json");
            write_trace(&path, &ranks)?;
            println!("{:<25} trace: {}", "", path.display());
        }
    }
    println!(
        "\nevery schedule computed the serial gradients; open the trace in https://ui.perfetto.dev"
    );
    Ok(())
}

/// The weight of stage `s`: fixed values of size about 1/√D.
fn weight(s: u32) -> Result<Tensor> {
    let v: Vec<f64> = (0..D * D)
        .map(|i| (((i * 7 + s as usize * 13) % 11) as f64 - 5.0) / (2.0 * D as f64))
        .collect();
    Tensor::from_vec(v, (D, D), &Device::Cpu)
}

fn input(m: usize) -> Result<Tensor> {
    let v: Vec<f64> = (0..ROWS * D)
        .map(|i| ((i + 3 * m) % 5) as f64 / 4.0 - 0.5)
        .collect();
    Tensor::from_vec(v, (ROWS, D), &Device::Cpu)
}

/// Mean squared error against the next microbatch's input (any fixed target will do).
fn loss(out: &Tensor, m: usize) -> Result<Tensor> {
    (out - input(m + 1)?)?.sqr()?.mean_all()
}

/// Stage `s`: `x ↦ tanh(x·W_s)`, a closure with its one parameter.
fn stage(s: u32) -> Result<ModuleStage<impl Module + Send + Sync>> {
    let w = Var::from_tensor(&weight(s)?)?;
    let wt = w.as_tensor().clone();
    Ok(ModuleStage::from_fn(
        move |x: &Tensor| x.matmul(&wt)?.tanh(),
        vec![w],
    ))
}

/// The same chain on one thread: the gradient of every stage's weight for the mean
/// loss over the microbatches, and that loss.
fn serial(stages: u32) -> Result<(Vec<Tensor>, f64)> {
    let ws = (0..stages)
        .map(|s| Var::from_tensor(&weight(s)?))
        .collect::<Result<Vec<_>>>()?;
    let mut total = Tensor::zeros((), DType::F64, &Device::Cpu)?;
    for i in 0..M {
        let mut x = input(i)?;
        for w in &ws {
            x = x.matmul(w.as_tensor())?.tanh()?;
        }
        total = (total + loss(&x, i)?)?;
    }
    let total = (total / M as f64)?;
    let grads = total.backward()?;
    let g = ws
        .iter()
        .map(|w| {
            grads
                .get(w.as_tensor())
                .cloned()
                .expect("every weight has a gradient")
        })
        .collect();
    Ok((g, total.to_scalar()?))
}

/// What one pipeline rank reports.
struct RankRun {
    grads: BTreeMap<u32, Tensor>,
    losses: Vec<(u32, f64)>,
    peak: usize,
    events: Vec<TraceEvent>,
}

/// Runs `program` on one thread per rank.
fn run(program: &Program) -> anyhow::Result<Vec<RankRun>> {
    let epoch = std::time::Instant::now();
    local::launch(program.num_ranks(), |comm| -> Result<RankRun> {
        let mine = program.stages_of_rank(comm.rank() as u32);
        let modules = mine.iter().map(|&s| stage(s)).collect::<Result<Vec<_>>>()?;
        let stages: Vec<(u32, &dyn Stage)> = mine
            .iter()
            .copied()
            .zip(modules.iter().map(|s| s as &dyn Stage))
            .collect();
        // `Executor::new` lowers the program (adds the sends and receives) and validates it.
        let exec = Executor::new(program, &*comm, stages)?.with_epoch(epoch);
        let out = exec.run(&Microbatches {
            inputs: (0..M).map(input).collect::<Result<Vec<_>>>()?,
            loss: &loss,
            loss_scale: 1.0 / M as f64,
        })?;
        let grads = out
            .grads
            .into_iter()
            .map(|(s, g)| (s, g[0].clone().expect("the stage's weight got a gradient")))
            .collect();
        Ok(RankRun {
            grads,
            losses: out.losses,
            peak: out.stats.peak_activations,
            events: out.stats.events,
        })
    })
    .map_err(|e| anyhow::anyhow!("{e}"))
}

/// A Chrome trace: one row per rank, one box per action.
fn write_trace(path: &std::path::Path, ranks: &[RankRun]) -> anyhow::Result<()> {
    let mut events = Vec::new();
    for (r, run) in ranks.iter().enumerate() {
        events.push(serde_json::json!({
            "name": "thread_name", "ph": "M", "pid": 0, "tid": r,
            "args": { "name": format!("pipeline rank {r}") }
        }));
        for e in &run.events {
            events.push(serde_json::json!({
                "name": e.action, "ph": "X", "pid": 0, "tid": r,
                "ts": e.start_us, "dur": e.dur_us,
                "cat": e.action.op.code(),
            }));
        }
    }
    let doc = serde_json::json!({ "traceEvents": events, "displayTimeUnit": "ms" });
    std::fs::write(path, serde_json::to_vec(&doc)?)
        .with_context(|| format!("cannot write {}", path.display()))
}

fn join(v: &[u32]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

fn out_dir(name: &str) -> anyhow::Result<PathBuf> {
    let dir = std::env::temp_dir().join("switchyard-examples").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok(dir)
}
