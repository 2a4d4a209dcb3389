use super::*;

#[test]
fn the_bubble_counts_a_rank_idle_until_the_slowest_rank_is_done() {
    // Two ranks, one stage each (v = 1), two timed steps. Rows: peak, (stage, peak),
    // compute of each step, wall of each step. Rank 1 computes as much as rank 0 but
    // finishes its own part early: it is idle until rank 0 ends the step.
    let rows = [
        [2.0, 0.0, 2.0, 0.8, 0.8, 1.0, 1.0],
        [1.0, 1.0, 1.0, 0.8, 0.6, 0.9, 1.2],
    ]
    .concat();
    let b = median_bubbles(&rows, 7, 3, 2);
    // Step 0: makespan 1.0 → 0.2, 0.2; step 1: makespan 1.2 → 1/3, 0.5.
    // The median of two values is the larger one (index len / 2).
    assert!((b[0] - (1.0 - 0.8 / 1.2)).abs() < 1e-12, "{b:?}");
    assert!((b[1] - 0.5).abs() < 1e-12, "{b:?}");
}
