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

use candle_core::{Device, Tensor};
use serde::Deserialize;
use switchyard::models::GptConfig;
use switchyard::pipeline::Stage;
use switchyard::train::export::Integrity;
use switchyard::train::weights::Weights;

mod common;
use common::{fails, ok, scratch, tiny};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
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

/// Trains the tiny model 3 steps and exports it as a transformers directory at `out`.
fn train_and_export(tied: bool, out: &Path) {
    let ckpt = scratch(&format!("hf-ckpt-{tied}"));
    let mut args = tiny(&["--steps", "3", "--checkpoint-dir", ckpt.to_str().unwrap()]);
    if tied {
        args.push("--tied".into());
    }
    ok(&args);
    ok(&strings(&[
        "export",
        "--checkpoint",
        ckpt.to_str().unwrap(),
        "--format",
        "hf-gpt2",
        "--out",
        out.to_str().unwrap(),
        "--force",
    ]));
    std::fs::remove_dir_all(&ckpt).unwrap();
}

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| s.to_string()).collect()
}

/// Every tensor's name and shape, sorted.
fn shapes(tensors: &HashMap<String, Tensor>) -> Vec<(String, Vec<usize>)> {
    let mut v: Vec<_> = tensors
        .iter()
        .map(|(n, t)| (n.clone(), t.dims().to_vec()))
        .collect();
    v.sort();
    v
}

#[test]
fn switchyard_exports_are_what_transformers_loads() {
    let write = std::env::var_os("SWITCHYARD_WRITE_HF_EXPORTS").is_some();
    for (tied, name) in [(true, "hf-export-tied"), (false, "hf-export-untied")] {
        let committed = fixture(name);
        let fresh = scratch(&format!("hf-{name}")).join("export");
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
        let read = |d: &Path, f: &str| std::fs::read(d.join(f)).unwrap();
        let json = |d: &Path| -> serde_json::Value {
            serde_json::from_slice(&read(d, "config.json")).unwrap()
        };
        assert_eq!(
            json(&fresh),
            json(&committed),
            "{name}: config.json changed"
        );
        let file = |d: &Path| {
            candle_core::safetensors::load_buffer(&read(d, "model.safetensors"), &Device::Cpu)
                .unwrap()
        };
        assert_eq!(
            shapes(&file(&fresh)),
            shapes(&file(&committed)),
            "{name}: tensors changed"
        );
        assert_eq!(shapes(&load(&fresh).tensors), shapes(&w.tensors));
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
    // No model flags: the directory's config.json gives the model. One worker, then the
    // default layout (pp 2 × tp 2).
    let one = tiny(&["--steps", "2", "--pp", "1", "--tp", "1", "--init", d]);
    let (out, _) = ok(&one);
    assert!(out.contains("on 1 workers"), "{out}");
    let (out, _) = ok(&tiny(&["--steps", "2", "--init", d]));
    assert!(out.contains("dp 1 × pp 2 × tp 2"), "{out}");
    let (out, _) = ok(&strings(&[
        "eval",
        "--checkpoint",
        d,
        "--max-windows",
        "4",
        "--seq-len",
        "8",
        "--json",
    ]));
    assert!(out.contains("\"windows\":4"), "{out}");
    ok(&strings(&["sample", "--checkpoint", d, "--tokens", "4"]));
    // Another shape than the directory's: refused, naming the flags.
    let mut wrong = tiny(&["--steps", "1", "--init", d]);
    let at = wrong.iter().position(|a| a == "--d-model").unwrap();
    wrong[at + 1] = "32".into();
    let e = fails(&wrong);
    assert!(e.contains("pass matching --d-model"), "{e}");
}
