//! The time model's formulas on round numbers ([`super::predict_step_time`]).

use super::*;
use switchyard_models::GptConfig;
use switchyard_schedule::{simulate, ScheduleChoice, ScheduleKind};

/// Round numbers: 1 GFLOP/s a thread, no overhead, 1 ms and 1 GB/s per collective.
fn tm() -> TimeModel {
    let mut tm = TimeModel::linear(1e9, 0.0);
    tm.curves[0].thread_efficiency = vec![1.0, 1.0];
    TimeModel {
        p2p: AlphaBeta {
            alpha_s: 0.0,
            bytes_per_s: 1e9,
        },
        collective: AlphaBeta {
            alpha_s: 1e-3,
            bytes_per_s: 1e9,
        },
        ..tm
    }
}

fn cfg(dp: usize, pp: usize, tp: usize) -> TrainConfig<GptConfig> {
    TrainConfig {
        model: GptConfig::tiny(4),
        dp,
        pp,
        tp,
        schedule: ScheduleChoice::Named(ScheduleKind::OneFOneB),
        microbatches: 4,
        batch: 8,
        seq_len: 16,
        threads_per_worker: 1,
        ..TrainConfig::default()
    }
}

fn flops_per_step(c: &TrainConfig<GptConfig>) -> f64 {
    let k = c.model.costs(c.seq_len);
    c.tokens_per_step() as f64 * (k.embed + k.blocks.iter().sum::<f64>() + k.head)
}

#[test]
fn one_worker_is_its_flops_over_the_rate() {
    let c = cfg(1, 1, 1);
    let s = predict_step_time(&c, &tm()).unwrap();
    let want = flops_per_step(&c) / 1e9;
    assert!((s.seconds - want).abs() < 1e-12 * want, "{s:?} {want}");
    assert_eq!((s.tp_comm_s, s.p2p_s, s.dp_allreduce_s), (0.0, 0.0, 0.0));
    assert_eq!(s.bubble_fraction, 0.0);
    // Two threads at full efficiency halve it; at none they do nothing.
    let two = TrainConfig {
        threads_per_worker: 2,
        ..c.clone()
    };
    let half = predict_step_time(&two, &tm()).unwrap().seconds;
    assert!((half - want / 2.0).abs() < 1e-12 * want);
    let mut flat = tm();
    flat.curves[0].thread_efficiency = vec![0.0, 0.0];
    assert_eq!(predict_step_time(&two, &flat).unwrap().seconds, s.seconds);
}

/// More compute threads than cores take turns: each part slows down by threads / cores
/// and the optimizer (one thread a worker) by workers / cores, and neither speeds up
/// when there are cores to spare.
#[test]
fn workers_beyond_the_cores_take_turns() {
    let tm = |cores| TimeModel {
        optimizer_s_per_param: 1e-9,
        cores,
        ..tm()
    };
    // 4 replicas (2 sequences, 1 microbatch each), a thread each; 2 threads each.
    let four = TrainConfig {
        microbatches: 1,
        ..cfg(4, 1, 1)
    };
    let eight = TrainConfig {
        threads_per_worker: 2,
        ..four.clone()
    };
    let own = predict_step_time(&four, &tm(None)).unwrap();
    for (c, cores, turns, optimizer_turns) in [
        (&four, 8, 1.0, 1.0),
        (&four, 4, 1.0, 1.0),
        (&four, 2, 2.0, 2.0),
        (&eight, 4, 2.0, 1.0),
        (&eight, 2, 4.0, 2.0),
    ] {
        let base = predict_step_time(c, &tm(None)).unwrap();
        let s = predict_step_time(c, &tm(Some(cores))).unwrap();
        assert!(
            (s.compute_s - turns * base.compute_s).abs() < 1e-12 * s.compute_s,
            "{s:?}"
        );
        assert!(
            (s.optimizer_s - optimizer_turns * base.optimizer_s).abs() < 1e-15,
            "{s:?}"
        );
        assert!(s.optimizer_s > 0.0);
        // The all-reduce is not compute (a longer backward hides more of it).
        assert!(s.dp_allreduce_s <= base.dp_allreduce_s, "{s:?}");
    }
    // Two threads at full efficiency on 2 cores shared by 4 workers: no faster than one.
    let shared = predict_step_time(&eight, &tm(Some(2))).unwrap();
    assert!((shared.compute_s - 2.0 * own.compute_s).abs() < 1e-12 * own.compute_s);
}

