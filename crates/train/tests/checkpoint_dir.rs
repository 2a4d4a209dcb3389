//! Who owns a checkpoint directory: fresh runs into another run's directory are refused,
//! a resume moves the later timeline aside, pruning only touches the current run, an
//! unwritable directory fails before any work, a failing save names the last good
//! checkpoint, and a stop request ends every rank after the same step with a checkpoint.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use crate::common::*;
use switchyard_models::GptConfig;
use switchyard_train::checkpoint::{self, Checkpoint};
use switchyard_train::data::Corpus;
use switchyard_train::{train, Resume, TrainConfig, TrainOptions, TrainReport};

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-ckdir-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn cfg(steps: usize) -> TrainConfig<GptConfig> {
    let mut c = tiny(1, 2, 1, "1f1b");
    c.steps = steps;
    c
}

fn opts(dir: &Path, save_every: usize, keep: usize, resume: Option<Resume>) -> TrainOptions {
    TrainOptions {
        checkpoint_dir: Some(dir.to_path_buf()),
        save_every,
        keep,
        resume,
        ..TrainOptions::default()
    }
}

fn run(cfg: &TrainConfig<GptConfig>, opts: &TrainOptions) -> anyhow::Result<TrainReport> {
    Ok(train(cfg, &Corpus::bundled(), opts)?)
}

fn steps_in(dir: &Path) -> Vec<usize> {
    checkpoint::complete_steps(dir)
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect()
}

fn run_id(dir: &Path, step: usize) -> String {
    checkpoint::read_manifest(&checkpoint::step_dir(dir, step))
        .unwrap()
        .run_id
}

/// The subdirectories of `dir` whose names start with `prefix`.
fn subdirs(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(prefix))
        .map(|e| e.path())
        .collect();
    v.sort();
    v
}

/// Every file under `dir` with its size.
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, u64> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.insert(p.clone(), std::fs::metadata(&p).unwrap().len());
            }
        }
    }
    out
}

#[test]
fn resuming_from_an_earlier_step_moves_the_later_timeline_aside_and_keeps_the_new_step() {
    let dir = scratch("timeline");
    run(&cfg(12), &opts(&dir, 4, 0, None)).unwrap();
    assert_eq!(steps_in(&dir), [4, 8, 12]);
    let id = run_id(&dir, 4);
    // The reported case: --steps 6 --resume-from 4 --keep 2.
    let r = run(&cfg(6), &opts(&dir, 0, 2, Some(Resume::Step(4)))).unwrap();
    assert_eq!(r.steps.len(), 2);
    assert_eq!(
        steps_in(&dir),
        [4, 6],
        "the start and the new step are kept"
    );
    assert_eq!(run_id(&dir, 6), id, "a resumed run keeps its run id");
    let stale = subdirs(&dir, "stale-from-4-");
    assert_eq!(stale.len(), 1, "{stale:?}");
    assert_eq!(
        steps_in(&stale[0]),
        [8, 12],
        "the old timeline is moved, not deleted"
    );
    Checkpoint::open(&checkpoint::step_dir(&stale[0], 12)).unwrap();
}

