//! Ctrl-C and SIGTERM during `train`: the first signal asks the trainer to stop after the
//! current step (and save a checkpoint); a second one ends the process at once.

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Context;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::low_level;
use switchyard_train::TrainReport;

/// The exit status after a signal: 128 + its number.
const SIGINT_EXIT: i32 = 128 + SIGINT;
const SIGTERM_EXIT: i32 = 128 + SIGTERM;

/// The installed handlers: `stop` is what the trainer checks at each step boundary.
pub struct Signals {
    pub stop: Arc<AtomicBool>,
    which: Arc<AtomicUsize>,
}

/// Installs the handlers for SIGINT and SIGTERM.
pub fn install() -> anyhow::Result<Signals> {
    let stop = Arc::new(AtomicBool::new(false));
    let which = Arc::new(AtomicUsize::new(0));
    // Signals received so far, SIGINT and SIGTERM together: one counter, so that of two
    // signals handled at once on two threads exactly one is the first.
    let seen = Arc::new(AtomicUsize::new(0));
    for (sig, code) in [(SIGINT, SIGINT_EXIT), (SIGTERM, SIGTERM_EXIT)] {
        let (stop, which, seen) = (Arc::clone(&stop), Arc::clone(&which), Arc::clone(&seen));
        let action = move || {
            if seen.fetch_add(1, Ordering::SeqCst) > 0 {
                low_level::exit(code);
            }
            which.store(sig as usize, Ordering::SeqCst);
            stop.store(true, Ordering::SeqCst);
        };
        // SAFETY: the action runs inside a signal handler, where only async-signal-safe
        // work is allowed: it does atomic operations on values it owns and may call
        // `_exit` (`low_level::exit`); it allocates, locks and prints nothing.
        unsafe { low_level::register(sig, action) }
            .context("cannot install the signal handlers")?;
    }
    Ok(Signals { stop, which })
}

impl Signals {
    /// Says where the run stopped and how to continue it; returns the exit status.
    pub fn report(&self, report: &TrainReport, total: usize, dir: Option<&Path>) -> i32 {
        let (name, code) = match self.which.load(Ordering::SeqCst) as i32 {
            SIGTERM => ("SIGTERM", SIGTERM_EXIT),
            _ => ("SIGINT", SIGINT_EXIT),
        };
        let done = report.steps.last().map(|s| s.step + 1).unwrap_or(0);
        eprintln!("switchyard: stopped by {name} after step {done} of {total}");
        match (&report.last_checkpoint, dir) {
            (Some(ckpt), Some(dir)) => {
                let args: Vec<String> = std::env::args().skip(1).collect();
                eprintln!("switchyard: saved the checkpoint {}", ckpt.display());
                eprintln!(
                    "switchyard: to continue: {}",
                    resume_command(&args, dir)
                );
            }
            _ => eprintln!(
                "switchyard: no checkpoint was saved (no --checkpoint-dir); the run cannot be resumed"
            ),
        }
        code
    }
}

/// The command that resumes a run started with `args` (without the program name) from
/// `dir`: the same flags, with `--resume --checkpoint-dir DIR` in place of any resume,
/// overwrite or checkpoint-directory flags.
pub fn resume_command(args: &[String], dir: &Path) -> String {
    let mut out = vec!["switchyard".to_string()];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--resume" | "--overwrite" => {}
            "--resume-from" | "--checkpoint-dir" => {
                it.next();
            }
            s if s.starts_with("--resume-from=") || s.starts_with("--checkpoint-dir=") => {}
            s => out.push(quote(s)),
        }
    }
    out.push("--resume --checkpoint-dir".into());
    out.push(quote(&dir.to_string_lossy()));
    out.join(" ")
}

/// `s` as one shell word.
fn quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-./=,:+@%".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_resume_command_keeps_the_flags_and_replaces_the_resume_ones() {
        let args: Vec<String> = [
            "train",
            "--steps",
            "9",
            "--checkpoint-dir",
            "old",
            "--resume-from",
            "4",
            "--overwrite",
            "--data",
            "my text.txt",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            resume_command(&args, Path::new("/tmp/ck")),
            "switchyard train --steps 9 --data 'my text.txt' --resume --checkpoint-dir /tmp/ck"
        );
    }
}
