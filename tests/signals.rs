//! Ctrl-C and SIGTERM sent to a `switchyard train` child process: it finishes the step,
//! saves a checkpoint, says how to resume, exits 130 / 143, and the printed command
//! continues the run. And a reader that closes the pipe early (`switchyard plan | head`):
//! a quiet exit 141, no panic.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// Waits until the run has written `n` metrics lines (it is training).
fn wait_for_steps(child: &mut Child, metrics: &Path, n: usize) {
    // A bound against a hung child only; the test does not depend on timing.
    let give_up = Instant::now() + Duration::from_secs(600);
    loop {
        let lines = std::fs::read_to_string(metrics)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if lines >= n {
            return;
        }
        if let Some(status) = child.try_wait().unwrap() {
            panic!("switchyard exited ({status}) before training {n} steps");
        }
        assert!(Instant::now() < give_up, "no training progress in 600 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A long tiny run with checkpoints in `ck` and metrics in `m`, once it has trained two
/// steps.
fn start_training(ck: &Path, m: &Path) -> Child {
    let args = tiny(&[
        "--steps",
        "100000",
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--metrics",
        m.to_str().unwrap(),
    ]);
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_for_steps(&mut child, m, 2);
    child
}

fn stops_on(signal: &str, code: i32) {
    let dir = scratch(&format!("signal-{signal}"));
    let (ck, m) = (dir.join("ck"), dir.join("m.jsonl"));
    let child = start_training(&ck, &m);
    let sig = match signal {
        "INT" => libc::SIGINT,
        _ => libc::SIGTERM,
    };
    // SAFETY: kill(2) with the id of our own child process, which has not been waited for.
    assert_eq!(unsafe { libc::kill(child.id() as libc::pid_t, sig) }, 0);
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    assert_eq!(out.status.code(), Some(code), "{err}");
    // The checkpoint is of the last step the run finished, and complete.
    let done = metrics(&m).len();
    let step = ck.join(format!("step-{done:08}"));
    assert!(step.join("manifest.json").is_file(), "{err}");
    assert!(
        err.contains(&format!(
            "stopped by SIG{signal} after step {done} of 100000"
        )),
        "{err}"
    );
    assert!(
        err.contains(&format!("saved the checkpoint {}", step.display())),
        "{err}"
    );
    let prefix = "switchyard: to continue: switchyard ";
    let command = err
        .lines()
        .find_map(|l| l.strip_prefix(prefix))
        .unwrap_or_else(|| panic!("no resume command in:\n{err}"));
    assert!(
        command.ends_with(&format!("--resume --checkpoint-dir {}", ck.display())),
        "{command}"
    );
    // Run the printed command, one step further.
    let next = (done + 1).to_string();
    let again: Vec<String> = command
        .split(' ')
        .map(|a| {
            if a == "100000" {
                next.clone()
            } else {
                a.to_string()
            }
        })
        .collect();
    let (out, err) = ok(&again);
    assert!(err.contains(&format!("resumed from step {done} ")), "{err}");
    assert!(out.contains("trained 1 steps"), "{out}");
    // The printed command names the same metrics file: the resumed run appends the one
    // step after `done` to the records of the interrupted run, which are kept.
    let resumed = metrics(&m);
    assert_eq!(resumed.len(), done + 1);
    for (i, r) in resumed.iter().enumerate() {
        assert_eq!(r["step"], i, "{resumed:?}");
    }
}

#[test]
fn sigint_finishes_the_step_saves_and_says_how_to_resume() {
    stops_on("INT", 130);
}

#[test]
fn sigterm_finishes_the_step_saves_and_says_how_to_resume() {
    stops_on("TERM", 143);
}

/// A second signal while the first is being honoured ends the process at once: no step is
/// finished, nothing is saved, and no "stopped by" report is printed. SIGINT and SIGTERM
/// are sent back to back (two different signals, so the kernel cannot merge them into
/// one pending signal); whichever is handled second finds the stop already requested.
#[test]
fn a_second_signal_exits_at_once_without_saving() {
    let dir = scratch("signal-twice");
    let (ck, m) = (dir.join("ck"), dir.join("m.jsonl"));
    let child = start_training(&ck, &m);
    let pid = child.id() as libc::pid_t;
    // SAFETY: kill(2) with the id of our own child process, which has not been waited for.
    unsafe {
        assert_eq!(libc::kill(pid, libc::SIGINT), 0);
        assert_eq!(libc::kill(pid, libc::SIGTERM), 0);
    }
    let out = child.wait_with_output().unwrap();
    let err = text(&out.stderr);
    let code = out.status.code();
    assert!(code == Some(130) || code == Some(143), "{code:?}\n{err}");
    assert!(!err.contains("stopped by"), "{err}");
    assert!(!err.contains("saved the checkpoint"), "{err}");
}

/// `switchyard plan --json | head -c 10`: the output (about 100 KiB, more than a pipe
/// holds) meets a closed pipe. The command stops with SIGPIPE's status and says nothing.
#[test]
fn a_closed_pipe_ends_the_output_quietly() {
    use std::io::Read;
    let mut child = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "plan",
            "--workers",
            "4",
            "--layers",
            "8",
            "--d-model",
            "256",
            "--heads",
            "8",
            "--seq-len",
            "128",
            "--batch",
            "32",
            "--top",
            "0",
            "--json",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut head = [0u8; 10];
    child.stdout.take().unwrap().read_exact(&mut head).unwrap();
    // The read end is closed here, with most of the output unread.
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(141), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
}
