//! `switchyard train --backend mpi` under `mpirun`: the same losses as the in-process
//! backend, checkpoints that move between the two backends, and a rank that dies
//! mid-step ending the job instead of hanging it.
//!
//! Needs OpenMPI (`scripts/install-mpi.sh`); runs with `cargo test --features mpi`.
#![cfg(feature = "mpi")]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_switchyard");

const TINY: &[&str] = &[
    "--d-model",
    "32",
    "--layers",
    "2",
    "--heads",
    "2",
    "--seq-len",
    "16",
    "--batch",
    "8",
    "--microbatches",
    "2",
    "--quiet",
    "--threads-per-worker",
    "1",
];

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-mpi-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn mpirun(np: usize, args: &[&str]) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "--bind-to",
        "none",
        "-np",
        &np.to_string(),
        BIN,
    ])
    .args(["train", "--backend", "mpi"])
    .args(TINY)
    .args(args);
    c
}

fn local(args: &[&str]) -> Command {
    let mut c = Command::new(BIN);
    c.arg("train").args(TINY).args(args);
    c
}

/// Runs `cmd` to completion under a watchdog, so that a hang fails the test instead of
/// stalling it.
fn run(mut cmd: Command, limit: Duration) -> (bool, String) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start");
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let out = child.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            return (status.success(), text);
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("the command ran past {limit:?}: {cmd:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn losses(path: &Path) -> Vec<f64> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["loss"]
                .as_f64()
                .unwrap()
        })
        .collect()
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * y.abs(),
            "{what}: step {i}: {x} vs {y}"
        );
    }
}

const LIMIT: Duration = Duration::from_secs(180);

#[test]
fn mpi_matches_the_in_process_backend() {
    let d = scratch("parity");
    let (m, l) = (d.join("mpi.jsonl"), d.join("local.jsonl"));
    let (ok, out) = run(
        mpirun(
            4,
            &[
                "--pp",
                "2",
                "--tp",
                "2",
                "--steps",
                "5",
                "--metrics",
                m.to_str().unwrap(),
            ],
        ),
        LIMIT,
    );
    assert!(ok, "{out}");
    assert!(
        out.contains("trained 5 steps on 4 workers"),
        "only rank 0 reports: {out}"
    );
    assert_eq!(out.matches("trained 5 steps").count(), 1, "{out}");
    // Each process measures its own rank, with its resident set as a cross-check.
    assert!(
        out.contains("memory     measured peak   predicted"),
        "{out}"
    );
    assert!(
        out.contains("peak resident set of each rank's process"),
        "{out}"
    );
    let (ok, out) = run(
        local(&[
            "--pp",
            "2",
            "--tp",
            "2",
            "--steps",
            "5",
            "--metrics",
            l.to_str().unwrap(),
        ]),
        LIMIT,
    );
    assert!(ok, "{out}");
    assert_close(&losses(&m), &losses(&l), "mpi vs local");
}

/// ZeRO's reduce-scatters and all-gathers (stage 2 with recomputation's segments, stage 3
/// gathering every segment's parameters), and without ZeRO the all-reduce overlapped with
/// the backward on a communication thread, under MPI train what they train on threads.
#[test]
fn zero_and_recomputation_under_mpi_match_the_in_process_backend() {
    for (zero, recompute) in [("2", "full"), ("3", "none"), ("0", "selective")] {
        let d = scratch(&format!("savers-{zero}"));
        let (m, l) = (d.join("mpi.jsonl"), d.join("local.jsonl"));
        let flags = |metrics: &Path| -> Vec<String> {
            [
                "--dp",
                "2",
                "--pp",
                "2",
                "--tp",
                "1",
                "--zero",
                zero,
                "--recompute",
                recompute,
                "--steps",
                "5",
                "--metrics",
            ]
            .iter()
            .map(|s| s.to_string())
            .chain([metrics.to_str().unwrap().to_string()])
            .collect()
        };
        let (fm, fl) = (flags(&m), flags(&l));
        let fm: Vec<&str> = fm.iter().map(String::as_str).collect();
        let fl: Vec<&str> = fl.iter().map(String::as_str).collect();
        let (ok, out) = run(mpirun(4, &fm), LIMIT);
        assert!(ok, "{out}");
        assert!(out.contains("trained 5 steps on 4 workers"), "{out}");
        let (ok, out) = run(local(&fl), LIMIT);
        assert!(ok, "{out}");
        assert_close(
            &losses(&m),
            &losses(&l),
            &format!("mpi vs local, zero {zero}, recompute {recompute}"),
        );
    }
}

