//! Property-style checks over every generator for p in 1..=8, m in 1..=32,
//! v in 1..=4 (where valid): validity, deadlock freedom, and the bubble and
//! memory formulas.

use switchyard_schedule::{
    generate, gpipe, interleaved, lower, lower_with_costs, one_f_one_b, simulate,
    simulate_by_stage, validate, zb_h1, zb_h2, Costs, Op, Program, ScheduleKind, Timeline,
};

const TOL: f64 = 1e-12;

/// Every (kind, p, m) the generators accept in the tested range.
fn all_cases() -> Vec<(ScheduleKind, usize, usize)> {
    let mut cases = Vec::new();
    for p in 1..=8 {
        for m in 1..=32 {
            for kind in [
                ScheduleKind::GPipe,
                ScheduleKind::OneFOneB,
                ScheduleKind::ZbH1,
                ScheduleKind::ZbH2,
            ] {
                cases.push((kind, p, m));
            }
            for v in 1..=4 {
                if v == 1 || m % p == 0 {
                    cases.push((ScheduleKind::Interleaved { virtual_stages: v }, p, m));
                }
            }
        }
    }
    cases
}

/// Compute actions with their times, for comparing timelines.
fn compute_times(tl: &Timeline) -> Vec<Vec<(String, f64, f64)>> {
    tl.ranks
        .iter()
        .map(|r| {
            r.actions
                .iter()
                .filter(|a| a.action.op.is_compute())
                .map(|a| (a.action.to_string(), a.start, a.end))
                .collect()
        })
        .collect()
}

/// Number of messages a program needs: two per microbatch per pair of
/// adjacent stages on different ranks.
fn expected_messages(p: &Program) -> usize {
    let cross = (0..p.num_stages.saturating_sub(1))
        .filter(|&s| p.rank_of_stage(s) != p.rank_of_stage(s + 1))
        .count();
    2 * 2 * cross * p.num_microbatches as usize
}

#[test]
fn every_generated_program_validates_raw_and_lowered() {
    let costs = Costs::default();
    for (kind, p, m) in all_cases() {
        let ctx = format!("{kind} p={p} m={m}");
        let raw = generate(kind, p, m).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert!(!raw.is_lowered(), "{ctx}");
        assert_eq!(raw.num_ranks(), p, "{ctx}");
        assert_eq!(raw.num_microbatches as usize, m, "{ctx}");
        validate(&raw).unwrap_or_else(|e| panic!("{ctx} raw: {e}"));
        let lowered = lower(&raw).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        validate(&lowered).unwrap_or_else(|e| panic!("{ctx} lowered: {e}"));
        assert_eq!(
            lowered.without_comm(),
            raw,
            "{ctx}: lowering reordered compute"
        );
        let comm_ops = lowered
            .ranks
            .iter()
            .flatten()
            .filter(|a| a.op.is_comm())
            .count();
        assert_eq!(comm_ops, expected_messages(&raw), "{ctx}");
        assert_eq!(lowered.is_lowered(), p > 1, "{ctx}");

        let t_raw = simulate(&raw, &costs).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        let t_low = simulate(&lowered, &costs).unwrap_or_else(|e| panic!("{ctx}: {e}"));
        assert_eq!(t_raw.makespan, t_low.makespan, "{ctx}");
        assert_eq!(compute_times(&t_raw), compute_times(&t_low), "{ctx}");
        assert_eq!(t_raw.peak_activations(), t_low.peak_activations(), "{ctx}");
        // Busy time: every rank does all the work of its stages.
        for r in &t_raw.ranks {
            let stages = raw.stages_of_rank(r.rank).len() as f64;
            assert_eq!(r.busy, stages * 3.0 * m as f64, "{ctx} rank {}", r.rank);
            assert!((r.busy + r.idle - t_raw.makespan).abs() < TOL, "{ctx}");
        }
    }
}

