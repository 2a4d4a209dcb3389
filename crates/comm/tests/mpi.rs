//! The MPI backend under `mpirun`: the conformance suite at several world sizes, and
//! failures that must end the whole job promptly (a rank that exits, dies of a signal,
//! aborts with an error, or times out).
//!
//! Each test runs `switchyard-comm-mpi-check` (src/bin) with
//! `mpirun --allow-run-as-root --oversubscribe -np N`. A watchdog kills any job that
//! outlives its bound, so a test can fail but never hang; failure tests also check that
//! the job ended well before the ranks' own 300 s timeout. Jobs run one at a time.
//!
//! Needs OpenMPI (`scripts/install-mpi.sh`):
//! `cargo test -p switchyard-comm --features mpi --test mpi`.
#![cfg(feature = "mpi")]

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

const CHECK: &str = env!("CARGO_BIN_EXE_switchyard-comm-mpi-check");
/// No job may run longer than this (the watchdog).
const WATCHDOG: Duration = Duration::from_secs(180);
/// A failing job must end within this: far below the ranks' 300 s timeout, so the end
/// came from mpirun, not from a rank giving up.
const PROMPT: Duration = Duration::from_secs(60);

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

struct Job {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

impl std::fmt::Display for Job {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "exit code {:?} after {:?}\n--- stdout\n{}\n--- stderr\n{}",
            self.code, self.elapsed, self.stdout, self.stderr
        )
    }
}

fn pipe_to_string(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = r.read_to_string(&mut s);
        s
    })
}

/// Runs `mpirun -np <np> switchyard-comm-mpi-check <mode>` under the watchdog.
fn mpirun(np: usize, mode: &str, env: &[(&str, &str)]) -> Job {
    let _serial = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let start = Instant::now();
    let mut child = Command::new("mpirun")
        .args([
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            &np.to_string(),
            CHECK,
            mode,
        ])
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("cannot run mpirun ({e}): install OpenMPI with scripts/install-mpi.sh")
        });
    let out = pipe_to_string(child.stdout.take().unwrap());
    let err = pipe_to_string(child.stderr.take().unwrap());
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait for mpirun") {
            break s;
        }
        if start.elapsed() > WATCHDOG {
            // SIGTERM lets mpirun kill its ranks; SIGKILL if it does not go.
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            std::thread::sleep(Duration::from_secs(5));
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "mpirun -np {np} {mode} still ran after {WATCHDOG:?} (killed)\n--- stdout\n{}\n--- stderr\n{}",
                out.join().unwrap(),
                err.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Job {
        code: status.code(),
        stdout: out.join().unwrap(),
        stderr: err.join().unwrap(),
        elapsed: start.elapsed(),
    }
}

fn conformance(np: usize) {
    let job = mpirun(np, "conformance", &[]);
    assert_eq!(job.code, Some(0), "{job}");
    let want = format!("conformance: ok on {np} ranks");
    assert!(job.stdout.contains(&want), "{job}");
}

#[test]
fn conformance_on_1_rank() {
    conformance(1);
}

#[test]
fn conformance_on_2_ranks() {
    conformance(2);
}

#[test]
fn conformance_on_3_ranks() {
    conformance(3);
}

#[test]
fn conformance_on_4_ranks() {
    conformance(4);
}

#[test]
fn conformance_on_8_ranks_with_a_2x2x2_mesh() {
    conformance(8);
}

#[test]
fn finalize_happens_when_the_last_communicator_is_dropped() {
    let job = mpirun(2, "lifetime", &[]);
    assert_eq!(job.code, Some(0), "{job}");
    assert!(job.stdout.contains("lifetime: ok"), "{job}");
}

/// The job failed promptly (with `code`), and no rank's wait returned.
fn assert_ended_by_mpirun(job: &Job, code: Option<i32>) {
    assert_ne!(job.code, Some(0), "the job succeeded: {job}");
    if code.is_some() {
        assert_eq!(job.code, code, "{job}");
    }
    assert!(
        job.elapsed < PROMPT,
        "the job took {:?}: {job}",
        job.elapsed
    );
    assert!(
        !job.stderr.contains("the wait returned"),
        "a wait returned: {job}"
    );
}

