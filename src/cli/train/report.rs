//! What `switchyard train` prints besides the training itself: the precision in its start
//! line, and the end report as `--report-json` writes it.

use switchyard_models::{GptConfig, Precision};
use switchyard_train::TrainConfig;

/// The end report as `--report-json` writes it.
pub(super) fn report_json(
    cfg: &TrainConfig<GptConfig>,
    report: &switchyard_train::TrainReport,
) -> serde_json::Value {
    let mesh = cfg.mesh();
    let ranks: Vec<serde_json::Value> = (0..cfg.world_size())
        .map(|r| {
            let c = mesh.coord(r);
            let pipe = report.pipeline.iter().find(|p| p.pp_rank == c.pp);
            let mem = report.memory.iter().find(|m| m.rank == r);
            serde_json::json!({
                "rank": r,
                "coords": { "dp": c.dp, "pp": c.pp, "tp": c.tp },
                "peak_bytes": mem.map(|m| m.peak_bytes),
                "peak_rss_bytes": mem.and_then(|m| m.peak_rss_bytes),
                "bytes_by_category": mem.map(|m| &m.bytes_by_category),
                "predicted_peak_bytes": mem.and_then(|m| m.predicted_peak_bytes),
                "bubble_measured": pipe.map(|p| p.bubble_measured),
                "bubble_predicted": pipe.map(|p| p.bubble_predicted),
                "tokens_per_s": report.tokens_per_s,
            })
        })
        .collect();
    serde_json::json!({
        "layout": {
            "dp": cfg.dp, "pp": cfg.pp, "tp": cfg.tp, "ep": cfg.ep,
            "schedule": cfg.schedule.to_string(),
            "microbatches": cfg.microbatches,
            "virtual_stages": cfg.virtual_stages,
            "zero": cfg.zero,
            "sequence_parallel": cfg.splits_sequence(),
            "text": switchyard_train::estimate::plan::Layout::of(cfg).map(|l| l.to_string()),
        },
        "config": cfg,
        "ranks": ranks,
        "report": report,
    })
}

/// What the header line says of the precision: nothing at f32; at bf16 the kernel that
/// multiplies (`amx`, `avx512_bf16`), or that it is emulated on this CPU.
pub(super) fn precision_note(p: Precision) -> String {
    let kernel = switchyard_ops::Bf16Kernel::best();
    match (p, kernel.is_native()) {
        (Precision::F32, _) => String::new(),
        (_, true) => format!(", bf16 products ({kernel})"),
        (_, false) => {
            ", bf16 products emulated (this CPU has neither AMX nor AVX-512 BF16: f32 speed)".into()
        }
    }
}
