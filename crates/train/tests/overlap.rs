//! Data-parallel gradients all-reduced during the backward (`overlap_grad_reduce`,
//! issue 17 §3):
//!
//! - the gradients after a step are bit-identical to the all-reduce after the backward,
//!   for every data-parallel layout and schedule, with recomputation and with a split
//!   backward (the parity suite runs the overlapped path against the reference too:
//!   `testing::parallel_step` reduces as a step does);
//! - the report and the metrics give the all-reduce's total and exposed time, and the
//!   trace shows each bucket's all-reduce on a track of the rank's communication thread;
//! - no hangs: a replica that fails while the others all-reduce fails them with an error
//!   that names the all-reduce, the bucket, the rank and the peer.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::Arc;

use crate::common::*;
use switchyard_comm::local::Launcher;
use switchyard_comm::{Communicator, Counting};
use switchyard_models::GptConfig;
use switchyard_shard::ParamSource;
use switchyard_train::data::Corpus;
use switchyard_train::testing::schedules;
use switchyard_train::{train, Recompute, TrainConfig, TrainError, TrainOptions, Worker};

fn with_overlap(c: &TrainConfig<GptConfig>, on: bool) -> TrainConfig<GptConfig> {
    let mut c = c.clone();
    c.overlap_grad_reduce = on;
    c
}

/// The loss and every gradient of one step with overlap equal, bit for bit, those with
/// the all-reduce after the backward.
fn assert_identical(cfg: &TrainConfig<GptConfig>) {
    assert_close(cfg, 0.0)
}

/// The same within `tol` relative (`max |a − b| ≤ tol · max |b|` per tensor).
fn assert_close(cfg: &TrainConfig<GptConfig>, tol: f64) {
    assert!(cfg.dp > 1 && cfg.zero == 0);
    let (loss_on, on) = parallel_step(&with_overlap(cfg, true), 1);
    let (loss_off, off) = parallel_step(&with_overlap(cfg, false), 1);
    let what = format!("dp {} pp {} tp {} {}", cfg.dp, cfg.pp, cfg.tp, cfg.schedule);
    assert_eq!(loss_on, loss_off, "{what}: loss");
    assert_eq!(on.len(), off.len(), "{what}");
    for (name, a) in &on {
        let b = &off[name];
        let diff = rel_err(a, b);
        assert!(diff <= tol, "{what}: {name} differs by {diff} relative");
    }
}

#[test]
fn overlapped_gradients_are_bit_identical_on_every_data_parallel_layout() {
    for (dp, pp, tp) in [(2, 1, 1), (2, 2, 1), (2, 1, 2), (2, 2, 2), (4, 1, 1)] {
        for s in schedules(pp) {
            assert_identical(&tiny(dp, pp, tp, s));
        }
    }
    // A token table tied to the head: resident, all-reduced after the backward. On two
    // stages, bit for bit; on one, the executor runs the stage segment by segment for
    // the hooks, and the table's two uses (the embedding's segment, the head's) are
    // summed per microbatch in another order than one autograd graph sums them: f32
    // rounding, not a different sum (the parity suite holds it to the reference).
    let tied = |pp| {
        let mut c = tiny(2, pp, 1, "1f1b");
        c.model.tied_embeddings = true;
        c
    };
    assert_identical(&tied(2));
    assert_close(&tied(1), 1e-6);
    for recompute in [Recompute::Full, Recompute::Selective] {
        let mut c = tiny(2, 2, 1, "zb-h1");
        c.recompute = recompute;
        assert_identical(&c);
    }
}

