//! The `switchyard` command-line tool.

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod cli;

#[global_allocator]
static ALLOC: switchyard::Allocator = switchyard::ALLOCATOR;

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
    /// Generate, validate, simulate and draw a pipeline schedule, or run it on synthetic stages
    Schedule(cli::schedule::ScheduleArgs),
    /// Mean cross-entropy (nats per byte) of a checkpoint or weights file on a text
    Eval(cli::model::EvalArgs),
    /// Merge a checkpoint's shards into one nanoGPT-named .safetensors file (loads in PyTorch)
    Export(cli::model::ExportArgs),
    /// Generate text from a checkpoint or weights file
    Sample(cli::model::SampleArgs),
    /// Time the reference workload on one worker and on every parallel layout (a table)
    Bench(cli::bench::BenchArgs),
    /// Which layouts of a model fit on N workers, ranked by predicted step time
    Plan(Box<cli::plan::PlanArgs>),
}

fn main() {
    quiet_on_closed_pipe();
    switchyard::keep_freed_memory();
    cli::configure_threads_env();
    let cli = parse();
    let result = match cli.command {
        Command::Train(a) => cli::train::run(*a),
        Command::Schedule(a) => cli::schedule::run(a),
        Command::Eval(a) => cli::model::eval(a),
        Command::Export(a) => cli::model::export(a),
        Command::Sample(a) => cli::model::sample_text(a),
        Command::Bench(a) => cli::bench::run(a),
        Command::Plan(a) => cli::plan::run(*a),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// `switchyard plan | head` closes standard output before the table ends. Rust ignores
/// SIGPIPE, so `print!` then panics; stop quietly instead, with the status of a Unix tool
/// that SIGPIPE ended (128 + 13). Every other panic goes to the default hook.
fn quiet_on_closed_pipe() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("");
        if msg.starts_with("failed printing to stdout") && msg.contains("Broken pipe") {
            std::process::exit(141);
        }
        default(info);
    }));
}

/// The command line. Every subcommand takes negative numbers (`--lr -1`) as values, so
/// that they reach the checks that refuse them by value with a clear message; an
/// integer flag given a negative value is refused here, naming the flag.
fn parse() -> Cli {
    let cmd = Cli::command().mut_subcommands(|s| s.allow_negative_numbers(true));
    let result = cmd
        .try_get_matches()
        .and_then(|mut m| Cli::from_arg_matches_mut(&mut m));
    match result {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::{ContextKind, ContextValue, ErrorKind};
            let value = |k| match e.get(k) {
                Some(ContextValue::String(s)) => Some(s.clone()),
                _ => None,
            };
            if e.kind() == ErrorKind::ValueValidation {
                if let (Some(flag), Some(v)) = (
                    value(ContextKind::InvalidArg),
                    value(ContextKind::InvalidValue),
                ) {
                    if v.starts_with('-') {
                        let flag = flag.split_whitespace().next().unwrap_or(&flag);
                        eprintln!("error: {flag} {v}: must be a whole number ≥ 0");
                        std::process::exit(2);
                    }
                }
            }
            e.exit()
        }
    }
}
