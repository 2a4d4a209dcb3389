//! `switchyard plan`: which layouts of a model fit on N workers, and how fast each runs.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Context};
use clap::Args;
use switchyard_models::{GptConfig, Model};
use switchyard_train::estimate::cluster::Cluster;
use switchyard_train::estimate::plan::{candidate, plan, Candidate, Layout, Verdict};
use switchyard_train::estimate::time::{predict_step_time, TimeModel};
use switchyard_train::{Bytes, TrainConfig};

use super::train::{resolve, TrainArgs};

#[derive(Args)]
pub struct PlanArgs {
    /// Memory of one worker (512MiB, 80GB); default: this machine's available memory
    /// shared out over the workers
    #[arg(long, value_name = "SIZE")]
    pub memory_per_worker: Option<Bytes>,
    /// Measure this machine's compute and communication rates first (about 10 s) to
    /// predict step times
    #[arg(long)]
    pub calibrate: bool,
    /// Read the rates from a JSON file (written by --save-calibration)
    #[arg(long, value_name = "FILE", conflicts_with = "calibrate")]
    pub time_model: Option<PathBuf>,
    /// Write the rates --calibrate measured to this JSON file
    #[arg(long, value_name = "FILE", requires = "calibrate")]
    pub save_calibration: Option<PathBuf>,
    /// Plan for other hardware: a TOML description of a cluster (see clusters/); its
    /// memory per device is the budget unless --memory-per-worker says otherwise
    #[arg(long, value_name = "FILE", conflicts_with_all = ["calibrate", "time_model"])]
    pub cluster: Option<PathBuf>,
    /// Print one layout in detail, e.g. "dp2 pp2 tp1 1f1b m8"
    #[arg(long, value_name = "LAYOUT")]
    pub explain: Option<String>,
    /// Print JSON instead of a table
    #[arg(long)]
    pub json: bool,
    /// Rows of the table (0: all)
    #[arg(long, default_value_t = 15)]
    pub top: usize,
    /// The model and batch, as for `switchyard train` (the layout flags are ignored;
    /// --workers, default 4, is how many workers to plan for)
    #[command(flatten)]
    pub train: TrainArgs,
}

/// The workers a plan is for when none are given.
const DEFAULT_WORKERS: usize = 4;

/// This machine's rates for `model`'s ops backend and precision, measured now (about
/// 5 s).
pub fn calibrate(model: &GptConfig) -> anyhow::Result<TimeModel> {
    eprintln!("switchyard: measuring this machine's compute and communication rates ...");
    let compute = (model.ops, model.precision);
    TimeModel::calibrate(|d, t| switchyard::bench::probe(compute, d, t)).map_err(|e| anyhow!("{e}"))
}

/// `cfg` with the layout `--layout` names: its text form, or `auto`, the fastest layout
/// of `workers` workers that fits the memory budget (`--max-memory-per-worker`, else
/// this machine's available memory shared out), by this machine's measured rates.
pub fn choose_layout(
    cfg: TrainConfig<GptConfig>,
    layout: &str,
    workers: Option<usize>,
    speak: bool,
) -> anyhow::Result<TrainConfig<GptConfig>> {
    if layout != "auto" {
        if workers.is_some() {
            bail!("--workers goes with --layout auto (the layout {layout} says its workers)");
        }
        let l: Layout = layout.parse().map_err(|e| anyhow!("--layout: {e}"))?;
        return Ok(l.apply(&cfg));
    }
    let workers = workers.unwrap_or(DEFAULT_WORKERS);
    if workers == 0 {
        bail!("--workers must be at least 1");
    }
    let budget = match cfg.max_memory_per_worker {
        Some(b) => Some(b.0),
        None => switchyard_train::memory_info()
            .available
            .map(|m| m / workers as u64),
    };
    let tm = calibrate(&cfg.model)?;
    let time = |c: &TrainConfig<GptConfig>| predict_step_time(c, &tm).ok().map(|t| t.seconds);
    let all = plan(&cfg, workers, budget, &time);
    let fitting = all.iter().filter(|c| c.verdict == Verdict::Fits).count();
    let Some(best) = all.first().filter(|c| c.verdict == Verdict::Fits) else {
        let smallest = all
            .iter()
            .filter(|c| !c.memory.is_empty())
            .min_by_key(|c| c.peak_bytes());
        bail!(
            "--layout auto: no layout of {workers} workers fits {}{}; more workers, a smaller \
             model or batch would",
            budget
                .map(|b| format!("{} per worker", Bytes(b)))
                .unwrap_or_default(),
            smallest
                .map(|c| format!(
                    " (the smallest, {}, needs {})",
                    c.layout,
                    Bytes(c.peak_bytes())
                ))
                .unwrap_or_default()
        );
    };
    if speak {
        eprintln!(
            "switchyard: --layout auto chose {} of {fitting} layouts that fit{}: predicted {} \
             per worker, {:.1} ms a step (`switchyard plan` shows them all)",
            best.layout,
            budget
                .map(|b| format!(" {} per worker", Bytes(b)))
                .unwrap_or_default(),
            Bytes(best.peak_bytes()),
            best.step_s.unwrap_or(f64::NAN) * 1e3
        );
    }
    Ok(best.layout.apply(&cfg))
}

