//! Hugging Face `transformers` interop, against fixtures made by
//! `scripts/hf-gpt2-fixture.py` (CI runs no Python; the fixtures are committed):
//!
//! * `tests/fixtures/hf-gpt2-tiny/`: a tiny random `GPT2LMHeadModel` saved with
//!   `save_pretrained`; `hf-gpt2-tiny.json` its logits and loss as transformers computes
//!   them. Switchyard starting from it computes the same, to 1e-5.
//! * `tests/fixtures/hf-export-{tied,untied}/`: switchyard's own `export --format
//!   hf-gpt2` of a trained tiny model; `hf-export-*.json` the logits and loss of that
//!   directory as transformers loads it (the script's `check` fails on any missing or
//!   unexpected key). Switchyard's forward pass of the same directory matches them.
//!
//! To remake the exports (when the format changes): `SWITCHYARD_WRITE_HF_EXPORTS=1 cargo
//! test --test hf_gpt2`, then `.venv/bin/python scripts/hf-gpt2-fixture.py check`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{Device, Tensor};
use serde::Deserialize;
use switchyard::models::GptConfig;
use switchyard::pipeline::Stage;
use switchyard::train::export::Integrity;
use switchyard::train::weights::Weights;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-hf-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[derive(Deserialize)]
struct Scores {
    inputs: Vec<Vec<u32>>,
    targets: Vec<Vec<u32>>,
    logits_shape: Vec<usize>,
    logits: Vec<f32>,
    loss: f64,
}

fn scores(name: &str) -> Scores {
    serde_json::from_slice(&std::fs::read(fixture(name)).unwrap()).unwrap()
}

