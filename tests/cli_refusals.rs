//! Bad input to the `switchyard` command: each is refused before any work starts, with a
//! message naming the flag and value (exit status 1; 2 for a value clap cannot parse),
//! never a panic, a hang or an allocation until memory runs out. Where a refusal
//! suggests a change, the change is run and accepted.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};

fn switchyard(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .output()
        .expect("run switchyard")
}

/// Runs and expects exit status `code`; returns standard error.
fn fails_with(code: i32, args: &[&str]) -> String {
    let o = switchyard(args);
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert_eq!(o.status.code(), Some(code), "switchyard {args:?}: {err}");
    assert!(!err.contains("panicked"), "{err}");
    err
}

fn fails(args: &[&str]) -> String {
    fails_with(1, args)
}

fn ok(args: &[&str]) -> String {
    let o = switchyard(args);
    assert!(
        o.status.success(),
        "switchyard {args:?} failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-refusals-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `train` on a tiny model for one step, with `extra` flags (none of which may repeat
/// the ones here).
fn train(extra: &[&str]) -> Vec<String> {
    let base = [
        "train",
        "--d-model",
        "16",
        "--layers",
        "4",
        "--heads",
        "2",
        "--seq-len",
        "8",
        "--steps",
        "1",
        "--quiet",
        "--threads-per-worker",
        "1",
    ];
    base.iter().chain(extra).map(|s| s.to_string()).collect()
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[test]
fn layout_products_that_overflow_are_errors() {
    let e = fails(&["train", "--dp", "9223372036854775809"]);
    assert!(
        e.contains("--dp 9223372036854775809 × --pp 2 × --tp 2 overflows"),
        "{e}"
    );
    let e = fails(&[
        "train",
        "--dp",
        "4294967296",
        "--microbatches",
        "4294967296",
    ]);
    assert!(
        e.contains("--dp 4294967296 × --microbatches 4294967296 overflows"),
        "{e}"
    );
}

#[test]
fn thousands_of_threads_are_refused_with_the_reason() {
    let e = fails(&[
        "train",
        "--dp",
        "100000",
        "--microbatches",
        "1",
        "--batch",
        "100000",
    ]);
    assert!(
        e.contains("400000 workers (--dp 100000 × --pp 2 × --tp 2)") && e.contains("OS thread"),
        "{e}"
    );
    let e = fails(&["train", "--threads-per-worker", "100000"]);
    assert!(
        e.contains("--threads-per-worker 100000 is more than"),
        "{e}"
    );
}

#[test]
fn a_schedule_too_large_to_draw_is_refused() {
    let e = fails(&[
        "schedule",
        "--stages",
        "1000000",
        "--microbatches",
        "1000000",
    ]);
    assert!(
        e.contains(
            "--stages 1000000 × --microbatches 1000000 (× 1 virtual stages) is more than 1048576"
        ),
        "{e}"
    );
}

#[test]
fn a_million_pipeline_ranks_are_refused_by_the_layer_count() {
    let e = fails(&["train", "--pp", "1000000"]);
    assert!(
        e.contains("1000000 stages but the model has only 4 layers"),
        "{e}"
    );
}

#[test]
fn a_model_larger_than_memory_is_refused_with_the_sizes() {
    let e = fails(&["train", "--d-model", "16384", "--layers", "96"]);
    assert!(e.contains("the model does not fit"), "{e}");
    assert!(
        e.contains("6.75 TiB of parameters, gradients and AdamW state"),
        "{e}"
    );
}

#[test]
fn data_that_is_not_a_regular_file_is_refused() {
    let e = fails(&strs(&train(&["--data", "/dev/zero"])));
    assert!(e.contains("--data /dev/zero is not a regular file"), "{e}");
    let dir = scratch("data-dir");
    let e = fails(&strs(&train(&["--data", dir.to_str().unwrap()])));
    assert!(e.contains("is not a regular file"), "{e}");
}

#[test]
fn float_flags_are_checked_by_value_and_named() {
    for (flag, value, says) in [
        ("--lr", "-1", "--lr must be a positive number, got -1"),
        ("--lr", "nan", "--lr must be a positive number, got NaN"),
        ("--lr", "inf", "--lr must be a positive number, got inf"),
        (
            "--min-lr",
            "nan",
            "--min-lr must be a number from 0 to --lr",
        ),
        (
            "--min-lr",
            "-0.1",
            "--min-lr must be a number from 0 to --lr",
        ),
        (
            "--grad-clip",
            "nan",
            "--grad-clip must be a number ≥ 0 (0: off), got NaN",
        ),
        (
            "--weight-decay",
            "nan",
            "--weight-decay must be a number ≥ 0, got NaN",
        ),
        (
            "--weight-decay",
            "-1",
            "--weight-decay must be a number ≥ 0, got -1",
        ),
        (
            "--beta1",
            "1",
            "--beta1 must be at least 0 and below 1, got 1",
        ),
        (
            "--beta1",
            "nan",
            "--beta1 must be at least 0 and below 1, got NaN",
        ),
        (
            "--beta2",
            "-0.5",
            "--beta2 must be at least 0 and below 1, got -0.5",
        ),
        (
            "--beta2",
            "1.5",
            "--beta2 must be at least 0 and below 1, got 1.5",
        ),
        (
            "--hidden-dropout",
            "1",
            "hidden_dropout (--hidden-dropout) must be at least 0 and below 1, got 1",
        ),
        (
            "--hidden-dropout",
            "nan",
            "hidden_dropout (--hidden-dropout) must be at least 0 and below 1, got NaN",
        ),
        ("--eps", "0", "--eps must be a positive number, got 0"),
        ("--eps", "-0.5", "--eps must be a positive number, got -0.5"),
        ("--eps", "inf", "--eps must be a positive number, got inf"),
        (
            "--comm-timeout",
            "inf",
            "--comm-timeout must be a positive number of seconds",
        ),
        (
            "--comm-timeout",
            "-5",
            "--comm-timeout must be a positive number of seconds",
        ),
    ] {
        let e = fails(&["train", flag, value]);
        assert!(e.contains(says), "{flag} {value}: {e}");
    }
    // The `=` form says the same.
    let e = fails(&["train", "--lr=-1"]);
    assert!(e.contains("--lr must be a positive number, got -1"), "{e}");
    let dir = scratch("betas");
    // A setting from the file is named by its flag, or as a key when it has no flag.
    for (key, value, says) in [
        ("beta1", "1.0", "--beta1 must be"),
        ("beta2", "nan", "--beta2 must be"),
        ("eps", "0.0", "--eps must be"),
        ("bucket_mib", "-1.0", "bucket_mib (a --config key) must be"),
    ] {
        let cfg = dir.join(format!("{key}.toml"));
        std::fs::write(&cfg, format!("{key} = {value}\n")).unwrap();
        let e = fails(&["train", "--config", cfg.to_str().unwrap()]);
        assert!(e.contains(says), "{e}");
    }
    // The decay rule is a name: anything else is refused while the flags or the file
    // are read.
    let e = fails_with(2, &["train", "--decay", "biases"]);
    assert!(e.contains("use `matrices`"), "{e}");
    let cfg = dir.join("decay.toml");
    std::fs::write(&cfg, "decay = \"biases\"\n").unwrap();
    let e = fails(&["train", "--config", cfg.to_str().unwrap()]);
    assert!(
        e.contains("key `decay`: unknown variant `biases`, expected `matrices` or `all`"),
        "{e}"
    );
    for t in ["nan", "-1", "inf"] {
        let e = fails(&["sample", "--checkpoint", "/nonexistent", "--temperature", t]);
        assert!(e.contains("--temperature must be a number ≥ 0"), "{t}: {e}");
    }
}

#[test]
fn negative_counts_are_refused_naming_the_flag() {
    for args in [
        &["train", "--steps", "-1"][..],
        &["train", "--dp", "-2"],
        &["bench", "--repeat", "-1"],
        &["eval", "--checkpoint", "x", "--max-windows", "-3"],
        &["sample", "--checkpoint", "x", "--tokens", "-5"],
        &["schedule", "--stages", "-2"],
    ] {
        let (flag, value) = (args[args.len() - 2], args[args.len() - 1]);
        let e = fails_with(2, args);
        assert!(
            e.contains(&format!("{flag} {value}: must be a whole number ≥ 0")),
            "{args:?}: {e}"
        );
    }
}

#[test]
fn bench_refuses_zero_and_offers_microbatches_that_run() {
    for (flag, says) in [
        ("--steps", "--steps must be at least 1"),
        ("--microbatches", "--microbatches must be at least 1"),
        ("--repeat", "--repeat must be at least 1"),
    ] {
        let e = fails(&["bench", "--preset", "tiny", flag, "0"]);
        assert!(e.contains(says), "{flag}: {e}");
    }
    let e = fails(&["bench", "--preset", "tiny", "--microbatches", "3"]);
    assert!(
        e.contains("--microbatches 3 does not divide the tiny preset's batch of 8 sequences: use one of 1, 2, 4, 8"),
        "{e}"
    );
    assert!(!e.contains("--batch"), "{e}");
    let out = ok(&[
        "bench",
        "--preset",
        "tiny",
        "--microbatches",
        "2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--only",
        "pp 2 gpipe",
        "--in-process",
    ]);
    assert!(out.contains("pp 2 gpipe"), "{out}");
}

#[test]
fn interleaving_advice_is_accepted_as_given() {
    let e = fails(&strs(&train(&[
        "--schedule",
        "interleaved",
        "--microbatches",
        "3",
        "--batch",
        "12",
    ])));
    assert!(
        e.contains("use --microbatches 4, or --schedule 1f1b (without --virtual-stages)"),
        "{e}"
    );
    assert!(!e.contains("--virtual-stages 1"), "{e}");
    ok(&strs(&train(&[
        "--schedule",
        "interleaved",
        "--microbatches",
        "4",
        "--batch",
        "12",
    ])));
    ok(&strs(&train(&[
        "--schedule",
        "1f1b",
        "--microbatches",
        "3",
        "--batch",
        "12",
    ])));
}

#[test]
fn csv_schedule_advice_is_accepted_as_given() {
    let dir = scratch("csv");
    // Three stages on two ranks: no --virtual-stages fits, and none is suggested.
    let three = dir.join("three.csv");
    std::fs::write(&three, "0,0F0,2F0,2B0,0B0\n1,1F0,1B0\n").unwrap();
    let e = fails(&strs(&train(&[
        "--schedule",
        three.to_str().unwrap(),
        "--microbatches",
        "1",
        "--batch",
        "2",
    ])));
    assert!(
        e.contains("has 3 stages on 2 ranks: every rank must run the same number of stages"),
        "{e}"
    );
    assert!(
        !e.contains("--virtual-stages 1") && !e.contains("--virtual-stages 0"),
        "{e}"
    );
    // Four stages on two ranks: the suggested --virtual-stages runs.
    let four = dir.join("four.csv");
    std::fs::write(
        &four,
        "0,0F0,0F1,2F0,2F1,2B0,2B1,0B0,0B1\n1,1F0,1F1,3F0,3F1,3B0,3B1,1B0,1B1\n",
    )
    .unwrap();
    let flags = [
        "--schedule",
        four.to_str().unwrap(),
        "--microbatches",
        "2",
        "--batch",
        "4",
    ];
    let e = fails(&strs(&train(&flags)));
    assert!(
        e.contains("has 4 stages on 2 ranks: pass --virtual-stages 2"),
        "{e}"
    );
    let mut with = flags.to_vec();
    with.extend(["--virtual-stages", "2"]);
    ok(&strs(&train(&with)));
    // A path is a schedule file whatever its extension: the same file as .txt runs.
    let txt = dir.join("four.txt");
    std::fs::copy(&four, &txt).unwrap();
    let mut with_txt = with.clone();
    with_txt[1] = txt.to_str().unwrap();
    ok(&strs(&train(&with_txt)));
    // A file that is not there is named, with what the flag takes.
    let gone = dir.join("gone.csv");
    let e = fails(&strs(&train(&["--schedule", gone.to_str().unwrap()])));
    assert!(e.contains("gone.csv: cannot read the schedule file"), "{e}");
    assert!(
        e.contains("gpipe, 1f1b, interleaved, zb-h1 or the path"),
        "{e}"
    );
    // A word that is neither a schedule nor a path is refused as the flag is read.
    let e = fails_with(2, &strs(&train(&["--schedule", "pipedream"])));
    assert!(e.contains("unknown schedule \"pipedream\""), "{e}");
    assert!(e.contains("./pipedream"), "{e}");
}

#[test]
fn eval_refuses_zero_windows_naming_the_flag() {
    let e = fails(&["eval", "--checkpoint", "/nonexistent", "--max-windows", "0"]);
    assert!(e.contains("--max-windows must be at least 1"), "{e}");
    assert!(!e.contains("shorter than"), "{e}");
}

/// `sample` writes each byte as it is generated: the start of a hundred-million-token
/// run can be read while it is still going.
#[test]
fn sample_streams_its_text() {
    let dir = scratch("sample");
    let ckpt = dir.join("ckpt");
    ok(&strs(&train(&[
        "--pp",
        "1",
        "--tp",
        "1",
        "--batch",
        "2",
        "--microbatches",
        "1",
        "--checkpoint-dir",
        ckpt.to_str().unwrap(),
    ])));
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["sample", "--checkpoint", ckpt.to_str().unwrap()])
        .args([
            "--prompt",
            "In the",
            "--tokens",
            "100000000",
            "--temperature",
            "0",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("start switchyard sample");
    let mut out = child.stdout.take().unwrap();
    // Before the fix nothing came until all the tokens were done: this read would wait.
    let mut got = Vec::new();
    let mut buf = [0u8; 64];
    while got.len() < "In the".len() + 16 {
        let n = out.read(&mut buf).expect("read the sample");
        assert!(n > 0, "sample ended early: {got:?}");
        got.extend_from_slice(&buf[..n]);
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(got.starts_with(b"In the"), "{got:?}");
}

/// `--device` a build has no backend for is refused naming the cargo feature (this
/// build has neither GPU backend), before the data is read; a bad name is a clap error.
/// `--ops composed` (and `ops = "composed"` in a config file) trains on the CPU.
#[test]
fn devices_without_a_backend_are_refused_and_the_composed_ops_train() {
    if !candle_core::utils::cuda_is_available() {
        let e = fails(&strs(&train(&[
            "--device",
            "cuda:1",
            "--data",
            "/nonexistent",
        ])));
        assert!(
            e.contains("--device cuda:1") && e.contains("--features cuda"),
            "{e}"
        );
    }
    if !candle_core::utils::metal_is_available() {
        let dir = scratch("device-toml");
        let cfg = dir.join("run.toml");
        std::fs::write(&cfg, "device = \"metal\"\n").unwrap();
        let e = fails(&strs(&train(&["--config", cfg.to_str().unwrap()])));
        assert!(e.contains("--features metal"), "{e}");
    }
    let e = fails_with(2, &strs(&train(&["--device", "gpu"])));
    assert!(e.contains("expected cpu, cuda, cuda:N"), "{e}");
    let e = fails_with(2, &strs(&train(&["--ops", "gpu"])));
    assert!(e.contains("\"fused\" or \"composed\""), "{e}");
    ok(&strs(&train(&["--ops", "composed", "--device", "cpu"])));
    let dir = scratch("ops-toml");
    let cfg = dir.join("run.toml");
    std::fs::write(&cfg, "ops = \"composed\"\ndevice = \"cpu\"\n").unwrap();
    ok(&strs(&train(&["--config", cfg.to_str().unwrap()])));
    std::fs::write(&cfg, "ops = \"gpu\"\n").unwrap();
    let e = fails(&strs(&train(&["--config", cfg.to_str().unwrap()])));
    assert!(
        e.contains("key `ops`") && e.contains("\"fused\" or \"composed\""),
        "{e}"
    );
}

#[test]
fn an_unknown_zero_stage_is_refused_and_zero_two_and_three_train() {
    let e = fails(&strs(&train(&["--zero", "5"])));
    assert!(e.contains("--zero 5: there is no ZeRO stage 5"), "{e}");
    for zero in ["2", "3"] {
        let t = train(&[
            "--zero", zero, "--dp", "2", "--pp", "1", "--tp", "1", "--batch", "8",
        ]);
        let out = ok(&strs(&t));
        assert!(
            out.contains(&format!("(dp 2 × pp 1 × tp 1, 1f1b, ZeRO {zero})")),
            "{out}"
        );
    }
}
