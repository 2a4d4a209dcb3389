//! Checkpoints: bit-exact resume, resume on other layouts, export and `--init`, crashes
//! in the middle of a save, corrupt inputs — and that a failed load never changes disk.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::common::*;
use switchyard_models::GptConfig;
use switchyard_train::checkpoint::{self, Checkpoint};
use switchyard_train::data::Corpus;
use switchyard_train::weights::{evaluate, Integrity, Weights};
use switchyard_train::{train, Resume, TrainConfig, TrainOptions, TrainReport};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A run of 8 steps with a fixed global batch of 8 sequences, whatever the layout.
fn run_cfg(dp: usize, pp: usize, tp: usize, schedule: &str) -> TrainConfig<GptConfig> {
    let mut c = tiny(dp, pp, tp, schedule);
    c.batch = 8;
    c.steps = 8;
    c
}

fn run(
    cfg: &TrainConfig<GptConfig>,
    dir: &Path,
    save_every: usize,
    resume: Option<Resume>,
) -> anyhow::Result<TrainReport> {
    let opts = TrainOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        save_every,
        keep: 0,
        resume,
        ..TrainOptions::default()
    };
    Ok(train(cfg, &Corpus::bundled(), &opts)?)
}

fn losses(r: &TrainReport) -> Vec<f64> {
    r.steps.iter().map(|s| s.loss).collect()
}

/// Every file under `dir` with its size and hash.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, (u64, String)> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let b = std::fs::read(&p).unwrap();
                out.insert(p, (b.len() as u64, checkpoint::fnv64(&b)));
            }
        }
    }
    out
}

#[test]
fn resume_on_the_same_layout_is_bit_exact() {
    let dir = scratch("same");
    let cfg = run_cfg(1, 2, 2, "1f1b");
    let full = losses(&run(&cfg, &dir, 4, None).unwrap());
    let resumed = losses(&run(&cfg, &dir, 0, Some(Resume::Step(4))).unwrap());
    assert_eq!(resumed.len(), 4);
    assert_eq!(
        resumed,
        full[4..],
        "the losses after resume must be identical"
    );
}

#[test]
fn resume_on_another_layout_continues_the_same_run() {
    for ((from, fs), (to, ts)) in [
        (((1, 2, 2), "1f1b"), ((1, 1, 1), "1f1b")),
        (((1, 1, 1), "1f1b"), ((2, 2, 1), "1f1b")),
        (((1, 2, 1), "1f1b"), ((1, 4, 1), "interleaved")),
    ] {
        let dir = scratch(&format!("reshard-{from:?}-{to:?}"));
        let a = run_cfg(from.0, from.1, from.2, fs);
        let full = losses(&run(&a, &dir, 4, None).unwrap());
        let b = run_cfg(to.0, to.1, to.2, ts);
        let resumed = losses(&run(&b, &dir, 0, Some(Resume::Step(4))).unwrap());
        for (k, (r, f)) in resumed.iter().zip(&full[4..]).enumerate() {
            let e = (r - f).abs() / f.abs();
            assert!(
                e <= 1e-5,
                "{from:?} {fs} → {to:?} {ts}: step {} loss {r} vs {f} ({e:.2e})",
                k + 4
            );
        }
    }
}

#[test]
fn export_then_init_gives_the_same_loss() {
    let dir = scratch("export");
    let mut cfg = run_cfg(1, 2, 2, "1f1b");
    cfg.model.tied_embeddings = true;
    cfg.steps = 3;
    run(&cfg, &dir, 0, None).unwrap();
    let from_ckpt = Weights::load(&dir, &cfg.model).unwrap();
    let file = dir.join("model.safetensors");
    from_ckpt.export(&file).unwrap();
    let from_file = Weights::load(&file, &GptConfig::default()).unwrap(); // the config comes from the file's metadata
    assert_eq!(from_file.config, cfg.model);
    assert_eq!(from_file.integrity, Integrity::Checksum);
    assert_eq!(from_ckpt.integrity, Integrity::Checkpoint);
    // PyTorch's nanoGPT state dict has both names of a tied table.
    let raw = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
    assert!(raw.contains_key("lm_head.weight") && raw.contains_key("transformer.wte.weight"));
    let corpus = Corpus::bundled();
    let a = evaluate(&from_ckpt, &corpus, 8, Some(32)).unwrap();
    let b = evaluate(&from_file, &corpus, 8, Some(32)).unwrap();
    assert_eq!(a.nats_per_byte, b.nats_per_byte);
    // A new run from the file starts from exactly these weights.
    let mut fresh = cfg.clone();
    fresh.steps = 1;
    let opts = TrainOptions {
        init: Some(file.clone()),
        ..TrainOptions::default()
    };
    let started = train(&fresh, &corpus, &opts).unwrap().steps[0].loss;
    let (want, _) = reference_step(&fresh, &from_file.tensors, 0);
    assert!((started - want).abs() / want <= 1e-5, "{started} vs {want}");
}

