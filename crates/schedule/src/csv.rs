//! CSV form of a [`Program`]: one row per rank, `0,0F0,0F1,0B0,0B1`.
//!
//! The first column is the rank index, the others its actions in order.
//! Blank lines and lines starting with `#` are comments; empty fields (a
//! trailing comma) are ignored. Rows may come in any order, but every rank
//! from 0 to the largest index must have exactly one row. On loading,
//! `stage_to_rank`, `num_stages` and `num_microbatches` are inferred as in
//! [`Program::from_rank_actions`]. This is the format for hand-written
//! custom schedules.

use std::path::Path;

use crate::action::Action;
use crate::error::{Result, ScheduleError};
use crate::program::{assemble_ranks, Program};

impl Program {
    /// The CSV text: a `#` comment line, then one row per rank.
    pub fn to_csv(&self) -> String {
        let mut out = format!(
            "# switchyard schedule: {} stages, {} microbatches, {} ranks\n",
            self.num_stages,
            self.num_microbatches,
            self.num_ranks()
        );
        for (r, actions) in self.ranks.iter().enumerate() {
            out.push_str(&r.to_string());
            for a in actions {
                out.push(',');
                out.push_str(&a.to_string());
            }
            out.push('\n');
        }
        out
    }

    /// Parses CSV text: one row per rank, `0,0F0,0F1,0B0,0B1`.
    ///
    /// The first column is the rank index, the others its actions in order.
    /// Blank lines and lines starting with `#` are comments; empty fields (a
    /// trailing comma) are ignored. Rows may come in any order, but every
    /// rank from 0 to the largest index must have exactly one row.
    /// `stage_to_rank`, `num_stages` and `num_microbatches` are inferred as in
    /// [`Program::from_rank_actions`].
    pub fn from_csv(text: &str) -> Result<Program> {
        let mut rows = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut fields = line.split(',').map(str::trim);
            let first = fields.next().unwrap_or_default();
            let rank = first.parse::<usize>().map_err(|_| {
                ScheduleError::Parse(format!(
                    "CSV line {}: the first column must be the rank index, got {first:?}",
                    n + 1
                ))
            })?;
            let actions = fields
                .filter(|f| !f.is_empty())
                .map(|f| {
                    f.parse::<Action>()
                        .map_err(|e| ScheduleError::Parse(format!("CSV line {}: {e}", n + 1)))
                })
                .collect::<Result<Vec<_>>>()?;
            rows.push((rank, actions));
        }
        if rows.is_empty() {
            return Err(ScheduleError::Parse("CSV has no rank rows".into()));
        }
        Program::from_rank_actions(assemble_ranks(rows)?)
    }

    /// Reads a CSV file.
    pub fn load_csv(path: impl AsRef<Path>) -> Result<Program> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ScheduleError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Program::from_csv(&text).map_err(|e| match e {
            ScheduleError::Parse(m) => ScheduleError::Parse(format!("{}: {m}", path.display())),
            ScheduleError::Invalid(m) => ScheduleError::Invalid(format!("{}: {m}", path.display())),
            other => other,
        })
    }

    /// Writes the CSV text to a file.
    pub fn save_csv(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        std::fs::write(path, self.to_csv()).map_err(|source| ScheduleError::Io {
            path: path.display().to_string(),
            source,
        })
    }
}