#[test]
fn a_step_pays_its_fixed_costs_once() {
    let fixed = TimeModel {
        step_overhead_s: 1e-3,
        world_overhead_s: 2e-3,
        ..tm()
    };
    for (workers, overhead) in [
        (cfg(1, 1, 1), 1e-3),
        (cfg(2, 1, 1), 3e-3),
        (cfg(1, 2, 1), 3e-3),
    ] {
        let with = predict_step_time(&workers, &fixed).unwrap();
        let without = predict_step_time(&workers, &tm()).unwrap();
        assert!((with.overhead_s - overhead).abs() < 1e-15, "{with:?}");
        assert!((with.seconds - without.seconds - overhead).abs() < 1e-12);
    }
}

#[test]
fn doubling_tp_halves_compute_and_adds_the_all_reduces() {
    let (one, two) = (cfg(1, 1, 1), cfg(1, 1, 2));
    let a = predict_step_time(&one, &tm()).unwrap();
    let b = predict_step_time(&two, &tm()).unwrap();
    assert!((b.compute_s - a.compute_s / 2.0).abs() < 1e-12);
    // Per microbatch: 4 layers × (2 + 2) all-reduces of n · d · 4 bytes, the
    // embeddings' and the head's backward one more each, the loss's two of n · 4.
    let n = (two.microbatch_size() * two.seq_len) as f64;
    let act = 1e-3 + n * 32.0 * 4.0 / 1e9;
    let want = 4.0 * (4.0 * 4.0 * act + 2.0 * act + 2.0 * (1e-3 + n * 4.0 / 1e9));
    assert!((b.tp_comm_s - want).abs() < 1e-12, "{} {want}", b.tp_comm_s);
    // And the world's all-gather of the losses: one latency.
    assert!((b.seconds - (a.seconds / 2.0 + want + 1e-3)).abs() < 1e-9);
}

#[test]
fn a_pipeline_bubble_is_the_simulators() {
    // A wide model with a small vocabulary: the head and embeddings are nearly free.
    let c = TrainConfig {
        model: GptConfig {
            vocab_size: 8,
            d_model: 64,
            ..GptConfig::tiny(4)
        },
        ..cfg(1, 2, 1)
    };
    let s = predict_step_time(&c, &tm()).unwrap();
    // Each stage by hand: its FLOPs over the rate, a third forward; messages of
    // n · d · 4 bytes at 1 GB/s, half to the send and half to the receive.
    let k = c.model.costs(c.seq_len);
    let n = (c.microbatch_size() * c.seq_len) as f64;
    let stage = |extra: f64| {
        let t = n * (2.0 * k.blocks[0] + extra) / 1e9;
        let b = 2.0 * t / 3.0;
        Costs {
            f: t / 3.0,
            b,
            i: b / 2.0,
            w: b / 2.0,
            comm: n * 64.0 * 4.0 / 1e9 / 2.0,
        }
    };
    let program = c.program().unwrap();
    let sim = simulate_by_stage(&program, &[stage(k.embed), stage(k.head)]).unwrap();
    assert!((s.pipeline_s - sim.makespan).abs() < 1e-12 * sim.makespan);
    assert!((s.bubble_fraction - sim.bubble_fraction).abs() < 1e-12);
    // Which is close to the textbook (p − 1)/(m + p − 1) of even stages.
    let even = simulate(&program, &Costs::default()).unwrap();
    assert!((even.bubble_fraction - 1.0 / 5.0).abs() < 1e-12);
    assert!(
        (s.bubble_fraction - even.bubble_fraction).abs() < 0.02,
        "{s:?}"
    );
    assert!(s.p2p_s > 0.0);
}