#[test]
fn lowering_keeps_timing_under_the_costs_it_was_planned_with() {
    let costs: Costs = "F=1.5,B=2.5,I=1.25,W=0.75".parse().unwrap();
    for (kind, p, m) in all_cases()
        .into_iter()
        .filter(|(_, p, m)| *p <= 5 && *m <= 12)
    {
        let raw = generate(kind, p, m).unwrap();
        let lowered = lower_with_costs(&raw, &costs).unwrap();
        validate(&lowered).unwrap();
        let a = simulate(&raw, &costs).unwrap();
        let b = simulate(&lowered, &costs).unwrap();
        assert_eq!(compute_times(&a), compute_times(&b), "{kind} p={p} m={m}");
    }
}

#[test]
fn comm_costs_are_charged_per_message() {
    let comm = 0.25;
    let costs = Costs {
        comm,
        ..Costs::default()
    };
    for (kind, p, m) in all_cases()
        .into_iter()
        .filter(|(_, p, m)| *p <= 4 && *m <= 8)
    {
        let lowered = lower(&generate(kind, p, m).unwrap()).unwrap();
        let free = simulate(&lowered, &Costs::default()).unwrap();
        let tl = simulate(&lowered, &costs).unwrap();
        assert!(tl.makespan >= free.makespan, "{kind} p={p} m={m}");
        if p > 1 {
            assert!(tl.makespan > free.makespan, "{kind} p={p} m={m}");
        }
        for (r, rt) in tl.ranks.iter().enumerate() {
            let n = lowered.ranks[r].iter().filter(|a| a.op.is_comm()).count() as f64;
            assert!(
                (rt.comm - n * comm).abs() < 1e-9,
                "{kind} p={p} m={m} rank {r}"
            );
            assert!((rt.busy + rt.comm + rt.idle - tl.makespan).abs() < 1e-9);
        }
    }
}

#[test]
fn gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1() {
    for p in 1..=8usize {
        for m in 1..=32usize {
            let expected = (p - 1) as f64 / (m + p - 1) as f64;
            for program in [gpipe(p, m).unwrap(), one_f_one_b(p, m).unwrap()] {
                let tl = simulate(&program, &Costs::default()).unwrap();
                assert_eq!(tl.makespan, 3.0 * (m + p - 1) as f64, "p={p} m={m}");
                assert!((tl.bubble_fraction - expected).abs() < TOL, "p={p} m={m}");
                for r in &tl.ranks {
                    assert!((r.bubble_fraction - expected).abs() < TOL, "p={p} m={m}");
                }
            }
        }
    }
}

/// Interleaved 1F1B, m a multiple of p, F=1 and B=2 per stage (a stage is
/// 1/v of a rank's layers): makespan = 3(mv + p − 1) exactly, so the bubble
/// is (p − 1)/(mv + p − 1) and bubble time / ideal time = (1/v)(p − 1)/m.
/// In model time (F = 1/v, B = 2/v) the makespan is 3m + 3(p − 1)/v.
#[test]
fn interleaved_makespan_is_3_times_mv_plus_p_minus_1() {
    for p in 1..=8usize {
        for m in (p..=32).step_by(p) {
            let base = simulate(&one_f_one_b(p, m).unwrap(), &Costs::default()).unwrap();
            for v in 1..=4usize {
                let program = interleaved(p, v, m).unwrap();
                assert_eq!(program.num_stages as usize, p * v);
                let tl = simulate(&program, &Costs::default()).unwrap();
                let ctx = format!("p={p} m={m} v={v}");
                assert_eq!(tl.makespan, 3.0 * (m * v + p - 1) as f64, "{ctx}");
                let expected = (p - 1) as f64 / (m * v + p - 1) as f64;
                assert!((tl.bubble_fraction - expected).abs() < TOL, "{ctx}");
                let ideal = 3.0 * (m * v) as f64;
                let ratio = (tl.makespan - ideal) / ideal;
                assert!(
                    (ratio - (p - 1) as f64 / (v * m) as f64).abs() < TOL,
                    "{ctx}"
                );
                if v >= 2 && p >= 2 {
                    assert!(tl.bubble_fraction < base.bubble_fraction, "{ctx}");
                }
                let vf = v as f64;
                let scaled = Costs {
                    f: 1.0 / vf,
                    b: 2.0 / vf,
                    ..Costs::default()
                };
                let tl = simulate(&program, &scaled).unwrap();
                let model_time = 3.0 * m as f64 + 3.0 * (p - 1) as f64 / vf;
                assert!((tl.makespan - model_time).abs() < 1e-9, "{ctx}");
            }
        }
    }
}

