//! `switchyard train --resume` end to end: what a resume restores and checks, and who
//! owns a checkpoint directory.

mod common;

use common::*;

#[test]
fn resume_takes_the_steps_and_schedule_from_the_checkpoint_and_moves_later_steps_aside() {
    let dir = scratch("resume");
    let ck = dir.join("ck");
    let (m1, m2) = (dir.join("m1.jsonl"), dir.join("m2.jsonl"));
    let ck_s = ck.to_str().unwrap();
    ok(&tiny(&[
        "--steps",
        "4",
        "--lr",
        "0.01",
        "--min-lr",
        "0.001",
        "--warmup",
        "2",
        "--seed",
        "7",
        "--weight-decay",
        "0.05",
        "--decay",
        "all",
        "--beta1",
        "0.8",
        "--beta2",
        "0.99",
        "--eps",
        "1e-6",
        "--no-shuffle",
        "--save-every",
        "2",
        "--checkpoint-dir",
        ck_s,
        "--metrics",
        m1.to_str().unwrap(),
    ]));
    let manifest = |step: &str| -> serde_json::Value {
        let p = ck.join(step).join("manifest.json");
        serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
    };
    let saved = manifest("step-00000002");
    assert_eq!(saved["optimizer"]["decay"], "all", "{saved}");
    assert_eq!(saved["optimizer"]["eps"], 1e-6, "{saved}");
    assert_eq!(saved["config"]["shuffle"], false, "{saved}");
    // No --steps, --lr, --seed, --decay, --no-shuffle …: they come from the checkpoint
    // (the losses below are the first run's only if every one of them does).
    let (out, err) = ok(&tiny(&[
        "--resume-from",
        "2",
        "--checkpoint-dir",
        ck_s,
        "--metrics",
        m2.to_str().unwrap(),
    ]));
    assert!(out.contains("trained 2 steps"), "{out}");
    let step2 = ck.join("step-00000002");
    assert!(
        err.contains(&format!("resumed from step 2 ({})", step2.display())),
        "{err}"
    );
    assert!(err.contains("moved the checkpoints of steps 4"), "{err}");
    let (first, again) = (metrics(&m1), metrics(&m2));
    assert_eq!(again.len(), 2);
    for (a, b) in first[2..].iter().zip(&again) {
        assert_eq!(a["step"], b["step"]);
        assert_eq!(
            a["lr"], b["lr"],
            "the learning-rate schedule is the checkpoint's"
        );
        assert_eq!(a["loss"], b["loss"], "the resumed run is the same run");
    }
    assert_eq!(manifest("step-00000004")["optimizer"], saved["optimizer"]);
    // An explicit flag wins over the checkpoint.
    let (out, _) = ok(&tiny(&[
        "--resume",
        "--checkpoint-dir",
        ck_s,
        "--steps",
        "5",
        "--decay",
        "matrices",
        "--eps",
        "1e-7",
    ]));
    assert!(out.contains("trained 1 steps"), "{out}");
    let last = manifest("step-00000005");
    assert_eq!(last["optimizer"]["decay"], "matrices", "{last}");
    assert_eq!(last["optimizer"]["eps"], 1e-7, "{last}");
    assert_eq!(last["optimizer"]["beta1"], 0.8, "{last}");
    assert_eq!(last["config"]["shuffle"], false, "{last}");
}

#[test]
fn resume_refuses_another_seed_unless_allowed() {
    let dir = scratch("seed");
    let ck = dir.join("ck");
    let ck_s = ck.to_str().unwrap();
    ok(&tiny(&["--steps", "1", "--checkpoint-dir", ck_s]));
    let e = fails(&tiny(&[
        "--resume",
        "--checkpoint-dir",
        ck_s,
        "--steps",
        "2",
        "--seed",
        "8",
    ]));
    assert!(
        e.contains("--seed 1337") && e.contains("--seed 8") && e.contains("--allow-seed-change"),
        "{e}"
    );
    let (out, _) = ok(&tiny(&[
        "--resume",
        "--checkpoint-dir",
        ck_s,
        "--steps",
        "2",
        "--seed",
        "8",
        "--allow-seed-change",
    ]));
    assert!(out.contains("trained 1 steps"), "{out}");
}

#[test]
fn a_fresh_run_into_another_runs_checkpoints_is_refused_unless_overwrite() {
    let dir = scratch("fresh");
    let ck = dir.join("ck");
    let ck_s = ck.to_str().unwrap();
    ok(&tiny(&["--steps", "2", "--checkpoint-dir", ck_s]));
    // The same model with --keep 1, and another model size.
    let same = tiny(&["--steps", "1", "--checkpoint-dir", ck_s, "--keep", "1"]);
    let mut bigger = tiny(&["--steps", "1", "--checkpoint-dir", ck_s]);
    let d = bigger.iter().position(|a| a == "--d-model").unwrap();
    bigger[d + 1] = "32".into();
    for args in [same, bigger] {
        let e = fails(&args);
        assert!(
            e.contains(&format!(
                "--checkpoint-dir {ck_s} already holds checkpoints of another run"
            )) && e.contains("--overwrite"),
            "{e}"
        );
    }
    assert!(ck.join("step-00000002").join("manifest.json").is_file());
    let (_, err) = ok(&tiny(&[
        "--steps",
        "1",
        "--checkpoint-dir",
        ck_s,
        "--overwrite",
    ]));
    assert!(err.contains("aside into"), "{err}");
    assert!(ck.join("step-00000001").is_dir() && !ck.join("step-00000002").exists());
}

#[test]
fn an_unusable_checkpoint_dir_fails_before_training() {
    let dir = scratch("unusable");
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let m = dir.join("m.jsonl");
    for (ck, want) in [
        (file.clone(), "is not a directory"),
        (file.join("sub"), "cannot create the checkpoint directory"),
    ] {
        let e = fails(&tiny(&[
            "--steps",
            "2",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--metrics",
            m.to_str().unwrap(),
        ]));
        assert!(e.contains(want) && e.contains(ck.to_str().unwrap()), "{e}");
        assert!(!m.exists(), "the error came after training started");
    }
}