/// [`cfg`] with the data-parallel all-reduce after the backward.
fn after_backward(dp: usize, pp: usize, tp: usize) -> TrainConfig<GptConfig> {
    TrainConfig {
        overlap_grad_reduce: false,
        ..cfg(dp, pp, tp)
    }
}

#[test]
fn overlap_hides_all_but_the_first_block_and_the_tied_table() {
    for tied in [false, true] {
        let mut c = cfg(2, 1, 1);
        c.model.tied_embeddings = tied;
        let mut whole = c.clone();
        whole.overlap_grad_reduce = false;
        // A fast link: 0.1 ms and 10 GB/s.
        let tm = TimeModel {
            collective: AlphaBeta {
                alpha_s: 1e-4,
                bytes_per_s: 1e10,
            },
            ..tm()
        };
        let s = predict_step_time(&c, &tm).unwrap();
        let whole = predict_step_time(&whole, &tm).unwrap();
        // tiny(4): 4 blocks, whose all-reduces (under 0.2 ms each) the backward of the
        // last microbatch (about 4 ms) covers but the first's: what shows is one block's
        // all-reduce, and the tied token table's after the backward.
        let m = &c.model;
        let bytes = 4.0 * m.param_count() as f64;
        let table = match tied {
            true => 4.0 * (m.vocab_size * m.d_model) as f64,
            false => 0.0,
        };
        let mut want = 1e-4 + (bytes - table) / 4.0 / 1e10;
        if tied {
            want += 1e-4 + table / 1e10;
        }
        assert!((s.dp_allreduce_s - want).abs() < 1e-12, "{s:?} {want}");
        // Untied, a quarter of the bytes show; tied, the table's all-reduce pays a
        // second latency, which on this small model outweighs what the overlap hides.
        assert_eq!(s.dp_allreduce_s < whole.dp_allreduce_s, !tied);
        let saved = whole.dp_allreduce_s - s.dp_allreduce_s;
        assert!((whole.seconds - s.seconds - saved).abs() < 1e-9, "{tied}");
    }
}

#[test]
fn data_parallel_adds_the_gradient_all_reduce() {
    let s = predict_step_time(&after_backward(2, 1, 1), &tm()).unwrap();
    let one = predict_step_time(&cfg(1, 1, 1), &tm()).unwrap();
    let bytes = 4.0 * GptConfig::tiny(4).param_count() as f64;
    let want = 1e-3 + bytes / 1e9;
    assert!((s.dp_allreduce_s - want).abs() < 1e-12, "{s:?}");
    assert!((s.seconds - (one.seconds / 2.0 + want + 1e-3)).abs() < 1e-9);
    // The step's end: per parameter and per tensor, on every replica.
    let tm = TimeModel {
        optimizer_s_per_param: 1e-9,
        optimizer_s_per_tensor: 1e-6,
        ..tm()
    };
    let shapes = Model::param_shapes(&GptConfig::tiny(4)).unwrap();
    let want = bytes / 4.0 * 1e-9 + shapes.len() as f64 * 1e-6;
    let s = predict_step_time(&after_backward(2, 1, 1), &tm).unwrap();
    assert!((s.optimizer_s - want).abs() < 1e-12, "{s:?} {want}");
}