/// Builds a `switchyard train` command from extra flags.
type Launch<'a> = dyn Fn(&[&str]) -> Command + 'a;

/// Runs `cmd` under the watchdog and asserts that it succeeded.
fn ok(cmd: Command) {
    let (ok, out) = run(cmd, LIMIT);
    assert!(ok, "{out}");
}

#[test]
fn checkpoints_move_between_backends() {
    let d = scratch("ckpt");
    let full = d.join("full.jsonl");
    ok(local(&[
        "--pp",
        "2",
        "--tp",
        "2",
        "--steps",
        "6",
        "--metrics",
        full.to_str().unwrap(),
    ]));
    let full = losses(&full);
    let mpi = |a: &[&str]| mpirun(4, &[&["--pp", "2", "--tp", "2"], a].concat());
    let threads = |a: &[&str]| local(a);
    // The in-process side resumes on another layout (dp 2 × pp 2 × tp 2).
    let threads_dp2 = |a: &[&str]| local(&[&["--dp", "2"], a].concat());
    let cases: [(&str, &Launch, &Launch); 2] = [
        ("mpi-to-threads", &mpi, &threads_dp2),
        ("threads-to-mpi", &threads, &mpi),
    ];
    for (what, save, resume) in cases {
        let ck = d.join(what);
        let ck = ck.to_str().unwrap();
        ok(save(&[
            "--steps",
            "6",
            "--save-every",
            "3",
            "--checkpoint-dir",
            ck,
        ]));
        let resumed = d.join(format!("{what}.jsonl"));
        let metrics = resumed.to_str().unwrap();
        ok(resume(&[
            "--steps",
            "6",
            "--checkpoint-dir",
            ck,
            "--resume-from",
            "3",
            "--metrics",
            metrics,
        ]));
        assert_close(&losses(&resumed), &full[3..], what);
    }
}

/// The pid of one rank of the job `mpirun` (a child process) runs, once all `np` ranks
/// have been up for 3 s. Only this job's ranks, the children of its own mpirun: tests
/// run side by side.
fn a_training_rank(mpirun: &std::process::Child, np: usize) -> u32 {
    let start = Instant::now();
    loop {
        let out = Command::new("pgrep")
            .args(["-P", &mpirun.id().to_string()])
            .output()
            .unwrap();
        let pids: Vec<u32> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        if pids.len() >= np && start.elapsed() > Duration::from_secs(3) {
            return pids[pids.len() - 1];
        }
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "the ranks did not start"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_rank_that_dies_mid_run_ends_the_job() {
    let d = scratch("dies");
    let mut cmd = mpirun(4, &["--pp", "2", "--tp", "2", "--steps", "100000"]);
    cmd.current_dir(&d);
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the ranks are training, then kill one of them.
    let victim = a_training_rank(&child, 4);
    Command::new("kill")
        .args(["-9", &victim.to_string()])
        .status()
        .unwrap();
    let killed = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "the job must fail when a rank dies");
            break;
        }
        if killed.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            panic!("the job hung after a rank died");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `--comm-timeout` bounds every wait under MPI too, and wins over the environment
/// variable (only a default): a rank that stops answering makes the others fail after
/// 2 s, naming the timeout, although the variable says 600 s.
#[test]
fn comm_timeout_bounds_the_wait_under_mpi() {
    let d = scratch("timeout");
    let mut cmd = mpirun(
        4,
        &[
            "--pp",
            "2",
            "--tp",
            "2",
            "--steps",
            "100000",
            "--comm-timeout",
            "2",
        ],
    );
    cmd.env("SWITCHYARD_COMM_TIMEOUT_SECS", "600")
        .current_dir(&d);
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Wait until the ranks are training, then stop one: it stays alive, so mpirun does
    // not notice; only the others' timeout can end the job.
    let victim = a_training_rank(&child, 4);
    Command::new("kill")
        .args(["-STOP", &victim.to_string()])
        .status()
        .unwrap();
    let stopped = Instant::now();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            assert!(!status.success(), "the job must fail when a rank stops");
            break;
        }
        if stopped.elapsed() > Duration::from_secs(120) {
            let _ = Command::new("kill")
                .args(["-KILL", &victim.to_string()])
                .status();
            let _ = child.kill();
            panic!("the job hung after a rank stopped: --comm-timeout 2 was not applied");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("timed out after 2s"), "{err}");
}
