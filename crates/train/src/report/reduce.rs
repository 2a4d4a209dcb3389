//! The data-parallel gradient all-reduce in the report: how long it took and how much of
//! it the backward did not hide ([`crate::GradReduceStats`]), per rank, and its slices in
//! the trace.

use std::time::Duration;

use candle_core::{Device, Tensor};
use serde::Serialize;
use switchyard_models::Model;

use super::median;
use super::pipeline::timed;
use crate::error::Result;
use crate::worker::{StepMetrics, Worker};
use crate::{GradReduceStats, ReduceSpan};

/// Width of a rank's [`reduce_row`].
pub(super) const REDUCE_WIDTH: usize = 3;

/// The op code of an all-reduce slice in the gathered trace rows (the executor's
/// actions use `Op::index`, from 0).
pub(super) const ALL_REDUCE_OP: f64 = -1.0;

/// The gradient all-reduce of the data-parallel group that waited longest for it
/// (medians over the steps after the first).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct GradReduceReport {
    /// A rank of that group (global).
    pub rank: usize,
    /// Milliseconds of communication a step: per all-reduce, the time the last replica
    /// to arrive spent in it (the others also wait for it), summed.
    pub total_ms: f64,
    /// Milliseconds of it the backward did not hide: from the end of the slowest
    /// replica's pipeline to the end of the all-reduces.
    pub exposed_ms: f64,
    /// Milliseconds by which the slowest replica's pipeline ended after the fastest's:
    /// waiting, which no overlap hides and which is not counted above.
    pub imbalance_ms: f64,
}

/// This rank's median exposed, imbalance and total (`total`, from [`totals`])
/// milliseconds over `steps` (after the first), or `-1`s when it reduced none.
pub(super) fn reduce_row(steps: &[StepMetrics], total: f64) -> [f64; REDUCE_WIDTH] {
    let timed: Vec<&GradReduceStats> = timed(steps)
        .iter()
        .filter_map(|s| s.grad_reduce.as_ref())
        .collect();
    if timed.is_empty() {
        return [-1.0; REDUCE_WIDTH];
    }
    let ms = |f: &dyn Fn(&GradReduceStats) -> Duration| {
        median(timed.iter().map(|g| 1e3 * f(g).as_secs_f64()).collect())
    };
    [ms(&|g| g.exposed), ms(&|g| g.imbalance), total]
}

/// The slot of a span in [`totals`]' rows: 0 for the all-reduce after the pipeline,
/// `1 + k` for bucket `k`.
fn slot(s: &ReduceSpan) -> usize {
    s.bucket.map_or(0, |k| k + 1)
}

fn spans(s: &StepMetrics) -> impl Iterator<Item = &ReduceSpan> {
    s.grad_reduce.iter().flat_map(|g| &g.spans)
}

/// This rank's median communication milliseconds a step ([`GradReduceReport::total_ms`]),
/// `-1` without data-parallel all-reduces. Collective over the world.
pub(super) fn totals<M: Model>(worker: &Worker<M>, steps: &[StepMetrics]) -> Result<f64> {
    let cfg = &worker.cfg;
    if cfg.dp == 1 || cfg.zero > 0 {
        return Ok(-1.0);
    }
    let world = &*worker.mesh.world;
    let timed = timed(steps);
    let mine = timed
        .iter()
        .flat_map(|s| spans(s).map(|x| slot(x) + 1))
        .max()
        .unwrap_or(0);
    let slots = world
        .all_gather(&Tensor::new(&[mine as f64], &Device::Cpu)?, 0)?
        .to_vec1::<f64>()?
        .into_iter()
        .fold(0.0f64, f64::max) as usize;
    let width = timed.len() * slots;
    if width == 0 {
        return Ok(-1.0);
    }
    let mut row = vec![0.0; width];
    for (t, s) in timed.iter().enumerate() {
        for x in spans(s) {
            row[t * slots + slot(x)] += x.dur_us / 1e3;
        }
    }
    let all = world
        .all_gather(&Tensor::from_vec(row, (1, width), &Device::Cpu)?, 0)?
        .flatten_all()?
        .to_vec1::<f64>()?;
    let mesh = cfg.mesh();
    let me = worker.mesh.coord;
    let group: Vec<&[f64]> = all
        .chunks(width)
        .enumerate()
        .filter(|&(r, _)| {
            let c = mesh.coord(r);
            (c.pp, c.tp) == (me.pp, me.tp)
        })
        .map(|(_, x)| x)
        .collect();
    let per_step = (0..timed.len())
        .map(|t| {
            (0..slots)
                .map(|k| {
                    let at = t * slots + k;
                    group.iter().map(|x| x[at]).fold(f64::MAX, f64::min)
                })
                .sum::<f64>()
        })
        .collect();
    Ok(median(per_step))
}

/// The group with the most exposed all-reduce, from every rank's [`reduce_row`] at
/// `at` in rows of `width`.
pub(super) fn worst(rows: &[f64], width: usize, at: usize) -> Option<GradReduceReport> {
    rows.chunks(width)
        .enumerate()
        .filter(|(_, r)| r[at] >= 0.0)
        .map(|(rank, r)| GradReduceReport {
            rank,
            exposed_ms: r[at],
            imbalance_ms: r[at + 1],
            total_ms: r[at + 2],
        })
        .max_by(|a, b| a.exposed_ms.total_cmp(&b.exposed_ms))
}

/// This rank's all-reduce slices as trace rows `[rank, step, -1, ALL_REDUCE_OP, bucket,
/// start, dur]`.
pub(super) fn trace_rows(me: f64, steps: &[StepMetrics]) -> Vec<f64> {
    let mut rows = Vec::new();
    for s in steps {
        for span in s.grad_reduce.iter().flat_map(|g| &g.spans) {
            rows.extend([
                me,
                s.step as f64,
                -1.0,
                ALL_REDUCE_OP,
                span.bucket.map_or(-1.0, |k| k as f64),
                span.start_us,
                span.dur_us,
            ]);
        }
    }
    rows
}

/// One line of the text report.
pub(super) fn line(r: &GradReduceReport, overlapped: bool) -> String {
    let share = 100.0 * r.exposed_ms / r.total_ms.max(1e-12);
    format!(
        "data-parallel gradient all-reduce: {:.2} ms a step, {:.2} ms ({share:.0}%) not \
         hidden behind the backward, replicas {:.2} ms apart (rank {}'s group, the most \
         exposed; {})\n",
        r.total_ms,
        r.exposed_ms,
        r.imbalance_ms,
        r.rank,
        match overlapped {
            true => "overlap_grad_reduce",
            false => "after the backward",
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_rank_is_the_one_that_waited_longest() {
        // Two ranks of width 4: [x, exposed, imbalance, total].
        let rows = [0.0, 1.0, 0.5, 4.0, 0.0, 3.0, 0.0, 5.0];
        let w = worst(&rows, 4, 1).unwrap();
        assert_eq!(
            (w.rank, w.exposed_ms, w.imbalance_ms, w.total_ms),
            (1, 3.0, 0.0, 5.0)
        );
        assert_eq!(worst(&[0.0, -1.0, -1.0, -1.0], 4, 1), None);
    }
}
