//! The `switchyard` command-line tool.

use clap::{Parser, Subcommand};

mod cli;

#[global_allocator]
static ALLOC: switchyard::Allocator = switchyard::Allocator;

/// Pipeline, tensor and data-parallel training on candle, with serial parity you can trust.
#[derive(Parser)]
#[command(name = "switchyard", version, arg_required_else_help = true)]
#[command(
    after_help = "Start with `switchyard train` (a small GPT, pipeline × tensor parallel, on threads)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Train a GPT on text with any dp × pp × tp layout (default: pp 2 × tp 2 on the bundled text)
    Train(Box<cli::train::TrainArgs>),
    /// Generate, validate, simulate and draw a pipeline schedule
    Schedule(cli::schedule::ScheduleArgs),
    /// Mean cross-entropy (nats per byte) of a checkpoint or weights file on a text
    Eval(cli::model::EvalArgs),
    /// Merge a checkpoint's shards into one nanoGPT-named .safetensors file (loads in PyTorch)
    Export(cli::model::ExportArgs),
    /// Generate text from a checkpoint or weights file
    Sample(cli::model::SampleArgs),
    /// Time the reference workload on one worker and on every parallel layout (a table)
    Bench(cli::bench::BenchArgs),
}

fn main() {
    switchyard::keep_freed_memory();
    cli::configure_threads_env();
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Train(a) => cli::train::run(*a),
        Command::Schedule(a) => cli::schedule::run(a),
        Command::Eval(a) => cli::model::eval(a),
        Command::Export(a) => cli::model::export(a),
        Command::Sample(a) => cli::model::sample_text(a),
        Command::Bench(a) => cli::bench::run(a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
