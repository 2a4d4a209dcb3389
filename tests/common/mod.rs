//! Shared by the end-to-end tests: the `switchyard` binary at a tiny size.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

pub fn switchyard(args: &[String]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .output()
        .expect("run switchyard")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Runs `args`, which must succeed; returns (stdout, stderr).
pub fn ok(args: &[String]) -> (String, String) {
    let o = switchyard(args);
    let (out, err) = (text(&o.stdout), text(&o.stderr));
    assert!(
        o.status.success(),
        "switchyard {args:?} failed:\n{out}\n{err}"
    );
    (out, err)
}

/// Runs `args`, which must fail with status 1; returns stderr.
pub fn fails(args: &[String]) -> String {
    let o = switchyard(args);
    assert_eq!(o.status.code(), Some(1), "switchyard {args:?} should fail");
    text(&o.stderr)
}

pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-e2e-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `switchyard train` with a tiny model, then `extra`.
pub fn tiny(extra: &[&str]) -> Vec<String> {
    [
        "train",
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
        "1",
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect()
}

/// The JSON lines of a metrics file.
pub fn metrics(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