pub fn run(a: PlanArgs) -> anyhow::Result<()> {
    let workers = a.train.workers.unwrap_or(DEFAULT_WORKERS);
    if workers == 0 {
        bail!("--workers must be at least 1");
    }
    let (base, _, _) = resolve(&a.train)?;
    base.model
        .validate()
        .map_err(|e| anyhow!("invalid model: {e}"))?;
    let cluster = a
        .cluster
        .as_deref()
        .map(Cluster::load)
        .transpose()
        .map_err(|e| anyhow!("{e}"))?;
    let budget = match (a.memory_per_worker, &cluster) {
        (Some(b), _) => Some(b.0),
        (None, Some(c)) => Some(c.memory_per_device.0),
        (None, None) => switchyard_train::memory_info()
            .available
            .map(|m| m / workers as u64),
    };
    let measured = time_model(&a, &base)?;
    // A cluster's time model depends on the layout (which axis crosses nodes).
    let model_for = |c: &TrainConfig<GptConfig>| match &cluster {
        Some(cl) => Some(cl.time_model(c.dp, c.tp)),
        None => measured.clone(),
    };
    let time = |c: &TrainConfig<GptConfig>| {
        model_for(c)
            .and_then(|tm| predict_step_time(c, &tm).ok())
            .map(|t| t.seconds)
    };
    // MFU: the model's training FLOPs per token at the predicted tokens/s, over the
    // peak of the cluster's devices or of this machine's cores (all workers share it).
    // (A cluster's is per device: times the layout's workers, below.)
    let peak_flops = match (&cluster, &measured) {
        (Some(c), _) => Some(c.peak_flops),
        (None, Some(_)) => Some(
            switchyard::bench::fma_peak_gflops()
                * 1e9
                * switchyard_comm::threads::available_cores() as f64,
        )
        .filter(|&p| p > 0.0),
        (None, None) => None,
    };
    let costs = base.model.costs(base.seq_len);
    let flops_per_token = costs.embed + costs.blocks.iter().sum::<f64>() + costs.head;
    let devices = |c: &Candidate| match cluster {
        Some(_) => c.layout.workers() as f64,
        None => 1.0,
    };
    let mfu = |c: &Candidate| {
        Some(flops_per_token * tokens_per_s(&base, c)? / (peak_flops? * devices(c)))
    };
    if let Some(text) = &a.explain {
        let layout: Layout = text.parse().map_err(|e| anyhow!("--explain: {e}"))?;
        let c = candidate(&base, &layout, budget, &time);
        let tm = model_for(&layout.apply(&base));
        return explain(&base, &c, tm.as_ref(), budget, a.json, &mfu);
    }
    let all = plan(&base, workers, budget, &time);
    if a.json {
        let rows: Vec<serde_json::Value> = all.iter().map(|c| row_json(&base, c, &mfu)).collect();
        println!(
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "workers": workers,
                "memory_per_worker": budget,
                "model": base.model,
                "batch": base.batch,
                "seq_len": base.seq_len,
                "layouts": rows,
            }))?
        );
        return Ok(());
    }
    if let Some(c) = &cluster {
        println!(
            "cluster: {} ({} devices a node, {:.0} TFLOP/s achievable a device)",
            c.name,
            c.devices_per_node,
            c.peak_flops * c.achievable / 1e12
        );
    }
    print_table(&base, &all, workers, budget, a.top, &mfu);
    Ok(())
}

