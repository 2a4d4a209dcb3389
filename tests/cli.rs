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

/// `schedule --execute`: the program runs with synthetic stages on threads. The virtual
/// clock is exact, so its ratios are 1; the sleeping run is only checked for its columns
/// (no timing is asserted: the machine may be loaded).
#[test]
fn schedule_execute_compares_a_run_with_the_simulator() {
    let out = ok(&[
        "schedule",
        "--kind",
        "zb-h1",
        "--stages",
        "4",
        "--microbatches",
        "6",
        "--costs",
        "F=1,I=1,W=1,comm=0.25",
        "--execute",
        "virtual",
    ]);
    assert!(out.contains("virtual clock"), "{out}");
    let makespan = out.lines().find(|l| l.starts_with("makespan")).unwrap();
    assert!(makespan.trim_end().ends_with("1.000"), "{out}");
    let ranks: Vec<&str> = out
        .lines()
        .filter(|l| l.starts_with(|c: char| c.is_ascii_digit()))
        .collect();
    assert_eq!(ranks.len(), 4, "{out}");

    let dir = scratch("execute");
    let csv = dir.join("mine.csv");
    std::fs::write(&csv, "0,0F0,0F1,0B0,0B1\n1,1F0,1B0,1F1,1B1\n").unwrap();
    let csv = csv.to_str().unwrap();
    let out = ok(&[
        "schedule",
        "--from-csv",
        csv,
        "--execute",
        "--unit-ms",
        "0.5",
    ]);
    assert!(out.contains("sleeping, 1 unit = 0.5 ms"), "{out}");
    for row in ["makespan", "bubble"] {
        let line = out.lines().find(|l| l.starts_with(row)).unwrap();
        assert_eq!(line.split_whitespace().count(), 4, "{line}");
    }

    let e = fails(&["schedule", "--execute", "fast"]);
    assert!(e.contains("expected sleep or virtual"), "{e}");
    let e = fails(&["schedule", "--execute", "--format", "json"]);
    assert!(e.contains("--execute prints a text table"), "{e}");
    let e = fails(&["schedule", "--execute", "--unit-ms", "0"]);
    assert!(e.contains("--unit-ms 0"), "{e}");
    let e = fails(&[
        "schedule",
        "--stages",
        "300",
        "--microbatches",
        "300",
        "--execute",
    ]);
    assert!(e.contains("one thread per rank"), "{e}");
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

#[test]
fn toml_keys_of_the_wrong_type_are_errors_naming_the_key_the_file_and_the_type() {
    let dir = scratch("toml-types");
    let cfg = dir.join("bad.toml");
    for (line, want) in [
        (
            "checkpoint_dir = 7",
            "key `checkpoint_dir`: invalid type: integer `7`, expected a string (a path)",
        ),
        (
            "save_every = \"1\"",
            "key `save_every`: invalid type: string \"1\", expected a non-negative integer",
        ),
        (
            "metrics = 5",
            "key `metrics`: invalid type: integer `5`, expected a string (a path)",
        ),
        (
            "keep = -1",
            "key `keep`: invalid value: negative integer `-1`, expected a non-negative integer",
        ),
        (
            "data = true",
            "key `data`: invalid type: boolean `true`, expected a string (a path)",
        ),
        (
            "trace = 1.5",
            "key `trace`: invalid type: floating point `1.5`, expected a string (a path)",
        ),
        (
            "steps = \"3\"",
            "key `steps`: invalid type: string \"3\", expected a non-negative integer",
        ),
        (
            "lr = \"fast\"",
            "key `lr`: invalid type: string \"fast\", expected a number",
        ),
        (
            "dp = -2",
            "key `dp`: invalid value: negative integer `-2`, expected a non-negative integer",
        ),
        (
            "[model]\nn_head = \"4\"",
            "key `model.n_head`: invalid type: string \"4\"",
        ),
        (
            "checkpoint_dirr = \"ckpt\"",
            "unknown field `checkpoint_dirr`",
        ),
    ] {
        std::fs::write(&cfg, line).unwrap();
        let e = fails(&strs(&tiny(&["--config", cfg.to_str().unwrap()])));
        let file = format!("--config {}: ", cfg.display());
        assert!(e.contains(&format!("{file}{want}")), "{line}: {e}");
    }
    // An unknown key's error lists the file-only keys too.
    assert!(fails(&strs(&tiny(&["--config", cfg.to_str().unwrap()])))
        .contains("or one of the file-only keys `data`, `metrics`, `trace`, `checkpoint_dir`"),);
}

#[test]
fn save_every_or_keep_without_a_checkpoint_dir_is_refused() {
    let dir = scratch("no-ckpt-dir");
    for (flag, want) in [("--save-every", "--save-every 2"), ("--keep", "--keep 2")] {
        let e = fails(&strs(&tiny(&[flag, "2", "--steps", "1"])));
        assert!(
            e.contains(&format!("{want} needs --checkpoint-dir")),
            "{flag}: {e}"
        );
    }
    let cfg = dir.join("run.toml");
    for key in ["save_every", "keep"] {
        std::fs::write(&cfg, format!("steps = 1\n{key} = 1\n")).unwrap();
        let e = fails(&strs(&tiny(&["--config", cfg.to_str().unwrap()])));
        assert!(
            e.contains(&format!(
                "`{key} = 1` in --config {} needs --checkpoint-dir",
                cfg.display()
            )),
            "{key}: {e}"
        );
    }
    // With a checkpoint directory from the flag, the file's save_every counts.
    let ckpt = dir.join("ckpt");
    std::fs::write(&cfg, "steps = 2\nsave_every = 1\n").unwrap();
    ok(&strs(&tiny(&[
        "--config",
        cfg.to_str().unwrap(),
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ])));
    assert!(ckpt.join("step-00000001").join("manifest.json").exists());
    assert!(ckpt.join("step-00000002").join("manifest.json").exists());
}

fn listing(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The byte offset where a safetensors file's tensor data starts.
fn data_start(bytes: &[u8]) -> usize {
    8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize
}

#[test]
fn export_refuses_to_overwrite_or_write_into_the_checkpoint_and_leaves_other_files_alone() {
    let dir = scratch("export-safety");
    let ckpt = dir.join("ckpt");
    ok(&strs(&tiny(&[
        "--steps",
        "1",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ])));
    let export = |out: &std::path::Path, force: bool| {
        let mut args = vec![
            "export",
            "--checkpoint",
            ckpt.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        if force {
            args.push("--force");
        }
        switchyard(&args)
    };
    let stderr = |o: &Output| String::from_utf8_lossy(&o.stderr).into_owned();

    // An unrelated notes.tmp beside notes.safetensors survives the export.
    let out = dir.join("notes.safetensors");
    std::fs::write(dir.join("notes.tmp"), b"my notes").unwrap();
    assert!(export(&out, false).status.success());
    assert_eq!(std::fs::read(dir.join("notes.tmp")).unwrap(), b"my notes");
    assert_eq!(listing(&dir), ["ckpt", "notes.safetensors", "notes.tmp"]);

    // An existing --out is refused without --force, and replaced with it.
    std::fs::write(&out, b"precious").unwrap();
    let o = export(&out, false);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("already exists: pass --force to replace it"),
        "{}",
        stderr(&o)
    );
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
    assert!(export(&out, true).status.success());
    assert_ne!(std::fs::read(&out).unwrap(), b"precious");

    // A directory as --out is an error that leaves nothing behind, forced or not.
    let as_dir = dir.join("model");
    std::fs::create_dir(&as_dir).unwrap();
    for force in [false, true] {
        let o = export(&as_dir, force);
        assert_eq!(o.status.code(), Some(1));
        assert!(stderr(&o).contains("is a directory"), "{}", stderr(&o));
    }
    assert!(listing(&as_dir).is_empty());
    assert_eq!(
        listing(&dir),
        ["ckpt", "model", "notes.safetensors", "notes.tmp"]
    );

    // Never into the checkpoint being exported, neither its directory nor a step.
    let before = listing(&ckpt);
    for out in [
        ckpt.join("model.safetensors"),
        ckpt.join("step-00000001").join("model.safetensors"),
    ] {
        let o = export(&out, true);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            stderr(&o).contains("the checkpoint being exported"),
            "{}",
            stderr(&o)
        );
    }
    assert_eq!(listing(&ckpt), before);
    assert!(!ckpt
        .join("step-00000001")
        .join("model.safetensors")
        .exists());
}

#[test]
fn a_damaged_export_is_refused_by_eval_sample_and_init_and_a_foreign_file_loads_with_a_note() {
    let dir = scratch("export-checksum");
    let ckpt = dir.join("ckpt");
    ok(&strs(&tiny(&[
        "--steps",
        "1",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ])));
    let model = dir.join("model.safetensors");
    ok(&[
        "export",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--out",
        model.to_str().unwrap(),
    ]);
    let eval = |f: &std::path::Path| {
        switchyard(&[
            "eval",
            "--checkpoint",
            f.to_str().unwrap(),
            "--max-windows",
            "4",
            "--json",
        ])
    };
    let good = eval(&model);
    assert!(good.status.success());
    assert!(!String::from_utf8_lossy(&good.stderr).contains("note:"));

    // Weights of another shape: the library says what differs, the command which flags.
    let mut other = tiny(&["--steps", "1", "--init", model.to_str().unwrap()]);
    let at = other.iter().position(|a| a == "--layers").unwrap();
    other[at + 1] = "3".into();
    let e = fails(&strs(&other));
    assert!(
        e.contains("but this run builds") && e.contains("pass matching --d-model, --layers"),
        "{e}"
    );

    // 64 flipped bytes in the middle of the tensor data.
    let bytes = std::fs::read(&model).unwrap();
    let mut damaged = bytes.clone();
    let at = (data_start(&bytes) + bytes.len()) / 2;
    for b in &mut damaged[at..at + 64] {
        *b ^= 0xff;
    }
    let bad = dir.join("damaged.safetensors");
    std::fs::write(&bad, &damaged).unwrap();
    let b = bad.to_str().unwrap();
    let init = tiny(&["--steps", "1", "--init", b]);
    for args in [
        vec!["eval", "--checkpoint", b],
        vec!["sample", "--checkpoint", b, "--tokens", "2"],
        strs(&init),
    ] {
        let e = fails(&args);
        assert!(
            e.contains(&format!(
                "{b} is damaged: its tensors' checksum is fnv1a64:"
            )),
            "{args:?}: {e}"
        );
    }

    // The same file without the checksum, as a file made elsewhere would be: accepted,
    // with a note, and it scores the same.
    let mut header: serde_json::Value =
        serde_json::from_slice(&bytes[8..data_start(&bytes)]).unwrap();
    header["__metadata__"]
        .as_object_mut()
        .unwrap()
        .remove("checksum")
        .unwrap();
    let mut h = serde_json::to_vec(&header).unwrap();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut foreign = (h.len() as u64).to_le_bytes().to_vec();
    foreign.extend_from_slice(&h);
    foreign.extend_from_slice(&bytes[data_start(&bytes)..]);
    let plain = dir.join("foreign.safetensors");
    std::fs::write(&plain, &foreign).unwrap();
    let o = eval(&plain);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains(&format!(
            "note: {} has no switchyard checksum",
            plain.display()
        )),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert_eq!(o.stdout, good.stdout);
}

#[test]
fn report_json_holds_every_ranks_measured_memory() {
    let dir = scratch("report-json");
    let path = dir.join("report.json");
    let args = tiny(&[
        "--steps",
        "2",
        "--hidden-dropout",
        "0.1",
        "--report-json",
        path.to_str().unwrap(),
    ]);
    ok(&strs(&args));
    let r: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    assert_eq!(r["layout"]["pp"], 2);
    // The layout's text form, as `--layout` takes it.
    let text = r["layout"]["text"].as_str().unwrap();
    assert!(text.starts_with("dp1 pp2 tp2 "), "{text}");
    let ranks = r["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 4);
    for (i, rank) in ranks.iter().enumerate() {
        assert_eq!(rank["rank"], i);
        let peak = rank["peak_bytes"].as_u64().unwrap();
        let params = rank["bytes_by_category"]["parameters"].as_u64().unwrap();
        assert!(params > 0 && params < peak, "{rank}");
        let predicted = rank["predicted_peak_bytes"].as_u64().unwrap();
        assert!(predicted > params && predicted < 2 * peak, "{rank}");
        assert!(rank["bubble_measured"].is_number(), "{rank}");
        assert!(rank["tokens_per_s"].as_f64().unwrap() > 0.0, "{rank}");
    }
    assert!(r["config"]["model"]["d_model"] == 16);
    assert!(r["config"]["model"]["hidden_dropout"] == 0.1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_model_over_the_memory_budget_is_refused_before_any_step() {
    let args = tiny(&["--steps", "2", "--max-memory-per-worker", "64KiB"]);
    let o = switchyard(&strs(&args));
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    for want in [
        "does not fit",
        "--max-memory-per-worker 64.00 KiB",
        "activations",
    ] {
        assert!(err.contains(want), "{want}: {err}");
    }
    assert!(!String::from_utf8_lossy(&o.stdout).contains("step "));
    let bad = switchyard(&["train", "--max-memory-per-worker", "12 parsecs"]);
    assert_eq!(bad.status.code(), Some(2), "a usage error");
    assert!(String::from_utf8_lossy(&bad.stderr).contains("unknown unit"));
    // A budget it fits trains.
    ok(&strs(&tiny(&[
        "--steps",
        "1",
        "--max-memory-per-worker",
        "1GiB",
    ])));
}

#[test]
fn plan_ranks_the_layouts_that_fit_and_explains_one() {
    let model = [
        "--layers",
        "4",
        "--d-model",
        "32",
        "--heads",
        "4",
        "--seq-len",
        "16",
        "--batch",
        "8",
    ];
    let args = |extra: &[&str]| -> Vec<String> {
        ["plan", "--workers", "4"]
            .iter()
            .chain(model.iter())
            .chain(extra.iter())
            .map(|s| s.to_string())
            .collect()
    };
    let table = ok(&strs(&args(&["--memory-per-worker", "1GiB", "--top", "0"])));
    for want in [
        "dp1 pp2 tp2 1f1b m2",
        "dp4 pp1 tp1 1f1b m2",
        "fits",
        "peak/worker",
    ] {
        assert!(table.contains(want), "{want}: {table}");
    }
    let plan_json = |budget: &str| -> serde_json::Value {
        serde_json::from_str(&ok(&strs(&args(&[
            "--json",
            "--memory-per-worker",
            budget,
        ]))))
        .unwrap()
    };
    let peaks: Vec<u64> = plan_json("1GiB")["layouts"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|l| l["predicted_peak_bytes"].as_u64())
        .collect();
    let (lo, hi) = (*peaks.iter().min().unwrap(), *peaks.iter().max().unwrap());
    assert!(lo < hi);
    let budget = (lo + hi) / 2;
    let json = plan_json(&budget.to_string());
    let layouts = json["layouts"].as_array().unwrap();
    let verdicts: Vec<&str> = layouts
        .iter()
        .map(|l| l["verdict"].as_str().unwrap())
        .collect();
    // A budget between the smallest and the largest splits them, fitting ones first.
    assert!(
        verdicts.contains(&"fits") && verdicts.contains(&"too_big"),
        "{verdicts:?}"
    );
    let first_too_big = verdicts.iter().position(|v| *v != "fits").unwrap();
    assert!(verdicts[first_too_big..].iter().all(|v| *v != "fits"));
    for l in &layouts[..first_too_big] {
        assert!(l["predicted_peak_bytes"].as_u64().unwrap() <= budget, "{l}");
    }
    let explained = ok(&strs(&args(&["--explain", "dp1 pp2 tp2 gpipe m4"])));
    assert!(explained.contains("pp rank 1"), "{explained}");
    let bad = switchyard(&strs(&args(&["--explain", "pp2 sideways"])));
    assert_eq!(bad.status.code(), Some(1));
    // Other hardware: the cluster's memory is the budget, its rates give the times.
    let cluster = concat!(env!("CARGO_MANIFEST_DIR"), "/clusters/dgx-a100-80gb.toml");
    let dgx = ok(&strs(&args(&["--cluster", cluster])));
    assert!(
        dgx.contains("DGX A100 80GB") && dgx.contains("80.00 GiB") && dgx.contains(" ms"),
        "{dgx}"
    );
}

#[test]
fn a_layout_in_one_flag_or_chosen_by_the_planner_trains() {
    // TINY without its --microbatches (a layout says how many).
    let args = |extra: &[&str]| -> Vec<String> {
        let mut v = tiny(&["--steps", "1"]);
        let m = v.iter().position(|a| a == "--microbatches").unwrap();
        v.drain(m..m + 2);
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    let out = ok(&strs(&args(&["--layout", "dp2 pp2 tp1 gpipe m2"])));
    assert!(out.contains("dp 2 × pp 2 × tp 1"), "{out}");
    // Recomputation is part of a layout, or a flag of its own.
    ok(&strs(&args(&["--layout", "pp2 1f1b m2 recompute-full"])));
    ok(&strs(&args(&[
        "--microbatches",
        "2",
        "--recompute",
        "selective",
    ])));
    let twice = switchyard(&strs(&args(&["--layout", "pp2", "--recompute", "full"])));
    assert_eq!(twice.status.code(), Some(2));
    // So are sequence parallelism and ZeRO: the layout's word, not a flag beside it.
    let o = switchyard(&strs(&args(&["--layout", "tp2 1f1b m1 sp"])));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("tp 2 (sequence parallel)"), "{err}");
    for (layout, flag) in [
        ("tp2 m1", vec!["--sequence-parallel"]),
        ("dp2 m1", vec!["--zero", "1"]),
    ] {
        let mut a = vec!["--layout", layout];
        a.extend(flag);
        assert_eq!(switchyard(&strs(&args(&a))).status.code(), Some(2), "{a:?}");
    }
    let o = switchyard(&strs(&args(&["--layout", "auto", "--workers", "2"])));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert!(err.contains("--layout auto chose"), "{err}");
    assert!(String::from_utf8_lossy(&o.stdout).contains("on 2 workers"));
    // The layout flags and --layout exclude each other; --workers needs auto.
    let both = switchyard(&strs(&args(&["--layout", "auto", "--dp", "2"])));
    assert_eq!(both.status.code(), Some(2));
    assert!(fails(&strs(&args(&["--workers", "2"]))).contains("--workers is for --layout auto"));
}