#[test]
fn a_part_is_timed_on_the_measured_curves() {
    let narrow = PartCurve {
        width: 16,
        points: vec![(1e6, 2e-3), (2e6, 3e-3), (4e6, 4e-3)],
        thread_efficiency: vec![0.0, 0.5, 1.0],
        concurrent_slowdown: vec![1.0, 1.5, 2.0],
    };
    let tm = TimeModel {
        curves: vec![narrow.clone()],
        ..TimeModel::linear(1.0, 0.0)
    };
    let close = |a: f64, b: f64| (a - b).abs() < 1e-15;
    let at = |x: f64, t: usize| tm.part_seconds(Some(16), x, t, false);
    // At and between the points; below the first along the first two's line (from
    // o = 1 ms), above the last in proportion.
    assert!(close(narrow.overhead(), 1e-3) && close(narrow.rate(), 1e9));
    assert!(close(at(2e6, 1), 3e-3));
    assert!(close(at(3e6, 1), 3.5e-3));
    assert!(close(at(0.0, 1), 1e-3));
    assert!(close(at(5e5, 1), 1.5e-3));
    assert!(close(at(8e6, 1), 8e-3));
    // A second thread: nothing on the smallest, half of its time on the largest,
    // interpolated between, the largest's beyond.
    assert!(close(at(1e6, 2), 2e-3));
    assert!(close(at(3e6, 2), 3.5e-3 / 1.75));
    assert!(close(at(8e6, 3), 8e-3 / 3.0));
    // Sharing the machine with other workers: slower by c, interpolated the same way.
    assert!(close(
        tm.part_seconds(Some(16), 3e6, 1, true),
        3.5e-3 * 1.75
    ));
    assert!(close(tm.part_seconds(Some(16), 8e6, 1, true), 8e-3 * 2.0));
    // Two widths: geometric interpolation between them, the nearest outside.
    let wide = PartCurve {
        width: 64,
        points: vec![(1e6, 1e-3), (4e6, 2e-3)],
        thread_efficiency: vec![0.0, 0.0],
        concurrent_slowdown: Vec::new(),
    };
    let tm = TimeModel {
        curves: vec![narrow, wide],
        ..tm
    };
    let x = 4e6;
    assert!(close(tm.part_seconds(Some(32), x, 1, false), 3e-3));
    assert!(close(tm.part_seconds(Some(8), x, 1, false), 4e-3));
    assert!(close(tm.part_seconds(Some(128), x, 1, false), 2e-3));
    assert!(close(tm.part_seconds(None, x, 1, false), 2e-3));
}

#[test]
fn a_line_and_an_alpha_beta_fit_exact_points() {
    let ab = AlphaBeta::fit(&[(0.0, 1e-6), (1e6, 1e-6 + 1e-3), (2e6, 1e-6 + 2e-3)]);
    assert!((ab.alpha_s - 1e-6).abs() < 1e-15 && (ab.bytes_per_s - 1e9).abs() < 1.0);
    assert_eq!(ab.all_reduce(1e6, 1), 0.0);
    assert!((ab.all_reduce(1e6, 4) - (3e-6 + 1.5e-3)).abs() < 1e-12);
    let json = serde_json::to_string(&tm()).unwrap();
    assert_eq!(serde_json::from_str::<TimeModel>(&json).unwrap(), tm());
}

#[test]
fn a_layout_that_cannot_run_is_refused() {
    let e = predict_step_time(&cfg(1, 1, 3), &tm())
        .unwrap_err()
        .to_string();
    assert!(e.contains("--tp 3"), "{e}");
    let e = predict_step_time(
        &TrainConfig {
            batch: 6,
            ..cfg(1, 1, 1)
        },
        &tm(),
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("does not split"), "{e}");
}

#[test]
fn zero_three_prefetching_hides_the_gathers_behind_the_compute() {
    let at = |tm: &TimeModel, zero: u8, prefetch: bool| {
        let mut c = cfg(2, 1, 1);
        c.zero = zero;
        c.zero_prefetch = prefetch;
        // The reduce-scatters on the rank's thread: only the gathers hide.
        c.overlap_grad_reduce = false;
        predict_step_time(&c, tm).unwrap().seconds
    };
    let m = cfg(2, 1, 1).microbatches as f64;
    // A replica's compute of one microbatch: half the batch's, over m.
    let compute = predict_step_time(&cfg(1, 1, 1), &tm()).unwrap().seconds / (2.0 * m);
    // A slow link (1 s a collective): the whole compute hides that much gathering.
    let slow = TimeModel {
        dp_collective: Some(AlphaBeta {
            alpha_s: 1.0,
            bytes_per_s: 1e9,
        }),
        ..tm()
    };
    let hidden = at(&slow, 3, false) - at(&slow, 3, true);
    assert!(
        (hidden - m * compute).abs() < 1e-9 * hidden,
        "{hidden} {compute}"
    );
    // A fast one: every gather hides. Each is half an all-reduce of the parameters'
    // 4 bytes, one piece a segment, before every forward and backward.
    let fast = TimeModel {
        dp_collective: Some(AlphaBeta {
            alpha_s: 0.0,
            bytes_per_s: 1e13,
        }),
        ..tm()
    };
    let bytes = 4.0 * GptConfig::tiny(4).param_count() as f64;
    let gather = bytes / 1e13 / 2.0;
    assert!(gather < compute / 10.0);
    let hidden = at(&fast, 3, false) - at(&fast, 3, true);
    assert!(
        (hidden - 2.0 * m * gather).abs() < 1e-6 * hidden,
        "{hidden} {gather}"
    );
}

