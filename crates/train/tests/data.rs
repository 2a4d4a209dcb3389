//! Datasets in training: the validation loss through the parallel model, token files,
//! sequential sampling.

use crate::common::tiny;
use switchyard_models::GptConfig;
use switchyard_train::data::{self, Corpus, DataSpec, Dataset};
use switchyard_train::{train, TrainConfig, TrainOptions};

/// `tiny` with the same global batch on every layout, validating after every step.
fn cfg(dp: usize, pp: usize, tp: usize, schedule: &str) -> TrainConfig<GptConfig> {
    let mut c = tiny(dp, pp, tp, schedule);
    c.batch = 8;
    c.steps = 2;
    c.eval_every = 1;
    c.eval_batches = 3;
    c
}

fn val_losses(cfg: &TrainConfig<GptConfig>, data: &dyn Dataset) -> Vec<f64> {
    let report = train(cfg, data, &TrainOptions::default()).unwrap();
    report
        .steps
        .iter()
        .map(|s| s.val_loss.expect("validated every step"))
        .collect()
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        let e = (g - w).abs() / w.abs();
        assert!(
            e <= 1e-5,
            "{what}: validation loss {g} vs serial {w} (rel {e:.2e})"
        );
    }
}

#[test]
fn the_validation_loss_is_the_same_on_every_layout() {
    let data = Corpus::text("bundled", data::BUNDLED.to_vec(), 0.1);
    let serial = val_losses(&cfg(1, 1, 1, "1f1b"), &data);
    assert!(
        serial.iter().all(|l| l.is_finite() && *l > 0.0),
        "{serial:?}"
    );
    assert!(serial[1] < serial[0], "training lowers it: {serial:?}");
    for (dp, pp, tp, s) in [
        (1, 2, 2, "1f1b"),
        (2, 1, 1, "1f1b"),
        (2, 2, 1, "gpipe"),
        (1, 2, 1, "interleaved"),
    ] {
        let got = val_losses(&cfg(dp, pp, tp, s), &data);
        assert_close(&got, &serial, &format!("dp {dp} pp {pp} tp {tp} {s}"));
    }
    // Without a validation split there is nothing to report.
    let report = train(
        &cfg(1, 1, 1, "1f1b"),
        &Corpus::bundled(),
        &TrainOptions::default(),
    )
    .unwrap();
    assert!(report.steps.iter().all(|s| s.val_loss.is_none()));
    assert!(report.val_loss().is_none());
}

#[test]
fn sequential_sampling_trains_the_same_on_every_layout() {
    let data = Corpus::text("bundled", data::BUNDLED.to_vec(), 0.1);
    let seq = |dp, pp, tp| {
        let mut c = cfg(dp, pp, tp, "1f1b");
        c.shuffle = false;
        c
    };
    let run = |c: &TrainConfig<GptConfig>| -> Vec<f64> {
        let r = train(c, &data, &TrainOptions::default()).unwrap();
        r.steps.iter().map(|s| s.loss).collect()
    };
    let serial = run(&seq(1, 1, 1));
    assert_close(&run(&seq(2, 2, 1)), &serial, "sequential dp 2 pp 2");
    // Sequential and shuffled windows differ.
    assert_ne!(run(&cfg(1, 1, 1, "1f1b")), serial);
}

/// A token file of `ids` as u16, in a fresh directory.
fn token_dir(name: &str, files: &[(&str, &[u16])]) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("switchyard-data-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    for (file, ids) in files {
        let bytes: Vec<u8> = ids.iter().flat_map(|t| t.to_le_bytes()).collect();
        std::fs::write(dir.join(file), bytes).unwrap();
    }
    dir
}

#[test]
fn token_files_train_with_their_val_bin_and_a_vocabulary_of_their_own() {
    // A 1000-token vocabulary: ids a byte corpus could not hold.
    let ids = |n: usize, seed: u16| -> Vec<u16> {
        (0..n)
            .map(|i| ((i as u16).wrapping_mul(37).wrapping_add(seed)) % 1000)
            .collect()
    };
    let (train_ids, val_ids) = (ids(4000, 1), ids(600, 7));
    let dir = token_dir("bin", &[("train.bin", &train_ids), ("val.bin", &val_ids)]);
    let spec = DataSpec {
        data: Some(dir.join("train.bin")),
        ..DataSpec::default()
    };
    let data = data::open(&spec).unwrap();
    assert_eq!(data.train().len(), 4000);
    assert_eq!(data.validation().unwrap().len(), 600);
    assert_eq!(data.vocab_size(), 1000);
    let mut c = cfg(1, 2, 2, "1f1b");
    c.model.vocab_size = 1000;
    let r = train(&c, &data, &TrainOptions::default()).unwrap();
    assert!(r.val_loss().unwrap().1.is_finite());
    // A vocabulary too small for the data is refused before any work, naming the offset.
    c.model.vocab_size = 512;
    let e = train(&c, &data, &TrainOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.bin has token id 999 at token offset"),
        "{e}"
    );
    // --val-fraction beside a val.bin is one validation split too many.
    let e = data::open(&DataSpec {
        val_fraction: 0.1,
        ..spec
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("the validation split is val.bin"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}
