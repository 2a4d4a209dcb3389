//! Every generated schedule, run by the real executor over the real (threads)
//! communicator with [`SyntheticStage`]s on a virtual clock, at p = 4 to 32 ranks: the
//! measured timeline equals the simulator's, action by action (issue 17 §2). The virtual
//! clock makes this exact and independent of the machine's load: no wall-clock timing is
//! asserted here. A tampered program shows that the check can fail.

use switchyard_pipeline::{run_synthetic, timeline_difference, SyntheticMode, SyntheticRun};
use switchyard_schedule::{generate, Action, Costs, Op, Program, ScheduleKind};

/// Within rounding: the two timelines are computed with the same additions in the same
/// order, so in practice they are bit-identical.
const TOLERANCE: f64 = 1e-9;

fn costs(text: &str) -> Costs {
    text.parse().unwrap()
}

/// Costs with a message latency and an uneven split backward (binary fractions, so that
/// sums are exact).
fn cost_settings() -> [Costs; 2] {
    [
        costs("F=1,B=2,I=1,W=1,comm=0"),
        costs("F=1,B=2.5,I=1.25,W=0.75,comm=0.125"),
    ]
}

fn kinds() -> Vec<ScheduleKind> {
    vec![
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::Interleaved { virtual_stages: 2 },
        ScheduleKind::Interleaved { virtual_stages: 4 },
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
    ]
}

/// `m = p`, `2p` and, where the schedule allows it, one that is not a multiple of `p`.
fn microbatches(kind: ScheduleKind, p: usize) -> Vec<usize> {
    match kind {
        ScheduleKind::Interleaved { .. } => vec![p, 2 * p],
        _ => vec![p, 2 * p, p + p / 2 + 1],
    }
}

fn run_virtual(program: &Program, c: Costs) -> SyntheticRun {
    run_synthetic(program, &[c], SyntheticMode::Virtual).unwrap()
}

fn check(kind: ScheduleKind, p: usize) {
    for m in microbatches(kind, p) {
        let program = generate(kind, p, m).unwrap();
        for c in cost_settings() {
            let run = run_virtual(&program, c);
            let d = timeline_difference(&run.simulated, &run.measured).unwrap();
            let what = format!("{kind} p={p} m={m} costs {c}");
            assert!(d <= TOLERANCE, "{what}: timelines differ by {d}");
            let (s, x) = (&run.simulated, &run.measured);
            assert!(
                (s.bubble_fraction - x.bubble_fraction).abs() <= TOLERANCE,
                "{what}: bubble {} simulated, {} measured",
                s.bubble_fraction,
                x.bubble_fraction
            );
            assert_eq!(s.peak_activations(), x.peak_activations(), "{what}");
        }
    }
}

#[test]
fn synthetic_p4_matches_the_simulator() {
    kinds().into_iter().for_each(|k| check(k, 4));
}

#[test]
fn synthetic_p8_matches_the_simulator() {
    kinds().into_iter().for_each(|k| check(k, 8));
}

#[test]
fn synthetic_p16_matches_the_simulator() {
    kinds().into_iter().for_each(|k| check(k, 16));
}

#[test]
fn synthetic_p32_matches_the_simulator() {
    kinds().into_iter().for_each(|k| check(k, 32));
}

/// Different costs per stage (a slower last stage, as with a language model's head), and
/// a program that splits the backward of only some microbatches, as a CSV schedule may.
#[test]
fn per_stage_costs_and_a_partly_split_backward_match() {
    let p = 8;
    let mut program = generate(ScheduleKind::OneFOneB, p, 12).unwrap();
    let last = (p - 1) as u32;
    let list = &mut program.ranks[p - 1];
    for mb in [0, 5] {
        let at = list
            .iter()
            .position(|a| *a == Action::new(last, Op::B, mb))
            .unwrap();
        list[at] = Action::new(last, Op::I, mb);
        list.insert(at + 1, Action::new(last, Op::W, mb));
    }
    let mut per_stage = vec![costs("F=1,B=2,I=1.5,W=0.5,comm=0.25"); p];
    per_stage[p - 1] = costs("F=2,B=4,I=3,W=1,comm=0.5");
    let run = run_synthetic(&program, &per_stage, SyntheticMode::Virtual).unwrap();
    let d = timeline_difference(&run.simulated, &run.measured).unwrap();
    assert!(d <= TOLERANCE, "timelines differ by {d}");
}