/// ZeRO 2's reduce-scatters on their thread hide behind the backward, but for the last
/// segment's; a split backward (ZB-H1) hands them over at `W`, back to back, and hides
/// nothing.
#[test]
fn zero_two_reduce_scatters_on_their_thread_hide_but_not_under_a_split_backward() {
    let slow = TimeModel {
        dp_collective: Some(AlphaBeta {
            alpha_s: 1.0,
            bytes_per_s: 1e9,
        }),
        ..tm()
    };
    let at = |overlap: bool, schedule: &str| {
        let mut c = cfg(2, 2, 1);
        c.schedule = schedule.parse().unwrap();
        c.zero = 2;
        c.overlap_grad_reduce = overlap;
        predict_step_time(&c, &slow).unwrap().seconds
    };
    assert!(at(true, "1f1b") < at(false, "1f1b"));
    assert_eq!(at(true, "zb-h1"), at(false, "zb-h1"));
}

#[test]
fn expert_parallelism_adds_its_all_to_alls() {
    // 4 blocks, a mixture in blocks 1 and 3 (8 experts, top 2), on dp 2 without a
    // pipeline: the step is microbatch after microbatch, so ep 2 adds exactly each
    // microbatch's all-to-alls: per mixture 5 latencies and twice the bytes each way.
    let mut c = cfg(2, 1, 1);
    c.model.moe = switchyard_models::MoeConfig {
        experts: 8,
        every: 2,
        ..Default::default()
    };
    let one = predict_step_time(&c, &tm()).unwrap();
    c.ep = 2;
    let two = predict_step_time(&c, &tm()).unwrap();
    let tokens = (c.microbatch_size() * c.seq_len) as f64;
    let bytes = tokens * 4.0 * (2 * c.model.d_model) as f64;
    let per_microbatch = 2.0 * (5.0 * 1e-3 + 2.0 * 2.0 * 0.5 * bytes / 1e9);
    let want = c.microbatches as f64 * per_microbatch;
    assert!(
        (two.ep_comm_s - want).abs() < 1e-12,
        "{} vs {want}",
        two.ep_comm_s
    );
    assert_eq!(one.ep_comm_s, 0.0);
    let added = two.pipeline_s - one.pipeline_s;
    assert!((added - want).abs() < 1e-9, "{added} vs {want}");
    assert!((two.tp_comm_s - one.tp_comm_s).abs() < 1e-12);
    // Each replica holds half the experts: the all-reduce over the replicas carries the
    // rest (dp 2 = ep 2: no other replica holds the same experts).
    let shapes = c.model.param_shapes();
    let elems = |f: &dyn Fn(&str) -> bool| -> f64 {
        shapes
            .iter()
            .filter(|(n, _)| f(n))
            .map(|(_, s)| s.iter().product::<usize>() as f64)
            .sum()
    };
    let experts = elems(&|n| n.contains(".mlp.experts."));
    assert_eq!(c.model.expert_params() as f64, experts);
    assert!(
        two.dp_allreduce_s < one.dp_allreduce_s,
        "{two:?} vs {one:?}"
    );
}
