//! The pipeline figures of the report: each rank's row (peaks, step timings, mean
//! action times) and what is computed from every rank's rows (the measured bubbles, the
//! costs a split backward's bubble is predicted with).

use std::collections::BTreeMap;
use std::time::Duration;

use switchyard_pipeline::step_bubbles;
use switchyard_schedule::{Costs, Op};

use super::median;
use crate::worker::StepMetrics;

/// The steps whose timings count: all but the first (which includes warming up), unless
/// there is only one.
pub(super) fn timed(steps: &[StepMetrics]) -> &[StepMetrics] {
    &steps[usize::from(steps.len() > 1)..]
}

/// This rank's pipeline figures, as a fixed-size row: peak, then `(stage, peak)` for up
/// to `v` stages (padded with −1), then the executor's compute and wall seconds of each
/// [`timed`] step, then the mean `F`, `B`, `I` and `W` ([`action_means`]).
pub(super) fn rank_row(steps: &[StepMetrics], v: usize) -> Vec<f64> {
    let mut per_stage: BTreeMap<u32, usize> = BTreeMap::new();
    for s in steps {
        for (&k, &p) in &s.exec.peak_per_stage {
            let e = per_stage.entry(k).or_default();
            *e = (*e).max(p);
        }
    }
    let mut row = vec![steps
        .iter()
        .map(|s| s.exec.peak_activations)
        .max()
        .unwrap_or(0) as f64];
    for i in 0..v {
        match per_stage.iter().nth(i) {
            Some((&k, &p)) => row.extend([k as f64, p as f64]),
            None => row.extend([-1.0, -1.0]),
        }
    }
    let timed = timed(steps);
    row.extend(timed.iter().map(|s| s.exec.compute.as_secs_f64()));
    row.extend(timed.iter().map(|s| s.exec.wall.as_secs_f64()));
    row.extend(action_means(timed));
    row
}

/// Entries of [`action_means`].
pub(super) const MEANS_WIDTH: usize = 4;

/// This rank's mean duration of its `F`, `B`, `I` and `W` actions over `steps`, in
/// microseconds (0 for a kind it never ran).
fn action_means(steps: &[StepMetrics]) -> [f64; MEANS_WIDTH] {
    [Op::F, Op::B, Op::I, Op::W].map(|op| {
        let (t, n) = steps
            .iter()
            .filter_map(|s| s.exec.compute_by_op.get(&op))
            .fold((0.0, 0), |(t, n), (d, k)| {
                (t + d.as_secs_f64() * 1e6, n + k)
            });
        if n == 0 {
            0.0
        } else {
            t / n as f64
        }
    })
}

/// The costs a split backward's run predicts its bubble with: the mean `F`, `I` and `W`
/// measured on every rank (`rows` of [`rank_row`], the means `at` each row's offset), in
/// units of `F` (the defaults where nothing was measured).
pub(super) fn measured_split_costs(rows: &[f64], width: usize, at: usize) -> Costs {
    let ranks = rows.len() / width.max(1);
    let mean = |k: usize| {
        let v: Vec<f64> = (0..ranks)
            .map(|r| rows[r * width + at + k])
            .filter(|&x| x > 0.0)
            .collect();
        match v.is_empty() {
            true => 0.0,
            false => v.iter().sum::<f64>() / v.len() as f64,
        }
    };
    let (f, i, w) = (mean(0), mean(2), mean(3));
    match f > 0.0 && i > 0.0 && w > 0.0 {
        true => Costs {
            f: 1.0,
            i: i / f,
            w: w / f,
            ..Costs::default()
        },
        false => Costs::default(),
    }
}

/// The median over steps of each rank's bubble (see [`switchyard_pipeline::step_bubbles`]),
/// from every rank's row of [`rank_row`]: `n` steps of `(compute, wall)` from `offset`.
pub(super) fn median_bubbles(rows: &[f64], width: usize, offset: usize, n: usize) -> Vec<f64> {
    let ranks = rows.len() / width;
    let secs = Duration::from_secs_f64;
    let mut per_rank = vec![Vec::with_capacity(n); ranks];
    for step in 0..n {
        let timings: Vec<(Duration, Duration)> = (0..ranks)
            .map(|r| {
                let row = &rows[r * width + offset..];
                (secs(row[step]), secs(row[n + step]))
            })
            .collect();
        for (r, b) in step_bubbles(&timings).into_iter().enumerate() {
            per_rank[r].push(b);
        }
    }
    per_rank.into_iter().map(median).collect()
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// The mean `F`, `I` and `W` over the ranks that ran them, in units of `F`; the
    /// defaults when a kind was never measured.
    #[test]
    fn split_costs_are_the_measured_means_over_the_ranks() {
        // Two ranks, rows of width 6 with the means at 2: F, B, I, W.
        let rows = [
            9.0, 9.0, 100.0, 0.0, 150.0, 40.0, 9.0, 9.0, 300.0, 0.0, 250.0, 80.0,
        ];
        let c = measured_split_costs(&rows, 6, 2);
        assert_eq!((c.f, c.i, c.w), (1.0, 200.0 / 200.0, 60.0 / 200.0));
        let none = [9.0, 9.0, 100.0, 200.0, 0.0, 0.0];
        let d = measured_split_costs(&none, 6, 2);
        assert_eq!((d.f, d.b, d.i, d.w), (1.0, 2.0, 1.0, 1.0));
    }

    fn step(by_op: &[(Op, u64, usize)]) -> StepMetrics {
        let mut exec = switchyard_pipeline::StepStats::default();
        for &(op, ms, n) in by_op {
            exec.compute_by_op
                .insert(op, (Duration::from_millis(ms), n));
        }
        StepMetrics {
            step: 0,
            loss: 0.0,
            grad_norm: 0.0,
            lr: 0.0,
            seconds: 0.0,
            exec,
            val_loss: None,
            grad_reduce: None,
            model: Vec::new(),
            expert_comm: Vec::new(),
        }
    }

    /// The means come from the per-kind totals the executor keeps, not from the trace's
    /// events (which a run without `--trace` drops): a split backward's bubble is then
    /// predicted with its measured `I` and `W` whether or not a trace is written.
    #[test]
    fn the_mean_action_times_need_no_trace() {
        let steps = [
            step(&[(Op::F, 40, 4), (Op::I, 48, 4), (Op::W, 32, 4)]),
            step(&[(Op::F, 60, 4), (Op::I, 72, 4), (Op::W, 48, 4)]),
        ];
        assert!(steps.iter().all(|s| s.exec.events.is_empty()));
        assert_eq!(action_means(&steps), [12_500.0, 0.0, 15_000.0, 10_000.0]);
        let row = action_means(&steps);
        let costs = measured_split_costs(&row, MEANS_WIDTH, 0);
        assert_eq!((costs.f, costs.i, costs.w), (1.0, 1.2, 0.8));
    }
}