/// Overlapped or not, the all-reduces move every gradient once a step (counted by
/// `Counting`): after the backward in `bucket_mib` buckets over the rank's `dp` group,
/// overlapped one bucket per block over the communication thread's own group.
#[test]
fn the_overlapped_all_reduces_move_every_gradient_once() {
    let c = tiny(2, 2, 1, "1f1b");
    let steps = 2;
    let corpus = Corpus::bundled();
    for on in [false, true] {
        let cfg = with_overlap(&c, on);
        let got = Launcher::new(cfg.world_size())
            .threads_per_worker(1)
            .run(|world: Arc<dyn Communicator>| {
                let (world, counts) = Counting::wrap_groups(world);
                let mut w = Worker::new(world, &cfg, &corpus, ParamSource::Init { seed: 1 })?;
                for step in 0..steps {
                    w.step(step)?.expect("finite");
                }
                let elems: usize = w.params().iter().map(|p| p.var.elem_count()).sum();
                let main = counts.traffic("dp", "all_reduce");
                let thread = counts.traffic("dp/grad-reduce", "all_reduce");
                Ok::<_, TrainError>((elems, main, thread))
            })
            .unwrap_or_else(|e| panic!("{e:#}"));
        for (elems, main, thread) in got {
            let bytes = (4 * elems * steps) as u128;
            match on {
                false => assert_eq!((main.bytes, thread.calls), (bytes, 0)),
                true => {
                    // 4 blocks a pipeline rank, nothing shared between them.
                    assert_eq!((main.calls, thread.bytes), (0, bytes));
                    assert_eq!(thread.calls, 4 * steps);
                }
            }
        }
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-overlap-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn the_report_metrics_and_trace_show_the_all_reduce() {
    for (pp, on) in [(1, true), (2, true), (1, false)] {
        let dir = scratch(&format!("pp{pp}-{on}"));
        let mut cfg = with_overlap(&tiny(2, pp, 1, "1f1b"), on);
        cfg.steps = 3;
        let opts = TrainOptions {
            metrics: Some(dir.join("m.jsonl")),
            trace: Some(dir.join("t.json")),
            ..TrainOptions::default()
        };
        let report = train(&cfg, &Corpus::bundled(), &opts).unwrap();
        let g = report.grad_reduce.expect("dp 2 reports its all-reduce");
        assert!(g.total_ms > 0.0, "{g:?}");
        assert!(g.exposed_ms >= 0.0 && g.imbalance_ms >= 0.0, "{g:?}");
        assert!(report
            .render(&cfg)
            .contains("data-parallel gradient all-reduce"));
        for line in std::fs::read_to_string(dir.join("m.jsonl"))
            .unwrap()
            .lines()
        {
            let l: serde_json::Value = serde_json::from_str(line).unwrap();
            for k in ["grad_reduce_exposed_ms", "grad_reduce_imbalance_ms"] {
                assert!(l[k].as_f64().unwrap() >= 0.0, "{k} in {l}");
            }
        }
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("t.json")).unwrap()).unwrap();
        let world = cfg.world_size();
        // Per (rank, step), the buckets its thread all-reduced.
        let mut buckets: BTreeMap<(usize, u64), BTreeSet<String>> = BTreeMap::new();
        for e in trace["traceEvents"].as_array().unwrap() {
            if e["cat"] == "all-reduce" {
                let rank = e["tid"].as_u64().unwrap() as usize - world;
                let step = e["args"]["step"].as_u64().unwrap();
                let name = e["name"].as_str().unwrap().to_string();
                assert!(buckets.entry((rank, step)).or_default().insert(name));
            }
        }
        if !on {
            // One all-reduce after each step's backward, on every rank.
            assert_eq!(buckets.len(), world * 3, "{buckets:?}");
            for b in buckets.values() {
                assert_eq!(
                    b.iter().collect::<Vec<_>>(),
                    ["all-reduce after the backward"]
                );
            }
            continue;
        }
        // Every rank, every step, the same buckets: one per transformer block (the
        // untied GPT shares no parameter between blocks, so nothing is left for after).
        assert_eq!(buckets.len(), world * 3, "{buckets:?}");
        let per_stage = cfg.model.n_layer / pp;
        for (key, b) in &buckets {
            assert_eq!(b.len(), per_stage, "{key:?}: {b:?}");
            assert!(
                b.iter().all(|n| n.starts_with("all-reduce bucket ")),
                "{b:?}"
            );
            assert_eq!(b, &buckets[&(key.0, 0)], "{key:?}");
        }
    }
}

/// No hangs: a replica that fails makes the other's step fail at the all-reduce its
/// communication thread was doing, with an error naming it, the bucket and both ranks.
#[test]
fn a_replica_that_fails_mid_all_reduce_fails_the_others_cleanly() {
    let c = tiny(2, 1, 1, "1f1b");
    assert!(c.overlap_grad_reduce, "the default");
    assert_a_failed_rank_fails_the_other(
        &c,
        &[
            "data-parallel gradient all-reduce of bucket",
            "all_reduce",
            "rank 0",
            "rank 1",
        ],
    );
}
