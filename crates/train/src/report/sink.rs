//! Rank 0's outputs while a run trains: each step's record in the metrics file, and the
//! progress line.

use std::io::{IsTerminal, Write};
use std::path::Path;
use std::time::Instant;

use super::StepRecord;
use crate::error::{Context, Result};

/// Rank 0's outputs while training: the metrics file and the progress display.
pub(crate) struct Sink {
    metrics: Option<std::fs::File>,
    progress: bool,
    tty: bool,
    steps: usize,
    start: Instant,
}

impl Sink {
    /// Opens the metrics file: a new run truncates it, a resumed run (`append`) adds its
    /// steps after the lines already there, so that resuming with the same `--metrics`
    /// never loses the earlier steps' records.
    pub(crate) fn open(
        metrics: Option<&Path>,
        append: bool,
        progress: bool,
        steps: usize,
    ) -> Result<Sink> {
        let metrics = match metrics {
            Some(p) => Some(
                std::fs::OpenOptions::new()
                    .create(true)
                    .write(true)
                    .append(append)
                    .truncate(!append)
                    .open(p)
                    .with_context(|| format!("cannot create --metrics {}", p.display()))?,
            ),
            None => None,
        };
        Ok(Sink {
            metrics,
            progress,
            tty: std::io::stderr().is_terminal(),
            steps,
            start: Instant::now(),
        })
    }

    pub(crate) fn step(&mut self, r: &StepRecord) {
        if let Some(f) = self.metrics.as_mut() {
            let _ = writeln!(f, "{}", serde_json::to_string(r).unwrap_or_default());
            let _ = f.flush();
        }
        if !self.progress {
            return;
        }
        let done = r.step + 1;
        let elapsed = self.start.elapsed().as_secs_f64();
        let eta = elapsed / done as f64 * self.steps.saturating_sub(done) as f64;
        let val = match r.val_loss {
            Some(v) => format!(" | val {v:.4}"),
            None => String::new(),
        };
        let model = match &r.summary {
            Some(s) => format!(" | {s}"),
            None => String::new(),
        };
        let line = format!(
            "step {done:>5}/{} loss {:.4}{val}{model} | {:>6.0} tok/s | lr {:.2e} | eta {:.0}s",
            self.steps, r.loss, r.tokens_per_s, r.lr, eta
        );
        if self.tty {
            let width = 24;
            let filled = (width * done / self.steps.max(1)).min(width);
            eprint!(
                "\r[{}{}] {line}",
                "#".repeat(filled),
                ".".repeat(width - filled)
            );
            // A line with a validation loss stays on the screen.
            if done >= self.steps || r.val_loss.is_some() {
                eprintln!();
            }
        } else if done == 1
            || done == self.steps
            || done.is_multiple_of((self.steps / 10).max(1))
            || r.val_loss.is_some()
        {
            eprintln!("{line}");
        }
    }
}
