//! The training loop's outputs and refusals: custom CSV schedules, metrics, traces,
//! the report, non-finite values and invalid configurations.

use std::path::PathBuf;

use crate::common::*;
use switchyard_models::GptConfig;
use switchyard_train::data::Corpus;
use switchyard_train::{train, TrainOptions};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-train-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn a_custom_csv_schedule_trains_like_the_reference() {
    let dir = scratch("csv");
    // Two ranks, four microbatches: forwards in pairs, backwards newest first.
    let csv = "# rank, actions\n\
               0,0F0,0F1,0F2,0F3,0B3,0B2,0B1,0B0\n\
               1,1F0,1F1,1B1,1B0,1F2,1F3,1B3,1B2\n";
    let path = dir.join("mine.csv");
    std::fs::write(&path, csv).unwrap();
    let cfg = tiny(1, 2, 2, path.to_str().unwrap());
    assert_step_parity(&cfg, 1e-5);
}

#[test]
fn an_invalid_csv_schedule_is_refused_with_the_validator_message() {
    let dir = scratch("bad-csv");
    let path = dir.join("bad.csv");
    // Stage 1 runs the backward of microbatch 0 before its forward.
    std::fs::write(
        &path,
        "0,0F0,0F1,0F2,0F3,0B0,0B1,0B2,0B3\n1,1B0,1F0,1F1,1B1,1F2,1B2,1F3,1B3\n",
    )
    .unwrap();
    let cfg = tiny(1, 2, 1, path.to_str().unwrap());
    let e = train(&cfg, &Corpus::bundled(), &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("invalid configuration") && e.contains("1B0"),
        "{e}"
    );
}

#[test]
fn metrics_and_trace_are_written() {
    let dir = scratch("outputs");
    let mut cfg = tiny(1, 2, 2, "1f1b");
    cfg.steps = 3;
    let opts = TrainOptions {
        metrics: Some(dir.join("m.jsonl")),
        trace: Some(dir.join("t.json")),
        ..TrainOptions::default()
    };
    let report = train(&cfg, &Corpus::bundled(), &opts).unwrap();
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(dir.join("m.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["step"], i);
        for k in ["loss", "grad_norm", "lr", "tokens_per_s"] {
            assert!(l[k].as_f64().unwrap().is_finite(), "{k} in {l}");
        }
        assert_eq!(l["loss"].as_f64().unwrap(), report.steps[i].loss);
    }
    let trace: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("t.json")).unwrap()).unwrap();
    let events = trace["traceEvents"].as_array().unwrap();
    // Every rank's every action of every step, on one timeline.
    let program = cfg.program().unwrap();
    let per_step: usize = program.ranks.iter().map(|r| r.len()).sum::<usize>() * cfg.tp;
    let actions = events.iter().filter(|e| e["ph"] == "X").count();
    assert_eq!(actions, per_step * 3);
    for tid in 0..cfg.world_size() {
        assert!(events.iter().any(|e| e["ph"] == "X" && e["tid"] == tid));
        assert!(events.iter().any(|e| e["ph"] == "M" && e["tid"] == tid));
    }
    // A slice is named by its action's text (`1F3`) and its category is the op: rank 0's
    // first step is its program's list.
    let first: Vec<(&str, &str)> = events
        .iter()
        .filter(|e| e["ph"] == "X" && e["tid"] == 0 && e["args"]["step"] == 0)
        .map(|e| (e["name"].as_str().unwrap(), e["cat"].as_str().unwrap()))
        .collect();
    let listed: Vec<(String, &str)> = program.ranks[0]
        .iter()
        .map(|a| (a.to_string(), a.op.code()))
        .collect();
    assert_eq!(
        first,
        listed
            .iter()
            .map(|(n, c)| (n.as_str(), *c))
            .collect::<Vec<_>>()
    );
}

#[test]
fn the_report_measures_the_pipeline_and_1f1b_stays_within_p_microbatches() {
    let mut cfg = tiny(1, 4, 1, "1f1b");
    cfg.microbatches = 8;
    cfg.batch = 8;
    cfg.steps = 2;
    let report = train(&cfg, &Corpus::bundled(), &TrainOptions::default()).unwrap();
    assert_eq!(report.pipeline.len(), 4);
    for p in &report.pipeline {
        assert_eq!(
            p.peak_activations as u32, p.peak_activations_predicted,
            "rank {}",
            p.pp_rank
        );
        assert_eq!(p.peak_activations, 4 - p.pp_rank);
        assert!((0.0..1.0).contains(&p.bubble_measured));
        assert!((p.bubble_predicted - 3.0 / 11.0).abs() < 1e-9);
    }
    let text = report.render(&cfg);
    assert!(
        text.contains("bubble measured") && text.contains("tokens/s"),
        "{text}"
    );
}

#[test]
fn a_non_finite_loss_stops_the_run_naming_the_step_and_rank() {
    let mut cfg = tiny(1, 2, 2, "1f1b");
    cfg.lr = 1e30;
    cfg.min_lr = 1e30;
    cfg.warmup = 0;
    cfg.grad_clip = 0.0;
    cfg.steps = 5;
    let e = train(&cfg, &Corpus::bundled(), &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("step 1: non-finite values first appeared on rank"),
        "{e}"
    );
    assert!(
        e.contains("(pp ") && (e.contains("gradient of") || e.contains("loss of a microbatch")),
        "{e}"
    );
}

#[test]
fn invalid_layouts_are_refused_before_any_worker_starts() {
    for (f, want) in [
        (
            (|c: &mut switchyard_train::TrainConfig<GptConfig>| c.tp = 3) as fn(&mut _),
            "does not divide the 4 attention heads",
        ),
        (|c| c.pp = 16, "16 stages but the model has only 8 layers"),
        (
            |c| c.batch = 6,
            "does not split into --dp 1 × --microbatches 4",
        ),
    ] {
        let mut cfg = tiny(1, 1, 1, "1f1b");
        f(&mut cfg);
        let e = train(&cfg, &Corpus::bundled(), &TrainOptions::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("invalid configuration") && e.contains(want),
            "{e}"
        );
    }
    let cfg = tiny(1, 1, 1, "1f1b");
    let short = Corpus::from_bytes("short", b"tiny".to_vec());
    let e = train(&cfg, &short, &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("fewer than one window"), "{e}");
}
