//! Who owns a checkpoint directory, and what happens to checkpoints that are not part of
//! the current run. Nothing here ever deletes a checkpoint of another run.
//!
//! ## The rule
//!
//! A checkpoint directory belongs to one run. Every manifest records the run's id
//! ([`Manifest::run_id`](crate::checkpoint::Manifest::run_id)); a fresh run makes a new one,
//! and a resumed run keeps the id of the checkpoint it resumes from.
//!
//! * A fresh run (no resume) into a directory that holds complete checkpoints is refused
//!   before any work, unless [`TrainOptions::overwrite`](crate::TrainOptions::overwrite) is
//!   set: then those checkpoints are moved, not deleted, into `DIR/stale-<their run id>/`.
//! * Resuming from step N and training on makes the checkpoints after N (the old timeline)
//!   stale: they are moved into `DIR/stale-from-N-<unix seconds>/`, never deleted.
//! * Pruning (`keep` K) runs after each save and only removes checkpoints of the current
//!   run (same run id) that are older than the one just written, keeping the newest K of
//!   the run. The checkpoint a run resumed from belongs to the run, so it goes once K newer
//!   checkpoints of the run exist. Checkpoints of other runs, and those whose manifest
//!   cannot be read, are never removed.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::{err, fail, Context, Result};

use crate::checkpoint::{complete_steps, fnv64, read_manifest};

/// A new run id: 16 hex digits from the clock, the process id and the seed.
pub fn new_run_id(seed: u64) -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    fnv64(format!("{nanos}-{}-{seed}", std::process::id()).as_bytes())
}

/// Creates `dir` if needed and checks that files can be created in it (a probe file is
/// created, written and removed). The error names the directory and the OS error.
pub fn prepare_dir(dir: &Path) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        fail!(
            Checkpoint,
            "--checkpoint-dir {} is not a directory: choose a directory (it is created if missing)",
            dir.display()
        );
    }
    fs::create_dir_all(dir).map_err(|e| {
        err!(
            Checkpoint,
            "cannot create the checkpoint directory {}: {e}",
            dir.display()
        )
    })?;
    probe_writable(dir)
}

/// Creates, writes and removes a probe file in `dir`.
pub fn probe_writable(dir: &Path) -> Result<()> {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let probe = dir.join(format!(".switchyard-probe-{}-{nanos}", std::process::id()));
    let written = fs::File::create(&probe).and_then(|mut f| {
        f.write_all(b"probe")?;
        f.sync_all()
    });
    if let Err(e) = written {
        let _ = fs::remove_file(&probe);
        fail!(
            Checkpoint,
            "the checkpoint directory {} is not writable: {e}",
            dir.display()
        );
    }
    fs::remove_file(&probe).map_err(|e| {
        err!(
            Checkpoint,
            "the checkpoint directory {} does not let files be removed ({}): {e}",
            dir.display(),
            probe.display()
        )
    })
}

