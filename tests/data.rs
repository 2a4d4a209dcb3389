//! `switchyard train` and `eval` on data of one's own: nanoGPT token files, text through a
//! Hugging Face tokenizer, a held-out validation split; and the refusals of bad data.

mod common;

use std::path::{Path, PathBuf};

use common::{fails, metrics, ok, scratch, tiny};

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// Writes `ids` as a flat little-endian u16 token file.
fn write_u16(path: &Path, ids: impl Iterator<Item = u16>) {
    let bytes: Vec<u8> = ids.flat_map(|t| t.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

/// nanoGPT-style `train.bin` / `val.bin` over GPT-2's padded vocabulary.
fn token_files(dir: &Path) -> PathBuf {
    let ids = |n: u32, seed: u32| (0..n).map(move |i| ((i * 7919 + seed) % 50304) as u16);
    write_u16(&dir.join("train.bin"), ids(3000, 0));
    write_u16(&dir.join("val.bin"), ids(500, 11));
    dir.join("train.bin")
}

fn args(base: Vec<String>, extra: &[&str]) -> Vec<String> {
    base.into_iter()
        .chain(extra.iter().map(|x| x.to_string()))
        .collect()
}

#[test]
fn a_token_file_trains_end_to_end_with_its_validation_loss() {
    let dir = scratch("token-file");
    let train_bin = token_files(&dir);
    let m = dir.join("m.jsonl");
    let ckpt = dir.join("ckpt");
    let (out, err) = ok(&tiny(&[
        "--data",
        &s(&train_bin),
        "--vocab-size",
        "50304",
        "--steps",
        "3",
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
        "--metrics",
        &s(&m),
        "--checkpoint-dir",
        &s(&ckpt),
    ]));
    assert!(err.contains("vocabulary 50304"), "{err}");
    assert!(err.contains("500 held out for validation"), "{err}");
    assert!(
        out.contains("validation loss: ")
            && out.contains("after step 3 (2 batches of 4 × 8 tokens)"),
        "{out}"
    );
    let lines = metrics(&m);
    let val: Vec<bool> = lines.iter().map(|l| l.get("val_loss").is_some()).collect();
    assert_eq!(val, [false, true, true], "{lines:?}");
    let v = lines[2]["val_loss"].as_f64().unwrap();
    // Near ln(50304) ≈ 10.8 for an untrained model.
    assert!(v > 9.0 && v < 12.0, "{v}");
    // `eval` scores the validation split (val.bin) by default.
    let (out, _) = ok(&args(
        vec!["eval".into()],
        &[
            "--checkpoint",
            &s(&ckpt),
            "--data",
            &s(&train_bin),
            "--seq-len",
            "8",
        ],
    ));
    assert!(
        out.contains("nats/token") && out.contains("val.bin"),
        "{out}"
    );
    // Sampling decodes bytes: a token model is refused rather than printing nonsense.
    let e = fails(&args(vec!["sample".into()], &["--checkpoint", &s(&ckpt)]));
    assert!(e.contains("vocabulary has 50304 ids"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A tiny word-level tokenizer.json (Hugging Face's format): 9 words and `[UNK]`.
const TOKENIZER: &str = r#"{
  "version": "1.0",
  "truncation": null,
  "padding": null,
  "added_tokens": [],
  "normalizer": null,
  "pre_tokenizer": { "type": "Whitespace" },
  "post_processor": null,
  "decoder": null,
  "model": {
    "type": "WordLevel",
    "vocab": { "[UNK]": 0, "in": 1, "the": 2, "beginning": 3, "god": 4, "created": 5,
               "heaven": 6, "and": 7, "earth": 8, ".": 9 },
    "unk_token": "[UNK]"
  }
}"#;

#[test]
fn text_through_a_tokenizer_trains_end_to_end_and_is_cached() {
    let dir = scratch("tokenizer");
    let tok = dir.join("tokenizer.json");
    std::fs::write(&tok, TOKENIZER).unwrap();
    let text = dir.join("input.txt");
    std::fs::write(
        &text,
        "in the beginning god created the heaven and the earth . ".repeat(40),
    )
    .unwrap();
    let run = || {
        ok(&tiny(&[
            "--tokenizer",
            &s(&tok),
            "--data",
            &s(&text),
            "--val-fraction",
            "0.25",
            "--steps",
            "2",
            "--tp",
            "2",
        ]))
    };
    let (out, err) = run();
    assert!(err.contains("vocabulary 10"), "{err}");
    // 440 words: the last 110 are held out.
    assert!(
        err.contains("(330 tokens, 110 held out for validation)"),
        "{err}"
    );
    assert!(out.contains("validation loss: "), "{out}");
    let cache: Vec<PathBuf> = std::fs::read_dir(dir.join(".switchyard-cache"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(cache.len(), 1, "{cache:?}");
    assert_eq!(std::fs::metadata(&cache[0]).unwrap().len(), 440 * 2);
    // The second run reads the cache and trains the same.
    let (again, _) = run();
    let loss = |o: &str| o.lines().next().unwrap().to_string();
    assert_eq!(loss(&again), loss(&out));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_data_is_refused_before_any_work_naming_the_file() {
    let dir = scratch("bad-data");
    let train_bin = token_files(&dir);
    // A token id beyond the vocabulary: the file and the offset.
    let e = fails(&tiny(&["--data", &s(&train_bin), "--vocab-size", "1000"]));
    assert!(e.contains("train.bin has token id"), "{e}");
    assert!(e.contains("at token offset"), "{e}");
    assert!(e.contains("the vocabulary has 1000 ids"), "{e}");
    // A u16 file of an odd length.
    let odd = dir.join("odd.bin");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    let e = fails(&tiny(&["--data", &s(&odd)]));
    assert!(
        e.contains("odd.bin has 3 bytes, not a whole number of 2-byte u16"),
        "{e}"
    );
    // An empty token file, and one too short for a window.
    let empty = dir.join("empty.bin");
    std::fs::write(&empty, []).unwrap();
    assert!(fails(&tiny(&["--data", &s(&empty)])).contains("empty.bin is empty"));
    let short = dir.join("short.bin");
    write_u16(&short, 0..5);
    // Its vocabulary (5 ids, which --tp 2 pads to 6) is fine; its length is not.
    for vocab in [&[][..], &["--vocab-size", "6"][..]] {
        let e = fails(&args(tiny(&["--data", &s(&short)]), vocab));
        assert!(
            e.contains("has 5 tokens, fewer than one window of --seq-len + 1 = 9"),
            "{e}"
        );
    }
    // Tokenizers: missing, not a tokenizer, or without text.
    let text = dir.join("input.txt");
    std::fs::write(&text, "some text").unwrap();
    let missing = dir.join("nope.json");
    let e = fails(&tiny(&["--tokenizer", &s(&missing), "--data", &s(&text)]));
    assert!(e.contains("nope.json: no such file"), "{e}");
    let bad = dir.join("bad.json");
    std::fs::write(&bad, "{\"model\": 3}").unwrap();
    let e = fails(&tiny(&["--tokenizer", &s(&bad), "--data", &s(&text)]));
    assert!(
        e.contains("bad.json is not a Hugging Face tokenizer.json"),
        "{e}"
    );
    let e = fails(&tiny(&["--tokenizer", &s(&bad)]));
    assert!(e.contains("needs --data"), "{e}");
    // A fraction that holds out everything, or nothing sensible.
    let e = fails(&tiny(&["--val-fraction", "1"]));
    assert!(
        e.contains("--val-fraction must be at least 0 and below 1"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A vocabulary --tp does not divide trains (the tables are padded inside the ranks) and
/// exports the logical `[V, d]` tables.
#[test]
fn a_vocabulary_tp_does_not_divide_trains_and_exports_its_logical_tables() {
    let dir = scratch("vocab-257");
    let train_bin = dir.join("train.bin");
    write_u16(&train_bin, (0..2000u32).map(|i| ((i * 7919) % 257) as u16));
    let ckpt = dir.join("ckpt");
    let (out, err) = ok(&tiny(&[
        "--data",
        &s(&train_bin),
        "--vocab-size",
        "257",
        "--tp",
        "2",
        "--steps",
        "2",
        "--checkpoint-dir",
        &s(&ckpt),
    ]));
    assert!(err.contains("vocabulary 257"), "{err}");
    assert!(out.contains("trained 2 steps"), "{out}");
    let model = dir.join("model.safetensors");
    ok(&args(
        vec!["export".into()],
        &["--checkpoint", &s(&ckpt), "--out", &s(&model)],
    ));
    let raw = candle_core::safetensors::load(&model, &candle_core::Device::Cpu).unwrap();
    assert_eq!(raw["transformer.wte.weight"].dims(), [257, 16]);
    assert_eq!(raw["lm_head.weight"].dims(), [257, 16]);
    std::fs::remove_dir_all(&dir).unwrap();
}
