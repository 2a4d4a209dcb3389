//! ZeRO 2 and 3's gradient reduce-scatters on their communication thread (issue 17 §3,
//! `overlap_grad_reduce`, [`switchyard_train::zero::Scatterer`]): the same losses, bit for
//! bit, as on the rank's own thread, and no hang when a replica fails. Its traffic is
//! counted in `tests/zero.rs`.

use crate::common::*;
use switchyard_train::data::Corpus;
use switchyard_train::{train, TrainConfig, TrainOptions};

/// ZeRO 2 and 3's reduce-scatters on their communication thread (`overlap_grad_reduce`,
/// the default) add the same shards in the same order as on the rank's own thread: the
/// losses of every step are equal to the bit.
#[test]
fn reduce_scatters_on_the_thread_train_the_same_losses_bit_for_bit() {
    for (dp, pp, tp, s) in [(2, 1, 1, "1f1b"), (2, 2, 1, "zb-h1"), (2, 1, 2, "1f1b")] {
        for zero in [2, 3] {
            let mut c = with_zero(&tiny(dp, pp, tp, s), zero);
            c.steps = 3;
            let losses = |overlap: bool| -> Vec<f64> {
                let c = TrainConfig {
                    overlap_grad_reduce: overlap,
                    ..c.clone()
                };
                let r = train(&c, &Corpus::bundled(), &TrainOptions::default()).unwrap();
                r.steps.iter().map(|s| s.loss).collect()
            };
            assert_eq!(
                losses(true),
                losses(false),
                "dp {dp} pp {pp} tp {tp} {s} zero {zero}"
            );
        }
    }
}

/// No hangs: a replica that fails while the other's reduce-scatter thread works on a
/// bucket makes that step fail with an error naming the reduce-scatter, the bucket and
/// both ranks.
#[test]
fn a_replica_that_fails_mid_reduce_scatter_fails_the_others_cleanly() {
    let c = with_zero(&tiny(2, 1, 1, "1f1b"), 2);
    assert!(c.overlaps_reduce_scatter(), "the default");
    assert_a_failed_rank_fails_the_other(
        &c,
        &[
            "ZeRO: the gradient reduce-scatter of bucket",
            "reduce_scatter",
            "rank 0",
            "rank 1",
        ],
    );
}
