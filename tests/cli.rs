//! The `switchyard` command end to end, at tiny sizes: train with a TOML config and
//! flags, checkpoints, export, eval, sample, schedule; and refusals with exit status 1.

use std::path::PathBuf;
use std::process::{Command, Output};

fn switchyard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .output()
        .expect("run switchyard")
}

fn ok(args: &[&str]) -> String {
    let o = switchyard(args);
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(
        o.status.success(),
        "switchyard {args:?} failed:\n{out}\n{err}"
    );
    out.into_owned()
}

fn fails(args: &[&str]) -> String {
    let o = switchyard(args);
    assert_eq!(o.status.code(), Some(1), "switchyard {args:?} should fail");
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-cli-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

const TINY: [&str; 14] = [
    "--d-model",
    "16",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "8",
    "--batch",
    "4",
    "--microbatches",
    "2",
    "--quiet",
    "--threads-per-worker",
];

fn tiny(extra: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["train"]
        .iter()
        .chain(TINY.iter())
        .map(|s| s.to_string())
        .collect();
    v.push("1".into());
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(|s| s.as_str()).collect()
}

#[test]
fn no_arguments_prints_an_overview() {
    let o = switchyard(&[]);
    let text = String::from_utf8_lossy(&o.stderr).to_string() + &String::from_utf8_lossy(&o.stdout);
    for sub in ["train", "schedule", "eval", "export", "sample"] {
        assert!(text.contains(sub), "{text}");
    }
}

#[test]
fn train_with_a_config_file_writes_metrics_and_checkpoints_then_export_eval_sample() {
    let dir = scratch("train");
    let cfg = dir.join("run.toml");
    let metrics = dir.join("m.jsonl");
    let ckpt = dir.join("ckpt");
    std::fs::write(
        &cfg,
        format!(
            "steps = 4\npp = 2\ntp = 2\nschedule = \"gpipe\"\nmetrics = {:?}\n[model]\nvocab_size = 256\nblock_size = 8\nn_layer = 2\nn_head = 2\nd_model = 16\ntied_embeddings = false\n",
            metrics.to_str().unwrap()
        ),
    )
    .unwrap();
    // Flags override the file: 3 steps, not 4.
    let args = tiny(&[
        "--config",
        cfg.to_str().unwrap(),
        "--steps",
        "3",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ]);
    let out = ok(&strs(&args));
    assert!(
        out.contains("trained 3 steps on 4 workers (dp 1 × pp 2 × tp 2, gpipe)"),
        "{out}"
    );
    assert_eq!(
        std::fs::read_to_string(&metrics).unwrap().lines().count(),
        3
    );

    let model = dir.join("model.safetensors");
    ok(&[
        "export",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--out",
        model.to_str().unwrap(),
    ]);
    let a = ok(&[
        "eval",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--max-windows",
        "8",
        "--json",
    ]);
    let b = ok(&[
        "eval",
        "--checkpoint",
        model.to_str().unwrap(),
        "--max-windows",
        "8",
        "--json",
    ]);
    assert_eq!(a, b);
    let r: serde_json::Value = serde_json::from_str(&a).unwrap();
    assert_eq!(r["windows"], 8);
    assert_eq!(r["tokens"], 8 * 8);
    let text = ok(&[
        "sample",
        "--checkpoint",
        model.to_str().unwrap(),
        "--prompt",
        "In the",
        "--tokens",
        "5",
    ]);
    assert!(
        text.starts_with("In the") && text.trim_end().len() >= 6,
        "{text}"
    );
}

#[test]
fn schedule_reports_json_and_svg() {
    let out = ok(&[
        "schedule",
        "--kind",
        "1f1b",
        "--stages",
        "4",
        "--microbatches",
        "8",
        "--format",
        "json",
    ]);
    let j: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!((j["bubble_fraction"].as_f64().unwrap() - 3.0 / 11.0).abs() < 1e-9);
    assert!(j["makespan"].as_f64().unwrap() > 0.0);
    for (r, rank) in j["ranks"].as_array().unwrap().iter().enumerate() {
        assert_eq!(rank["rank"], r);
        for k in ["busy", "idle", "peak_activations"] {
            assert!(rank.get(k).is_some(), "{k}");
        }
    }
    let svg = ok(&[
        "schedule",
        "--kind",
        "interleaved",
        "--virtual-stages",
        "2",
        "--stages",
        "2",
        "--microbatches",
        "4",
        "--format",
        "svg",
    ]);
    assert!(svg.starts_with("<svg") || svg.contains("<svg"));
    let e = fails(&[
        "schedule",
        "--kind",
        "interleaved",
        "--virtual-stages",
        "2",
        "--stages",
        "4",
        "--microbatches",
        "6",
    ]);
    assert!(e.contains("multiple of 4"), "{e}");
}

#[test]
fn bad_layouts_fail_before_training_with_what_to_change() {
    let e = fails(&strs(&tiny(&["--tp", "4", "--steps", "1"])));
    assert!(
        e.contains("--tp 4 does not divide the 2 attention heads"),
        "{e}"
    );
    let e = fails(&strs(&tiny(&["--pp", "4", "--steps", "1"])));
    assert!(
        e.contains("4 stages but the model has only 2 layers"),
        "{e}"
    );
    let e = fails(&strs(&tiny(&["--dp", "3", "--steps", "1"])));
    assert!(
        e.contains("--batch 4 does not split into --dp 3 × --microbatches 2"),
        "{e}"
    );
    let dir = scratch("bad-toml");
    let cfg = dir.join("typo.toml");
    std::fs::write(&cfg, "[model]\nn_layers = 8\n").unwrap();
    let e = fails(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(e.contains("n_layers"), "{e}");
    let e = fails(&["eval", "--checkpoint", "/nonexistent/switchyard/ckpt"]);
    assert!(e.contains("/nonexistent/switchyard/ckpt"), "{e}");
}