#[test]
fn pruning_removes_only_older_checkpoints_of_the_current_run() {
    let dir = scratch("prune");
    let other = scratch("prune-other");
    run(&cfg(1), &opts(&other, 0, 0, None)).unwrap();
    run(&cfg(3), &opts(&dir, 1, 0, None)).unwrap();
    // Step 1 of another run takes the place of this run's step 1.
    std::fs::remove_dir_all(checkpoint::step_dir(&dir, 1)).unwrap();
    copy_dir(
        &checkpoint::step_dir(&other, 1),
        &checkpoint::step_dir(&dir, 1),
    );
    assert_ne!(run_id(&dir, 1), run_id(&dir, 3));
    run(&cfg(5), &opts(&dir, 1, 2, Some(Resume::Latest))).unwrap();
    assert_eq!(
        steps_in(&dir),
        [1, 4, 5],
        "the other run's step 1 is never pruned"
    );
    // With keep 1 the step a run resumed from goes once a newer one of the run exists.
    run(&cfg(6), &opts(&dir, 1, 1, Some(Resume::Latest))).unwrap();
    assert_eq!(steps_in(&dir), [1, 6]);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap().flatten() {
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn a_fresh_run_into_another_runs_directory_is_refused_and_changes_nothing() {
    let dir = scratch("fresh");
    run(&cfg(2), &opts(&dir, 0, 0, None)).unwrap();
    let before = snapshot(&dir);
    let metrics = dir.join("m.jsonl");
    // The reported cases: the same model with --keep 1, and another model size.
    let mut bigger = cfg(2);
    bigger.model.d_model = 32;
    for c in [cfg(3), bigger] {
        let o = TrainOptions {
            metrics: Some(metrics.clone()),
            ..opts(&dir, 0, 1, None)
        };
        let e = format!("{:#}", run(&c, &o).unwrap_err());
        assert!(
            e.contains("already holds checkpoints of another run")
                && e.contains("steps 2")
                && e.contains("--resume")
                && e.contains("--overwrite"),
            "{e}"
        );
        assert_eq!(
            snapshot(&dir),
            before,
            "a refused run changed the directory"
        );
        assert!(!metrics.exists(), "the refusal came after the run started");
    }
}

#[test]
fn overwrite_moves_the_other_run_aside_instead_of_deleting_it() {
    let dir = scratch("overwrite");
    run(&cfg(2), &opts(&dir, 0, 0, None)).unwrap();
    let old = run_id(&dir, 2);
    let o = TrainOptions {
        overwrite: true,
        ..opts(&dir, 0, 1, None)
    };
    run(&cfg(3), &o).unwrap();
    assert_eq!(steps_in(&dir), [3]);
    assert_ne!(run_id(&dir, 3), old, "a fresh run has a new run id");
    let aside = dir.join(format!("stale-{old}"));
    assert_eq!(steps_in(&aside), [2]);
    Checkpoint::open(&checkpoint::step_dir(&aside, 2)).unwrap();
}

#[test]
fn a_checkpoint_dir_that_is_a_file_fails_before_any_work() {
    let dir = scratch("file");
    let file = dir.join("ckpt");
    std::fs::write(&file, b"not a directory").unwrap();
    let metrics = dir.join("m.jsonl");
    for (path, want) in [
        (file.clone(), "is not a directory"),
        (file.join("sub"), "cannot create the checkpoint directory"),
    ] {
        let o = TrainOptions {
            metrics: Some(metrics.clone()),
            ..opts(&path, 0, 0, None)
        };
        let e = format!("{:#}", run(&cfg(2), &o).unwrap_err());
        assert!(
            e.contains(want) && e.contains(&*path.to_string_lossy()),
            "{e}"
        );
        assert!(!metrics.exists(), "the error came after the run started");
    }
}

#[test]
fn a_save_that_fails_mid_run_names_the_last_good_checkpoint() {
    let dir = scratch("save-fails");
    // The staging path of step 2's save is a file, so that save cannot start.
    std::fs::write(checkpoint::staging_dir(&dir, 2), b"in the way").unwrap();
    let e = format!("{:#}", run(&cfg(3), &opts(&dir, 1, 0, None)).unwrap_err());
    let good = checkpoint::step_dir(&dir, 1);
    assert!(
        e.contains("saving the checkpoint of step 2")
            && e.contains(&format!("the last good checkpoint is {}", good.display())),
        "{e}"
    );
    Checkpoint::open(&good).unwrap();
}

#[test]
fn resume_refuses_another_seed_unless_allowed() {
    let dir = scratch("seed");
    run(&cfg(2), &opts(&dir, 1, 0, None)).unwrap();
    let mut other = cfg(3);
    other.seed += 1;
    let e = format!(
        "{:#}",
        run(&other, &opts(&dir, 0, 0, Some(Resume::Latest))).unwrap_err()
    );
    assert!(
        e.contains("was trained with --seed 1337") && e.contains("--allow-seed-change"),
        "{e}"
    );
    let o = TrainOptions {
        allow_seed_change: true,
        ..opts(&dir, 0, 0, Some(Resume::Latest))
    };
    assert_eq!(run(&other, &o).unwrap().steps.len(), 1);
}

#[test]
fn a_stop_request_ends_every_rank_after_one_step_with_a_checkpoint_to_resume() {
    let dir = scratch("stop");
    let mut c = tiny(1, 2, 2, "1f1b");
    c.steps = 4;
    let full: Vec<f64> = run(&c, &TrainOptions::default())
        .unwrap()
        .steps
        .iter()
        .map(|s| s.loss)
        .collect();
    let o = TrainOptions {
        stop: Some(Arc::new(AtomicBool::new(true))),
        ..opts(&dir, 0, 0, None)
    };
    let r = run(&c, &o).unwrap();
    assert!(r.interrupted);
    assert_eq!(r.steps.len(), 1);
    assert_eq!(r.last_checkpoint, Some(checkpoint::step_dir(&dir, 1)));
    assert_eq!(steps_in(&dir), [1]);
    let rest = run(&c, &opts(&dir, 0, 0, Some(Resume::Latest))).unwrap();
    assert!(!rest.interrupted);
    let resumed: Vec<f64> = rest.steps.iter().map(|s| s.loss).collect();
    assert_eq!(resumed, full[1..], "the resumed run continues the same run");
}