#[test]
fn a_rank_that_exits_during_a_recv_ends_the_job() {
    let job = mpirun(3, "exit-in-recv", &[]);
    assert_ended_by_mpirun(&job, Some(3));
    assert!(job.stderr.contains("Exit code:    3"), "{job}");
}

#[test]
fn a_rank_that_exits_during_an_all_reduce_ends_the_job() {
    let job = mpirun(3, "exit-in-all-reduce", &[]);
    assert_ended_by_mpirun(&job, Some(3));
    assert!(job.stderr.contains("Exit code:    3"), "{job}");
}

#[test]
fn a_rank_killed_by_a_signal_ends_the_job() {
    let job = mpirun(3, "signal-in-recv", &[]);
    assert_ended_by_mpirun(&job, None);
    assert!(job.stderr.contains("rank 1 with PID"), "{job}");
    assert!(job.stderr.contains("signal"), "{job}");
}

#[test]
fn a_rank_that_fails_aborts_the_job_and_is_named() {
    // Only `abort`'s own line is checked: OpenMPI 4.1's "MPI_ABORT was invoked on rank
    // R" banner is sometimes lost ("ORTE_ERROR_LOG: ... show_help.c") when the job
    // ends quickly.
    let job = mpirun(3, "error-abort", &[]);
    assert_ended_by_mpirun(&job, Some(2));
    assert!(
        job.stderr
            .contains("rank 1 failed: the loss is NaN at step 3"),
        "{job}"
    );
}

#[test]
fn a_recv_times_out_naming_op_rank_and_peer() {
    let job = mpirun(2, "timeout-recv", &[("SWITCHYARD_COMM_TIMEOUT_SECS", "1")]);
    assert_ended_by_mpirun(&job, Some(4));
    let msg = "rank 0 failed: recv on rank 0 timed out after 1s waiting for peer rank 1";
    assert!(job.stderr.contains(msg), "{job}");
    // After a timeout the communicators refuse further work instead of waiting again.
    assert!(
        job.stderr
            .contains("then: barrier on rank 0 (waiting for group world[0,1]) abandoned"),
        "{job}"
    );
}

#[test]
fn an_all_reduce_times_out_naming_op_rank_and_group() {
    let job = mpirun(
        3,
        "timeout-all-reduce",
        &[("SWITCHYARD_COMM_TIMEOUT_SECS", "1")],
    );
    assert_ended_by_mpirun(&job, Some(4));
    // Ranks 0 and 2 both time out; whichever aborts first may stop the other's report.
    let named = [0, 2].iter().any(|r| {
        let msg = format!("rank {r} failed: all_reduce on rank {r} timed out after 1s waiting for group world[0,1,2]");
        job.stderr.contains(&msg)
    });
    assert!(named, "{job}");
}

#[test]
fn a_malformed_timeout_is_refused() {
    let job = mpirun(
        1,
        "conformance",
        &[("SWITCHYARD_COMM_TIMEOUT_SECS", "soon")],
    );
    assert_eq!(job.code, Some(1), "{job}");
    assert!(
        job.stderr.contains("SWITCHYARD_COMM_TIMEOUT_SECS=\"soon\""),
        "{job}"
    );
}

/// The one case mpirun cannot see: a rank that finishes normally while others still wait
/// for it. They reach their timeout, and abort.
#[test]
fn a_rank_that_leaves_early_makes_the_others_time_out() {
    let job = mpirun(2, "leave-early", &[("SWITCHYARD_COMM_TIMEOUT_SECS", "2")]);
    assert_ended_by_mpirun(&job, Some(4));
    let msg = "rank 0 failed: recv on rank 0 timed out after 2s waiting for peer rank 1";
    assert!(job.stderr.contains(msg), "{job}");
}

/// A process that failed does not finalise when its communicators are dropped (an
/// abandoned operation could make MPI_Finalize wait forever), so even a binary that
/// forgets to abort ends the job with an error.
#[test]
fn a_failed_process_that_returns_still_fails_the_job() {
    let job = mpirun(
        2,
        "timeout-then-return",
        &[("SWITCHYARD_COMM_TIMEOUT_SECS", "1")],
    );
    assert_ended_by_mpirun(&job, None);
    assert!(job.stderr.contains("rank 0 with PID"), "{job}");
    assert!(job.stderr.contains("exiting improperly"), "{job}");
}