/// The check can fail: on the last rank of 1F1B, a forward moved before the backward it
/// should follow (`F0 F1 B0 B1` instead of `F0 B0 F1 B1`) still validates and runs, but
/// delays every backward after it. The executor runs what it is given, so its timeline
/// is the tampered program's, and differs from the original's.
#[test]
fn a_tampered_order_changes_the_measured_timeline() {
    let (p, m) = (4, 8);
    let c = costs("F=1,B=2,comm=0.125");
    let original = generate(ScheduleKind::OneFOneB, p, m).unwrap();
    let mut tampered = original.clone();
    let last = (p - 1) as u32;
    let list = &mut tampered.ranks[p - 1];
    assert_eq!(list[1], Action::new(last, Op::B, 0));
    assert_eq!(list[2], Action::new(last, Op::F, 1));
    list.swap(1, 2);

    let honest = run_virtual(&original, c);
    let run = run_virtual(&tampered, c);
    // Faithful to the tampered program...
    let d = timeline_difference(&run.simulated, &run.measured).unwrap();
    assert!(d <= TOLERANCE, "tampered program: timelines differ by {d}");
    // ...so not to the original one: later, and its actions elsewhere.
    assert!(
        run.measured.makespan > honest.simulated.makespan + 0.5,
        "tampered makespan {} vs original {}",
        run.measured.makespan,
        honest.simulated.makespan
    );
    let err = timeline_difference(&honest.simulated, &run.measured).unwrap_err();
    assert!(err.to_string().contains("was measured"), "{err}");
}

/// Program errors surface before any thread starts.
#[test]
fn an_invalid_program_is_refused() {
    let mut program = generate(ScheduleKind::GPipe, 4, 4).unwrap();
    program.ranks[2].pop();
    let err = run_synthetic(&program, &[Costs::default()], SyntheticMode::Virtual).unwrap_err();
    assert!(
        err.to_string().contains("invalid pipeline program"),
        "{err}"
    );
    let program = generate(ScheduleKind::GPipe, 4, 4).unwrap();
    let err = run_synthetic(&program, &[Costs::default(); 3], SyntheticMode::Virtual).unwrap_err();
    assert!(err.to_string().contains("3 stage costs"), "{err}");
}

/// Sleep mode runs the same program with real sleeps, timed by the executor's trace.
/// Nothing about its timing is asserted (the machine may be loaded): only that every
/// action was timed, in order, and the quantities are consistent.
#[test]
fn sleep_mode_times_every_action_from_the_trace() {
    let program = generate(ScheduleKind::ZbH1, 4, 4).unwrap();
    let unit = std::time::Duration::from_micros(100);
    let c = costs("F=1,I=1,W=1,comm=0.5");
    let run = run_synthetic(&program, &[c], SyntheticMode::Sleep { unit }).unwrap();
    let x = &run.measured;
    assert_eq!(x.ranks.len(), 4);
    for (s, m) in run.simulated.ranks.iter().zip(&x.ranks) {
        let got: Vec<Action> = m.actions.iter().map(|a| a.action).collect();
        let want: Vec<Action> = s.actions.iter().map(|a| a.action).collect();
        assert_eq!(got, want);
        assert!(m.actions.iter().all(|a| a.start >= 0.0 && a.end >= a.start));
        assert!(m.busy > 0.0 && m.comm > 0.0 && m.idle >= 0.0);
        assert!((0.0..1.0).contains(&m.bubble_fraction));
    }
    assert!(x.makespan > 0.0);
    assert_eq!(run.simulated.peak_activations(), x.peak_activations());
}