fn time_model(a: &PlanArgs, base: &TrainConfig<GptConfig>) -> anyhow::Result<Option<TimeModel>> {
    if a.calibrate {
        let tm = calibrate(&base.model)?;
        if let Some(p) = &a.save_calibration {
            std::fs::write(p, serde_json::to_string_pretty(&tm)?)
                .with_context(|| format!("cannot write --save-calibration {}", p.display()))?;
        }
        return Ok(Some(tm));
    }
    match &a.time_model {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("cannot read --time-model {}", p.display()))?;
            Ok(Some(serde_json::from_str(&text).with_context(|| {
                format!("--time-model {}: not a calibration", p.display())
            })?))
        }
        None => Ok(None),
    }
}

fn tokens_per_s(base: &TrainConfig<GptConfig>, c: &Candidate) -> Option<f64> {
    c.step_s.map(|s| (base.batch * base.seq_len) as f64 / s)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1024.0 * 1024.0)
}

fn print_table(
    base: &TrainConfig<GptConfig>,
    all: &[Candidate],
    workers: usize,
    budget: Option<u64>,
    top: usize,
    mfu: &dyn Fn(&Candidate) -> Option<f64>,
) {
    let m = &base.model;
    println!(
        "plan: GPT {} layers × d {} ({:.2}M parameters), {} sequences of {} tokens, on {workers} workers{}",
        m.n_layer,
        m.d_model,
        m.param_count() as f64 / 1e6,
        base.batch,
        base.seq_len,
        match budget {
            Some(b) => format!(" of {} each", Bytes(b)),
            None => String::new(),
        }
    );
    let fits = all.iter().filter(|c| c.verdict == Verdict::Fits).count();
    println!(
        "{fits} of {} layouts fit{}",
        all.len(),
        if all.iter().any(|c| c.step_s.is_some()) {
            ", fastest first"
        } else {
            " (no time model: --calibrate to rank by speed), least memory first"
        }
    );
    let shown = if top == 0 {
        all.len()
    } else {
        top.min(all.len())
    };
    // As wide as the longest layout shown.
    let w = all[..shown]
        .iter()
        .map(|c| c.layout.to_string().chars().count())
        .max()
        .unwrap_or(0)
        .max(24);
    println!(
        "  {:<w$} {:>12} {:<12} {:>10} {:>10} {:>6}  verdict",
        "layout", "peak/worker", "dominant", "step", "tokens/s", "MFU"
    );
    for c in &all[..shown] {
        let verdict = match &c.verdict {
            Verdict::Fits => "fits".to_string(),
            Verdict::TooBig { .. } => "too big".into(),
            Verdict::Invalid(why) => format!("invalid: {}", first_clause(why)),
        };
        let (peak, dominant) = match c.memory.is_empty() {
            true => ("-".to_string(), "-".to_string()),
            false => (
                format!("{:.1} MiB", mib(c.peak_bytes())),
                c.dominant()
                    .map(|d| d.name().to_string())
                    .unwrap_or_default(),
            ),
        };
        println!(
            "  {:<w$} {:>12} {:<12} {:>10} {:>10} {:>6}  {verdict}",
            c.layout.to_string(),
            peak,
            dominant,
            c.step_s
                .map(|s| format!("{:.1} ms", s * 1e3))
                .unwrap_or("-".into()),
            tokens_per_s(base, c)
                .map(|t| format!("{t:.0}"))
                .unwrap_or("-".into()),
            mfu(c)
                .map(|m| format!("{:.1}%", 100.0 * m))
                .unwrap_or("-".into()),
        );
    }
    if shown < all.len() {
        println!("  ... {} more (--top 0 shows all)", all.len() - shown);
    }
}

/// The first clause of a trainer's refusal, without the "invalid configuration: " prefix.
fn first_clause(why: &str) -> String {
    let why = why.trim_start_matches("invalid configuration: ");
    let cut = why.find([';', '(']).unwrap_or(why.len());
    why.chars()
        .take(why[..cut].chars().count().min(90))
        .collect::<String>()
        .trim_end()
        .to_string()
}