/// ZB-H1 with F = I = W = 1: makespan = 3m + p − 1 for m ≥ p (the bubble
/// (p − 1)(F + I − W) of the paper), 2m + 2p − 1 for m < p; so its bubble
/// (p − 1)/(3m + p − 1) is strictly below 1F1B's (p − 1)/(m + p − 1).
#[test]
fn zb_h1_beats_1f1b_with_the_same_memory() {
    for p in 1..=8usize {
        for m in 1..=32usize {
            let ctx = format!("p={p} m={m}");
            let program = zb_h1(p, m).unwrap();
            assert!(
                program.ranks.iter().flatten().all(|a| a.op != Op::B),
                "{ctx}"
            );
            let zb = simulate(&program, &Costs::default()).unwrap();
            let ob = simulate(&one_f_one_b(p, m).unwrap(), &Costs::default()).unwrap();
            let expected = 3 * m + p - 1 + p.saturating_sub(m);
            assert_eq!(zb.makespan, expected as f64, "{ctx}");
            if m >= p {
                let bubble = (p - 1) as f64 / (3 * m + p - 1) as f64;
                assert!((zb.bubble_fraction - bubble).abs() < TOL, "{ctx}");
            }
            if p >= 2 && m >= p {
                assert!(zb.bubble_fraction < ob.bubble_fraction, "{ctx}");
            }
            // Same bound as 1F1B: no rank stashes more than 1F1B's first stage.
            let bound = *ob.peak_activations().iter().max().unwrap();
            assert_eq!(bound as usize, p.min(m), "{ctx}");
            assert_eq!(zb.peak_activations(), vec![bound; p], "{ctx}");
        }
    }
}

/// ZB-H2 spends activations on the bubble: every rank holds at most `2p − 1`
/// microbatches (counted until their `W`), and with an `I` dearer than a `W` (the
/// CPU's measured ratio) it is never slower than ZB-H1, and faster once there are
/// microbatches for its extra warm-up forwards.
#[test]
fn zb_h2_trades_activations_for_the_bubble() {
    let costs = Costs {
        i: 1.2,
        w: 0.9,
        ..Costs::default()
    };
    for p in 1..=8usize {
        for m in 1..=32usize {
            let ctx = format!("p={p} m={m}");
            let program = zb_h2(p, m).unwrap();
            assert!(
                program.ranks.iter().flatten().all(|a| a.op != Op::B),
                "{ctx}"
            );
            let h2 = simulate(&program, &costs).unwrap();
            let h1 = simulate(&zb_h1(p, m).unwrap(), &costs).unwrap();
            let bound = (2 * p - 1).min(m) as u32;
            assert!(
                h2.peak_activations().iter().all(|&a| a <= bound),
                "{ctx}: {:?}",
                h2.peak_activations()
            );
            assert!(
                h2.makespan <= h1.makespan + TOL,
                "{ctx}: {} vs {}",
                h2.makespan,
                h1.makespan
            );
            if p >= 2 && m >= 2 * p {
                assert!(
                    h2.makespan < h1.makespan,
                    "{ctx}: {} vs {}",
                    h2.makespan,
                    h1.makespan
                );
            }
        }
    }
}

#[test]
fn peak_activations_match_the_formulas() {
    for p in 1..=8usize {
        for m in 1..=32usize {
            let g = simulate(&gpipe(p, m).unwrap(), &Costs::default()).unwrap();
            assert_eq!(g.peak_activations(), vec![m as u32; p], "gpipe p={p} m={m}");
            let o = simulate(&one_f_one_b(p, m).unwrap(), &Costs::default()).unwrap();
            let expected: Vec<u32> = (0..p).map(|r| (p - r).min(m) as u32).collect();
            assert_eq!(o.peak_activations(), expected, "1f1b p={p} m={m}");
            // Interleaved, counted in stage-sized activations over a rank's
            // chunks: the warm-up forwards plus the first steady one.
            for v in 2..=4usize {
                if m % p != 0 {
                    continue;
                }
                let tl = simulate(&interleaved(p, v, m).unwrap(), &Costs::default()).unwrap();
                let expected: Vec<u32> = (0..p)
                    .map(|r| (2 * (p - r - 1) + (v - 1) * p + 1).min(m * v) as u32)
                    .collect();
                assert_eq!(
                    tl.peak_activations(),
                    expected,
                    "interleaved p={p} m={m} v={v}"
                );
            }
        }
    }
}