fn load(dir: &Path) -> Weights<GptConfig> {
    Weights::load(dir, &GptConfig::default()).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

/// Switchyard's logits and loss of `w` on the windows of `s`, and how far they are from
/// transformers' (largest logit difference relative to the largest logit; loss relative).
fn compare(w: &Weights<GptConfig>, s: &Scores) -> (f64, f64) {
    let model = w.model().unwrap();
    let x = Tensor::new(s.inputs.clone(), &Device::Cpu).unwrap();
    let y = Tensor::new(s.targets.clone(), &Device::Cpu).unwrap();
    let logits = model.forward(&x).unwrap();
    assert_eq!(
        logits.elem_count(),
        s.logits_shape.iter().product::<usize>()
    );
    let got = logits.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let scale = s.logits.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
    let diff = got
        .iter()
        .zip(&s.logits)
        .fold(0f64, |m, (a, b)| m.max((a - b).abs() as f64));
    let loss = model.loss(&logits, &y).unwrap().to_scalar::<f32>().unwrap() as f64;
    (diff / scale, (loss - s.loss).abs() / s.loss)
}

fn tensors_equal(a: &HashMap<String, Tensor>, b: &HashMap<String, Tensor>) -> bool {
    let bytes = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    a.len() == b.len()
        && a.iter().all(|(n, t)| {
            b.get(n)
                .is_some_and(|u| t.dims() == u.dims() && bytes(t) == bytes(u))
        })
}

#[test]
fn a_transformers_model_loads_with_its_config_and_computes_the_same_logits_and_loss() {
    let w = load(&fixture("hf-gpt2-tiny"));
    assert_eq!(
        w.config,
        GptConfig {
            vocab_size: 256,
            block_size: 16,
            n_layer: 2,
            n_head: 2,
            d_model: 16,
            tied_embeddings: true,
            ..GptConfig::default()
        }
    );
    assert_eq!(
        w.integrity,
        Integrity::Unverified,
        "transformers writes no checksum"
    );
    let (logits, loss) = compare(&w, &scores("hf-gpt2-tiny.json"));
    assert!(logits <= 1e-5, "logits differ by {logits:.2e} (relative)");
    assert!(loss <= 1e-5, "loss differs by {loss:.2e} (relative)");
}

#[test]
fn export_load_export_keeps_every_tensor_and_the_config() {
    let w = load(&fixture("hf-gpt2-tiny"));
    let dir = scratch("round-trip");
    let (a, b) = (dir.join("a"), dir.join("b"));
    w.export_hf(&a, &[("tokenizer.json", b"{}".to_vec())], false)
        .unwrap();
    let wa = load(&a);
    assert_eq!(
        wa.integrity,
        Integrity::Checksum,
        "our export carries a checksum"
    );
    assert_eq!(wa.config, w.config);
    assert!(tensors_equal(&wa.tensors, &w.tensors));
    wa.export_hf(&b, &[], false).unwrap();
    let read = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap();
    assert_eq!(read(&a, "config.json"), read(&b, "config.json"));
    assert_eq!(read(&a, "tokenizer.json"), b"{}");
    let st = |d: &Path| {
        candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap()
    };
    assert!(tensors_equal(&st(&a), &st(&b)), "export → load → export");
    // An existing directory is kept unless forced, and then replaced whole.
    let e = wa.export_hf(&b, &[], false).unwrap_err().to_string();
    assert!(e.contains("already exists: pass --force"), "{e}");
    wa.export_hf(&b, &[], true).unwrap();
    assert!(!b.join("tokenizer.json").exists());
    let leftovers: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

fn switchyard(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let o = switchyard(args);
    assert!(
        o.status.success(),
        "switchyard {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

const TINY: [&str; 13] = [
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
];

/// Trains the tiny model 3 steps and exports it as a transformers directory at `out`.
fn train_and_export(tied: bool, out: &Path) {
    let ckpt = scratch(&format!("ckpt-{tied}"));
    let mut args: Vec<&str> = vec!["train"];
    args.extend(TINY);
    args.extend(["--steps", "3", "--threads-per-worker", "1"]);
    args.extend(["--checkpoint-dir", ckpt.to_str().unwrap()]);
    if tied {
        args.push("--tied");
    }
    ok(&args);
    let mut export = vec!["export", "--checkpoint", ckpt.to_str().unwrap()];
    export.extend([
        "--format",
        "hf-gpt2",
        "--out",
        out.to_str().unwrap(),
        "--force",
    ]);
    ok(&export);
    std::fs::remove_dir_all(&ckpt).unwrap();
}

#[test]
fn switchyard_exports_are_what_transformers_loads() {
    let write = std::env::var_os("SWITCHYARD_WRITE_HF_EXPORTS").is_some();
    for (tied, name) in [(true, "hf-export-tied"), (false, "hf-export-untied")] {
        let committed = fixture(name);
        let fresh = scratch(name).join("export");
        train_and_export(tied, &fresh);
        if write {
            train_and_export(tied, &committed);
            continue;
        }
        // The committed export is what transformers loaded (scripts/hf-gpt2-fixture.py
        // check): the same logits and loss from switchyard's forward pass.
        let w = load(&committed);
        assert_eq!(w.config.tied_embeddings, tied);
        let (logits, loss) = compare(&w, &scores(&format!("{name}.json")));
        assert!(logits <= 1e-5, "{name}: logits differ by {logits:.2e}");
        assert!(loss <= 1e-5, "{name}: loss differs by {loss:.2e}");
        // And today's export has the same form (names, shapes, config), so what the
        // script checked still describes it. (Values depend on the CPU's kernels.)
        let json = |d: &Path| -> serde_json::Value {
            serde_json::from_slice(&std::fs::read(d.join("config.json")).unwrap()).unwrap()
        };
        assert_eq!(
            json(&fresh),
            json(&committed),
            "{name}: config.json changed"
        );
        let shapes = |w: &Weights<GptConfig>| -> Vec<(String, Vec<usize>)> {
            let mut v: Vec<_> = w
                .tensors
                .iter()
                .map(|(n, t)| (n.clone(), t.dims().to_vec()))
                .collect();
            v.sort();
            v
        };
        let st_names = |d: &Path| -> Vec<(String, Vec<usize>)> {
            let m =
                candle_core::safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap();
            let mut v: Vec<_> = m
                .iter()
                .map(|(n, t)| (n.clone(), t.dims().to_vec()))
                .collect();
            v.sort();
            v
        };
        assert_eq!(
            st_names(&fresh),
            st_names(&committed),
            "{name}: tensors changed"
        );
        assert_eq!(shapes(&load(&fresh)), shapes(&w));
        std::fs::remove_dir_all(fresh.parent().unwrap()).unwrap();
    }
    assert!(
        !write,
        "wrote the exports: now run scripts/hf-gpt2-fixture.py check"
    );
}

#[test]
fn train_eval_and_sample_start_from_a_transformers_directory() {
    let dir = fixture("hf-gpt2-tiny");
    let d = dir.to_str().unwrap();
    let mut args: Vec<&str> = vec!["train"];
    args.extend(TINY);
    args.extend([
        "--steps",
        "2",
        "--threads-per-worker",
        "1",
        "--tied",
        "--init",
        d,
    ]);
    ok(&args);
    // The same on a layout with a tensor-parallel and a pipeline axis.
    args.extend(["--pp", "2", "--tp", "2"]);
    ok(&args);
    let out = ok(&[
        "eval",
        "--checkpoint",
        d,
        "--max-windows",
        "4",
        "--seq-len",
        "8",
        "--json",
    ]);
    assert!(out.contains("\"windows\":4"), "{out}");
    ok(&["sample", "--checkpoint", d, "--tokens", "4"]);
    // Another shape than the directory's: refused, naming the flags.
    let mut wrong: Vec<&str> = vec!["train"];
    wrong.extend(TINY);
    wrong[2] = "32";
    wrong.extend(["--steps", "1", "--tied", "--init", d]);
    let o = switchyard(&wrong);
    assert!(!o.status.success());
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(e.contains("pass matching --d-model"), "{e}");
}