#[test]
fn a_bf16_export_is_half_the_bytes_and_loads_as_the_rounded_weights() {
    let dir = scratch("export-bf16");
    let mut cfg = run_cfg(1, 1, 1, "1f1b");
    cfg.steps = 2;
    run(&cfg, &dir, 0, None).unwrap();
    let w = Weights::load(&dir, &cfg.model).unwrap();
    let (f32_file, bf16_file) = (dir.join("f32.safetensors"), dir.join("bf16.safetensors"));
    w.export(&f32_file).unwrap();
    w.to_dtype(candle_core::DType::BF16)
        .unwrap()
        .export(&bf16_file)
        .unwrap();
    let raw = candle_core::safetensors::load(&bf16_file, &candle_core::Device::Cpu).unwrap();
    assert!(raw.values().all(|t| t.dtype() == candle_core::DType::BF16));
    let size = |p: &std::path::Path| std::fs::metadata(p).unwrap().len() as f64;
    let ratio = size(&bf16_file) / size(&f32_file);
    assert!(
        (0.49..0.55).contains(&ratio),
        "bf16 export is {ratio:.3} of f32's bytes"
    );
    // It loads (checksum verified) as f32, every value the nearest bf16 of the master's.
    let back = Weights::load(&bf16_file, &GptConfig::default()).unwrap();
    assert_eq!(back.integrity, Integrity::Checksum);
    assert_eq!(back.config, cfg.model);
    for (name, t) in &w.tensors {
        let want = t.to_dtype(candle_core::DType::BF16).unwrap();
        let want = want.to_dtype(candle_core::DType::F32).unwrap();
        let got = &back.tensors[name];
        assert_eq!(got.dtype(), candle_core::DType::F32);
        let diff = (got - &want).unwrap().abs().unwrap().max_all().unwrap();
        assert_eq!(diff.to_scalar::<f32>().unwrap(), 0.0, "{name}");
    }
    assert!(w.to_dtype(candle_core::DType::F16).is_err());
    let corpus = Corpus::bundled();
    let a = evaluate(&w, &corpus, 8, Some(32)).unwrap().nats_per_byte;
    let b = evaluate(&back, &corpus, 8, Some(32)).unwrap().nats_per_byte;
    assert!(
        (a - b).abs() / a < 1e-2,
        "eval {a} (f32) vs {b} (bf16 export)"
    );
}

#[test]
fn an_interrupted_save_leaves_the_previous_checkpoint_loadable() {
    let dir = scratch("interrupted");
    let cfg = run_cfg(1, 2, 2, "1f1b");
    run(&cfg, &dir, 4, None).unwrap();
    let before = Checkpoint::find(&dir, None).unwrap().manifest.step;
    assert_eq!(before, 8);
    // A later save that stopped between files: one rank's shards written, no manifest.
    let staging = checkpoint::staging_dir(&dir, 12);
    std::fs::create_dir_all(&staging).unwrap();
    let ckpt = Checkpoint::find(&dir, None).unwrap();
    std::fs::copy(
        ckpt.path.join("pp0-tp0.safetensors"),
        staging.join("pp0-tp0.safetensors"),
    )
    .unwrap();
    // And one that stopped after its manifest but before the rename.
    let staging = checkpoint::staging_dir(&dir, 16);
    std::fs::create_dir_all(&staging).unwrap();
    std::fs::copy(
        ckpt.path.join(checkpoint::MANIFEST),
        staging.join(checkpoint::MANIFEST),
    )
    .unwrap();
    let found = Checkpoint::find(&dir, None).unwrap();
    assert_eq!(found.manifest.step, 8);
    found.load_full().unwrap();
    let mut more = cfg.clone();
    more.steps = 10;
    let r = run(&more, &dir, 0, Some(Resume::Latest)).unwrap();
    assert_eq!(r.steps.first().unwrap().step, 8);
    // The next successful save cleans up the garbage.
    assert!(!checkpoint::staging_dir(&dir, 12).exists());
}