#[test]
fn interleaved_places_stages_round_robin_and_loops_around() {
    let program = interleaved(4, 2, 8).unwrap();
    assert_eq!(program.stage_to_rank, vec![0, 1, 2, 3, 0, 1, 2, 3]);
    assert_eq!(program.stages_of_rank(0), vec![0, 4]);
    assert_eq!(program.rank_of_stage(7), 3);
    let lowered = lower(&program).unwrap();
    // The activation of stage 3 goes from rank 3 back to rank 0 (stage 4).
    assert!(lowered.ranks[3].contains(&"3SF0".parse().unwrap()));
    assert!(lowered.ranks[0].contains(&"4RF0".parse().unwrap()));
    assert!(lowered.ranks[0].contains(&"4SB0".parse().unwrap()));
    assert!(lowered.ranks[3].contains(&"3RB0".parse().unwrap()));
    // No messages at the ends of the pipeline.
    assert!(!lowered
        .ranks
        .iter()
        .flatten()
        .any(|a| a.to_string().starts_with("0RF")));
    assert!(!lowered
        .ranks
        .iter()
        .flatten()
        .any(|a| a.to_string().starts_with("7SF")));
    assert!(!lowered
        .ranks
        .iter()
        .flatten()
        .any(|a| a.to_string().starts_with("7RB")));
    // One rank with several chunks hands data over locally: no messages.
    let single = lower(&interleaved(1, 3, 4).unwrap()).unwrap();
    assert!(!single.is_lowered());
    validate(&single).unwrap();
}

#[test]
fn megatron_ordering_for_a_small_case() {
    // p=2, v=2, m=2: rank 0 warms up with 2(p-1) + (v-1)p = 4 forwards.
    let program = interleaved(2, 2, 2).unwrap();
    assert_eq!(
        program.to_string(),
        "rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1\n\
         rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1\n"
    );
}

#[test]
fn zb_h1_small_case_defers_weight_gradients_on_later_ranks() {
    let program = zb_h1(2, 3).unwrap();
    assert_eq!(
        program.to_string(),
        "rank 0: 0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2\n\
         rank 1: 1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2\n"
    );
}

/// Per-stage costs: equal ones time a program as `simulate` does; a slower stage sets
/// the pace of a long pipeline (1F1B's steady state runs at the slowest stage).
#[test]
fn per_stage_costs_agree_with_uniform_ones_and_the_slowest_stage_paces_the_pipeline() {
    for (kind, p, m) in all_cases().into_iter().filter(|c| c.1 <= 4 && c.2 <= 8) {
        let prog = lower(&generate(kind, p, m).unwrap()).unwrap();
        let c = Costs::default();
        let uniform = simulate(&prog, &c).unwrap();
        let staged = simulate_by_stage(&prog, &vec![c; prog.num_stages as usize]).unwrap();
        assert_eq!(uniform, staged, "{kind} p {p} m {m}");
    }
    // 1F1B on 2 stages, 4 microbatches, the last stage twice as slow (F=2, B=4): the
    // first F, then 4 (F + B) on the last stage, then the first stage's last B.
    let prog = lower(&one_f_one_b(2, 4).unwrap()).unwrap();
    let slow = Costs {
        f: 2.0,
        b: 4.0,
        ..Costs::default()
    };
    let t = simulate_by_stage(&prog, &[Costs::default(), slow]).unwrap();
    assert!(
        (t.makespan - (1.0 + 4.0 * 6.0 + 2.0)).abs() < TOL,
        "{}",
        t.makespan
    );
    assert_eq!(t.costs.f, 2.0);
    let e = simulate_by_stage(&prog, &[Costs::default()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 stage costs for a program of 2 stages"), "{e}");
}
