//! What `switchyard schedule` does, without clap:
//!
//! ```text
//! cargo run -p switchyard-schedule --example schedule -- \
//!     --kind interleaved --stages 4 --microbatches 8 --virtual-stages 2 \
//!     [--costs F=1,B=2,I=1,W=1,comm=0] [--format text|json|svg] [--lower] [--out FILE]
//! cargo run -p switchyard-schedule --example schedule -- --from-csv my.csv
//! ```

use switchyard_schedule::{generate, lower, report, Costs, Format, Program, ScheduleKind};

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let get = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let program = match get("--from-csv") {
        Some(path) => Program::load_csv(path)?,
        None => {
            let v = get("--virtual-stages").map(|v| v.parse()).transpose()?;
            let kind = ScheduleKind::from_name(&get("--kind").unwrap_or("1f1b".into()), v)?;
            let p = get("--stages").unwrap_or("4".into()).parse()?;
            let m = get("--microbatches").unwrap_or("8".into()).parse()?;
            generate(kind, p, m)?
        }
    };
    let program = if args.iter().any(|a| a == "--lower") && !program.is_lowered() {
        lower(&program)?
    } else {
        program
    };
    let costs: Costs = get("--costs").unwrap_or_default().parse()?;
    let format: Format = get("--format").unwrap_or("text".into()).parse()?;
    let out = report(&program, &costs, format)?;
    match get("--out") {
        Some(path) => std::fs::write(path, out)?,
        None => print!("{out}"),
    }
    Ok(())
}