#[test]
fn only_the_newest_checkpoints_are_kept() {
    let dir = scratch("keep");
    let mut cfg = run_cfg(1, 1, 1, "1f1b");
    cfg.steps = 5;
    let opts = TrainOptions {
        checkpoint_dir: Some(dir.clone()),
        save_every: 1,
        keep: 2,
        ..TrainOptions::default()
    };
    train(&cfg, &Corpus::bundled(), &opts).unwrap();
    let steps: Vec<usize> = checkpoint::complete_steps(&dir)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(steps, [4, 5]);
}

/// Resuming from a damaged `dir` fails with a message containing `want`, and changes
/// nothing on disk.
fn assert_refused(dir: &Path, cfg: &TrainConfig<GptConfig>, want: &str) {
    let before = snapshot(dir);
    let e = run(cfg, dir, 1, Some(Resume::Latest))
        .unwrap_err()
        .to_string();
    assert!(e.contains(want), "expected {want:?} in: {e}");
    assert_eq!(
        snapshot(dir),
        before,
        "a failed resume changed the checkpoint directory"
    );
}

#[test]
fn corrupt_inputs_are_clear_errors_and_change_nothing() {
    let cfg = run_cfg(1, 2, 2, "1f1b");
    let fresh = |name: &str| {
        let dir = scratch(name);
        let mut c = cfg.clone();
        c.steps = 2;
        run(&c, &dir, 0, None).unwrap();
        let path = Checkpoint::find(&dir, None).unwrap().path;
        (dir, path)
    };

    let (dir, ck) = fresh("truncated");
    let f = ck.join("pp1-tp0.safetensors");
    let b = std::fs::read(&f).unwrap();
    std::fs::write(&f, &b[..b.len() / 2]).unwrap();
    assert_refused(&dir, &cfg, "pp1-tp0.safetensors is truncated or corrupt");

    let (dir, ck) = fresh("flipped");
    let f = ck.join("pp0-tp1.safetensors");
    let mut b = std::fs::read(&f).unwrap();
    let last = b.len() - 1;
    b[last] ^= 0x55;
    std::fs::write(&f, &b).unwrap();
    assert_refused(&dir, &cfg, "pp0-tp1.safetensors is corrupt: its checksum");

    let (dir, ck) = fresh("missing");
    std::fs::remove_file(ck.join("pp1-tp1.safetensors")).unwrap();
    assert_refused(
        &dir,
        &cfg,
        "is missing pp1-tp1.safetensors listed in its manifest",
    );

    let (dir, _) = fresh("other-model");
    let mut other = cfg.clone();
    other.model.d_model = 32;
    assert_refused(&dir, &other, "holds a model");

    // A shard whose tensor does not have the shape its manifest records.
    let (dir, ck) = fresh("shape");
    let mpath = ck.join(checkpoint::MANIFEST);
    let mut m: checkpoint::Manifest =
        serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m.files[0].tensors[0].shape[0] += 1;
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    assert_refused(&dir, &cfg, "the manifest says");

    // A manifest whose step is not its directory's.
    let (dir, ck) = fresh("step");
    let mpath = ck.join(checkpoint::MANIFEST);
    let mut m: checkpoint::Manifest =
        serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m.step = 7;
    std::fs::write(&mpath, serde_json::to_vec(&m).unwrap()).unwrap();
    assert_refused(&dir, &cfg, "says step 7, but its directory is step 2");

    let (dir, ck) = fresh("manifest");
    std::fs::write(ck.join(checkpoint::MANIFEST), b"{ not json").unwrap();
    assert_refused(&dir, &cfg, "is not a valid switchyard manifest");
}

#[test]
fn an_init_file_of_the_wrong_shapes_is_refused_by_name() {
    let dir = scratch("init-shapes");
    let mut small = run_cfg(1, 1, 1, "1f1b");
    small.steps = 1;
    run(&small, &dir, 0, None).unwrap();
    let file = dir.join("small.safetensors");
    Weights::load(&dir, &small.model)
        .unwrap()
        .export(&file)
        .unwrap();
    let mut big = small.clone();
    big.model.d_model = 32;
    let opts = TrainOptions {
        init: Some(file),
        ..TrainOptions::default()
    };
    let e = train(&big, &Corpus::bundled(), &opts)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("small.safetensors holds a model") && e.contains("d_model: 32"),
        "{e}"
    );
}