fn row_json(
    base: &TrainConfig<GptConfig>,
    c: &Candidate,
    mfu: &dyn Fn(&Candidate) -> Option<f64>,
) -> serde_json::Value {
    let (verdict, reason) = match &c.verdict {
        Verdict::Fits => ("fits", None),
        Verdict::TooBig { .. } => ("too_big", None),
        Verdict::Invalid(why) => ("invalid", Some(why.clone())),
    };
    serde_json::json!({
        "layout": c.layout.to_string(),
        "dp": c.layout.dp, "pp": c.layout.pp, "tp": c.layout.tp, "ep": c.layout.ep,
        "sequence_parallel": c.layout.sequence_parallel,
        "schedule": c.layout.schedule.to_string(),
        "microbatches": c.layout.microbatches,
        "verdict": verdict,
        "reason": reason,
        "predicted_peak_bytes": (!c.memory.is_empty()).then(|| c.peak_bytes()),
        "dominant": c.dominant().map(|d| d.name()),
        "per_pipeline_rank": c.memory.iter().map(|r| serde_json::json!({
            "pp": r.pp, "peak_bytes": r.peak_bytes, "bytes_by_category": r.by_category(),
        })).collect::<Vec<_>>(),
        "step_s": c.step_s,
        "tokens_per_s": tokens_per_s(base, c),
        "mfu": mfu(c),
    })
}

fn explain(
    base: &TrainConfig<GptConfig>,
    c: &Candidate,
    tm: Option<&TimeModel>,
    budget: Option<u64>,
    json: bool,
    mfu: &dyn Fn(&Candidate) -> Option<f64>,
) -> anyhow::Result<()> {
    let cfg = c.layout.apply(base);
    let step = tm.and_then(|tm| predict_step_time(&cfg, tm).ok());
    if json {
        let mut v = row_json(base, c, mfu);
        v["step"] = serde_json::to_value(&step)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("layout {} ({} workers)", c.layout, c.layout.workers());
    if let Verdict::Invalid(why) = &c.verdict {
        println!("  refused by the trainer: {why}");
        return Ok(());
    }
    println!("  predicted peak memory per pipeline rank (every dp and tp rank of it alike):");
    for r in &c.memory {
        let split: Vec<String> = r
            .by_category()
            .into_iter()
            .filter(|(_, b)| *b > 0)
            .map(|(k, b)| format!("{k} {:.2} MiB", mib(b as u64)))
            .collect();
        println!(
            "    pp rank {}: {:.2} MiB ({})",
            r.pp,
            mib(r.peak_bytes as u64),
            split.join(", ")
        );
    }
    match (budget, &c.verdict) {
        (Some(b), Verdict::TooBig { peak }) => println!(
            "  does not fit: {:.2} MiB over the budget of {}",
            mib(peak - b),
            Bytes(b)
        ),
        (Some(b), _) => println!("  fits the budget of {}", Bytes(b)),
        _ => {}
    }
    match step {
        Some(t) => {
            println!(
                "  predicted step: {:.1} ms ({:.0} tokens/s{})",
                t.seconds * 1e3,
                (base.batch * base.seq_len) as f64 / t.seconds,
                mfu(c)
                    .map(|m| format!(", MFU {:.1} %", 100.0 * m))
                    .unwrap_or_default()
            );
            let experts = match t.ep_comm_s > 0.0 {
                true => format!(", expert all-to-alls {:.1}", t.ep_comm_s * 1e3),
                false => String::new(),
            };
            println!(
                "    pipeline {:.1} ms (compute {:.1}, tensor-parallel all-reduces {:.1}{experts}, messages {:.1}; bubble {:.1} %), data-parallel all-reduce {:.1} ms, optimizer {:.1} ms, fixed cost {:.1} ms",
                t.pipeline_s * 1e3,
                t.compute_s * 1e3,
                t.tp_comm_s * 1e3,
                t.p2p_s * 1e3,
                100.0 * t.bubble_fraction,
                t.dp_allreduce_s * 1e3,
                t.optimizer_s * 1e3,
                t.overhead_s * 1e3
            );
        }
        None => println!("  no step time: give --calibrate or --time-model"),
    }
    Ok(())
}