/// The run id recorded in the newest readable checkpoint of `steps` ("unknown" if none).
fn newest_run_id(steps: &[(usize, PathBuf)]) -> String {
    steps
        .iter()
        .rev()
        .find_map(|(_, p)| read_manifest(p).ok())
        .map(|m| m.run_id)
        .filter(|id| !id.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// Checks, before any work, that a fresh run may write into `dir`: it must hold no
/// complete checkpoint unless `overwrite`. Returns the checkpoints to move aside.
pub fn check_fresh(dir: &Path, overwrite: bool) -> Result<Vec<(usize, PathBuf)>> {
    if !dir.is_dir() {
        return Ok(Vec::new());
    }
    let steps = complete_steps(dir)?;
    if steps.is_empty() || overwrite {
        return Ok(steps);
    }
    let list: Vec<String> = steps.iter().map(|(n, _)| n.to_string()).collect();
    fail!(Checkpoint,
        "--checkpoint-dir {} already holds checkpoints of another run (run {}, steps {}): pass --resume to continue that run, choose another --checkpoint-dir, or pass --overwrite to move them aside into {}/stale-{}/",
        dir.display(),
        newest_run_id(&steps),
        list.join(", "),
        dir.display(),
        newest_run_id(&steps)
    )
}

/// The complete checkpoints in `dir` after `step`: the old timeline a resume from `step`
/// makes stale.
pub fn steps_after(dir: &Path, step: usize) -> Result<Vec<(usize, PathBuf)>> {
    Ok(complete_steps(dir)?
        .into_iter()
        .filter(|(n, _)| *n > step)
        .collect())
}

/// The name of the directory an overwrite moves `steps` into: `stale-<their run id>`.
pub fn overwrite_name(steps: &[(usize, PathBuf)]) -> String {
    format!("stale-{}", newest_run_id(steps))
}

/// The name of the directory a resume from `step` moves the later checkpoints into.
pub fn stale_timeline_name(step: usize) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("stale-from-{step}-{secs}")
}

/// Moves the checkpoint directories `steps` into a new `dir/name` (`name-2`, `name-3`, …
/// if it exists); returns where they went.
pub fn move_aside(dir: &Path, steps: &[(usize, PathBuf)], name: &str) -> Result<PathBuf> {
    let mut into = dir.join(name);
    let mut k = 2;
    while into.exists() {
        into = dir.join(format!("{name}-{k}"));
        k += 1;
    }
    fs::create_dir(&into).with_context(|| format!("cannot create {}", into.display()))?;
    for (_, p) in steps {
        let to = into.join(p.file_name().unwrap_or_default());
        fs::rename(p, &to)
            .with_context(|| format!("cannot move {} to {}", p.display(), to.display()))?;
    }
    Ok(into)
}

/// Keeps the newest `keep` checkpoints of run `run_id` up to `newest` (the one just
/// written) and removes the older ones of that run; 0 keeps all. Returns what it removed.
pub fn prune(dir: &Path, run_id: &str, newest: usize, keep: usize) -> Result<Vec<PathBuf>> {
    if keep == 0 || run_id.is_empty() {
        return Ok(Vec::new());
    }
    let ours: Vec<(usize, PathBuf)> = complete_steps(dir)?
        .into_iter()
        .filter(|(n, p)| *n <= newest && read_manifest(p).is_ok_and(|m| m.run_id == run_id))
        .collect();
    let mut removed = Vec::new();
    for (_, p) in ours.iter().rev().skip(keep) {
        if fs::remove_dir_all(p).is_ok() {
            removed.push(p.clone());
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("switchyard-rundir-{}-{name}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn the_probe_passes_in_a_directory_and_leaves_nothing_behind() {
        let d = scratch("ok");
        probe_writable(&d).unwrap();
        assert_eq!(fs::read_dir(&d).unwrap().count(), 0);
        prepare_dir(&d.join("a/b")).unwrap();
        assert!(d.join("a/b").is_dir());
    }

    #[test]
    fn the_probe_names_the_os_error_when_it_cannot_write() {
        let d = scratch("file");
        let file = d.join("f");
        fs::write(&file, b"x").unwrap();
        // Not a directory: creating the probe fails with the OS error.
        let e = probe_writable(&file).unwrap_err().to_string();
        assert!(
            e.contains("is not writable") && e.contains("Not a directory"),
            "{e}"
        );
        // A regular file as the directory, and a path under a file.
        let e = prepare_dir(&file).unwrap_err().to_string();
        assert!(e.contains("is not a directory"), "{e}");
        let e = prepare_dir(&file.join("sub")).unwrap_err().to_string();
        assert!(
            e.contains("cannot create the checkpoint directory") && e.contains("Not a directory"),
            "{e}"
        );
    }

    #[test]
    fn moving_aside_never_overwrites_an_earlier_move() {
        let d = scratch("move");
        for n in [1, 2] {
            fs::create_dir_all(d.join(format!("step-{n}"))).unwrap();
        }
        let a = move_aside(&d, &[(1, d.join("step-1"))], "stale-x").unwrap();
        let b = move_aside(&d, &[(2, d.join("step-2"))], "stale-x").unwrap();
        assert_eq!(a, d.join("stale-x"));
        assert_eq!(b, d.join("stale-x-2"));
        assert!(a.join("step-1").is_dir() && b.join("step-2").is_dir());
    }

    #[test]
    fn run_ids_are_16_hex_digits() {
        let id = new_run_id(1);
        assert!(
            id.len() == 16 && id.chars().all(|c| c.is_ascii_hexdigit()),
            "{id}"
        );
    }
}