#[test]
fn a_nanogpt_state_dict_without_metadata_loads_with_its_tied_head() {
    let dir = scratch("nanogpt");
    let mut cfg = run_cfg(1, 1, 1, "1f1b");
    cfg.model.tied_embeddings = true;
    cfg.steps = 1;
    run(&cfg, &dir, 0, None).unwrap();
    let w = Weights::load(&dir, &cfg.model).unwrap();
    // As PyTorch would save it: both names of the table, no switchyard metadata.
    let mut map = w.tensors.clone();
    map.insert(
        "lm_head.weight".into(),
        map["transformer.wte.weight"].clone(),
    );
    map.insert(
        "transformer.h.0.attn.bias".into(),
        candle_core::Tensor::ones(
            (1, 1, 8, 8),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap(),
    );
    let file = dir.join("torch.safetensors");
    candle_core::safetensors::save(&map, &file).unwrap();
    let back = Weights::load(&file, &cfg.model).unwrap();
    assert_eq!(back.config, cfg.model);
    // No checksum: it loads, unverified, with a note for the user.
    assert_eq!(back.integrity, Integrity::Unverified);
    assert!(back
        .note(&file)
        .unwrap()
        .contains("has no switchyard checksum"));
    assert!(!back.tensors.contains_key("lm_head.weight"));
}

/// [`run_cfg`] over 257 ids (which tp = 2 and 3 pad to 258 rows), 6 heads.
fn vocab_257(pp: usize, tp: usize, tied: bool) -> TrainConfig<GptConfig> {
    let mut c = run_cfg(1, pp, tp, "1f1b");
    c.model.vocab_size = 257;
    c.model.d_model = 24;
    c.model.n_head = 6;
    c.model.tied_embeddings = tied;
    c
}

#[test]
fn a_padded_vocabulary_reshards_between_degrees() {
    for tied in [false, true] {
        let dir = scratch(&format!("vocab-257-{tied}"));
        let full = losses(&run(&vocab_257(1, 2, tied), &dir, 4, None).unwrap());
        // The checkpoint holds the logical [257, d] tables, whatever the padding.
        let ck = Checkpoint::open(&checkpoint::step_dir(&dir, 4)).unwrap();
        let state = ck.load_full().unwrap();
        for name in ["transformer.wte.weight", "lm_head.weight"] {
            if let Some(t) = state.params.get(name) {
                assert_eq!(t.dims(), [257, 24], "{name}");
                assert_eq!(state.m[name].dims(), [257, 24], "{name} moments");
            }
        }
        for (pp, tp) in [(1, 1), (1, 3), (2, 3)] {
            let resumed =
                losses(&run(&vocab_257(pp, tp, tied), &dir, 0, Some(Resume::Step(4))).unwrap());
            assert_eq!(resumed.len(), 4);
            for (k, (r, f)) in resumed.iter().zip(&full[4..]).enumerate() {
                let e = (r - f).abs() / f.abs();
                assert!(
                    e <= 1e-5,
                    "V 257 tied {tied}: tp 2 → pp {pp} tp {tp}: step {} loss {r} vs {f} ({e:.2e})",
                    k + 4
                );
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn a_padded_vocabulary_exports_its_logical_tables() {
    let dir = scratch("vocab-257-export");
    let cfg = vocab_257(1, 2, false);
    let mut cfg = cfg;
    cfg.steps = 2;
    run(&cfg, &dir, 0, None).unwrap();
    let from_ckpt = Weights::load(&dir, &cfg.model).unwrap();
    assert_eq!(from_ckpt.config, cfg.model);
    let file = dir.join("model.safetensors");
    from_ckpt.export(&file).unwrap();
    let raw = candle_core::safetensors::load(&file, &candle_core::Device::Cpu).unwrap();
    assert_eq!(raw["transformer.wte.weight"].dims(), [257, 24]);
    assert_eq!(raw["lm_head.weight"].dims(), [257, 24]);
    let from_file = Weights::load(&file, &GptConfig::default()).unwrap();
    assert_eq!(from_file.config, cfg.model);
    // `--init` from it at tp = 3 starts where the single-device reference starts.
    let mut fresh = vocab_257(1, 3, false);
    fresh.steps = 1;
    let opts = TrainOptions {
        init: Some(file.clone()),
        ..TrainOptions::default()
    };
    let started = train(&fresh, &Corpus::bundled(), &opts).unwrap().steps[0].loss;
    let (want, _) = reference_step(&fresh, &from_file.tensors, 0);
    assert!((started - want).abs() / want <= 1e-5, "{started} vs {want}");
    std::fs::remove_dir_all(&dir).unwrap();
}
