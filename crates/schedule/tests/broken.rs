//! Broken programs must fail validation with messages that name the actions.

use switchyard_schedule::{
    generate, gpipe, interleaved, lower, one_f_one_b, simulate, validate, Action, Costs, Op,
    Program, ScheduleError, ScheduleKind,
};

fn prog(text: &str) -> Program {
    text.parse().unwrap()
}

fn err(p: &Program) -> String {
    validate(p)
        .expect_err("the program should be invalid")
        .to_string()
}

fn a(s: &str) -> Action {
    s.parse().unwrap()
}

#[test]
fn missing_receive_names_the_send_and_the_receive() {
    let mut p = lower(&one_f_one_b(2, 2).unwrap()).unwrap();
    p.ranks[1].retain(|x| *x != a("1RF1"));
    let msg = err(&p);
    assert!(
        msg.contains("0SF1 on rank 0 has no matching receive 1RF1 on rank 1"),
        "{msg}"
    );

    let mut p = lower(&one_f_one_b(2, 2).unwrap()).unwrap();
    p.ranks[0].retain(|x| *x != a("0SF0"));
    let msg = err(&p);
    assert!(
        msg.contains("1RF0 on rank 1 has no matching send 0SF0 on rank 0"),
        "{msg}"
    );

    // Lowered, but one message dropped entirely.
    let mut p = lower(&gpipe(3, 2).unwrap()).unwrap();
    p.ranks[2].retain(|x| *x != a("2SB1"));
    p.ranks[1].retain(|x| *x != a("1RB1"));
    let msg = err(&p);
    assert!(msg.contains("no message for 2B1 -> 1B1"), "{msg}");
    assert!(
        msg.contains("2SB1 on rank 2") && msg.contains("1RB1 on rank 1"),
        "{msg}"
    );
}

#[test]
fn backward_before_its_forward_is_named() {
    let p = prog("rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1B0 1F0 1F1 1B1\n");
    assert_eq!(
        err(&p),
        "invalid schedule: 1B0 on rank 1 comes before its forward 1F0"
    );
    let p = prog("rank 0: 0F0 0W0 0I0\n");
    assert_eq!(err(&p), "invalid schedule: 0W0 on rank 0 comes before 0I0");
}

#[test]
fn cyclic_wait_in_a_lowered_program_names_every_stuck_rank() {
    let p = prog(
        "rank 0: 0F0 0RB0 0SF0 0B0\n\
         rank 1: 1RF0 1F0 1B0 1SB0\n",
    );
    assert_eq!(
        err(&p),
        "deadlock: rank 0 stuck at 0RB0 (waiting for 1SB0 on rank 1), \
         rank 1 stuck at 1RF0 (waiting for 0SF0 on rank 0)"
    );
    match validate(&p) {
        Err(ScheduleError::Deadlock(stuck)) => {
            assert_eq!(stuck.len(), 2);
            assert_eq!(stuck[0].rank, 0);
            assert_eq!(stuck[0].action, a("0RB0"));
            assert_eq!(stuck[0].waiting_for, Some((a("1SB0"), 1)));
        }
        other => panic!("expected a deadlock, got {other:?}"),
    }
    // simulate refuses it with the same error.
    let e = simulate(&p, &Costs::default()).unwrap_err().to_string();
    assert!(e.starts_with("deadlock: rank 0 stuck at 0RB0"), "{e}");
}

#[test]
fn cyclic_wait_in_an_unlowered_program_names_the_missing_inputs() {
    // 0B0 needs 1B0, which comes after 1F1, which needs 0F1, which comes
    // after 0B0.
    let p = prog("rank 0: 0F0 0B0 0F1 0B1\nrank 1: 1F1 1F0 1B0 1B1\n");
    assert_eq!(
        err(&p),
        "deadlock: rank 0 stuck at 0B0 (waiting for 1B0 on rank 1), \
         rank 1 stuck at 1F1 (waiting for 0F1 on rank 0)"
    );
}

/// Sends right after their producer and receives right before their
/// consumer: fine with eager sends, a deadlock with rendezvous sends. This
/// is the classic 1F1B hang, and the reason `lower` orders messages.
#[test]
fn naive_1f1b_lowering_deadlocks_with_rendezvous_sends() {
    let p = prog(
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\n\
         rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1\n",
    );
    assert_eq!(
        err(&p),
        "deadlock: rank 0 stuck at 0SF1 (waiting for 1RF1 on rank 1), \
         rank 1 stuck at 1SB0 (waiting for 0RB0 on rank 0)"
    );
    // The same compute order lowered by `lower` is fine.
    validate(&lower(&p.without_comm()).unwrap()).unwrap();
}

#[test]
fn naive_lowering_of_every_schedule_is_caught_or_safe() {
    // Build the naive lowering for many schedules; whenever the validator
    // accepts it, it must really run under rendezvous semantics — and at
    // least one of them (1F1B) must be refused, so the check is not vacuous.
    let mut refused = 0;
    let p = naive_lower(&one_f_one_b(2, 2).unwrap());
    assert_eq!(
        p.to_string(),
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\nrank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1\n"
    );
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
    ] {
        let raw = generate(kind, 4, 8).unwrap();
        let naive = naive_lower(&raw);
        if validate(&naive).is_err() {
            refused += 1;
        }
    }
    let naive = naive_lower(&interleaved(4, 2, 8).unwrap());
    if validate(&naive).is_err() {
        refused += 1;
    }
    assert!(refused >= 2, "refused {refused}");
    // Whatever the validator accepts really completes, even with costs.
    for kind in [ScheduleKind::GPipe, ScheduleKind::ZbH1] {
        let naive = naive_lower(&generate(kind, 3, 5).unwrap());
        if validate(&naive).is_ok() {
            simulate(&naive, &Costs::default()).unwrap();
        }
    }
}

fn naive_lower(p: &Program) -> Program {
    let lowered = lower(p).unwrap();
    let mut out = p.clone();
    for (r, list) in p.ranks.iter().enumerate() {
        let has = |c: Action| lowered.ranks[r].contains(&c);
        let mut new = Vec::new();
        for &x in list {
            let (s, mb) = (x.stage, x.microbatch);
            let (recv, send) = match x.op {
                Op::F => (Action::new(s, Op::RecvF, mb), Action::new(s, Op::SendF, mb)),
                Op::B | Op::I => (Action::new(s, Op::RecvB, mb), Action::new(s, Op::SendB, mb)),
                _ => {
                    new.push(x);
                    continue;
                }
            };
            new.extend(Some(recv).filter(|&c| has(c)));
            new.push(x);
            new.extend(Some(send).filter(|&c| has(c)));
        }
        out.ranks[r] = new;
    }
    out
}

#[test]
fn structural_errors_name_the_actions() {
    let cases: &[(&str, &str)] = &[
        (
            "rank 0: 0F0 0F0 0B0\n",
            "invalid schedule: 0F0 appears twice (rank 0 position 0 and rank 0 position 1)",
        ),
        (
            "rank 0: 0F0 0B0 0F1\n",
            "invalid schedule: 0B1 is missing (or the split pair 0I1 and 0W1)",
        ),
        ("rank 0: 0F0 0B0 0B1\n", "invalid schedule: 0F1 is missing: every stage runs every microbatch forward once"),
        (
            "rank 0: 0F0 0B0 0I0 0W0\n",
            "invalid schedule: 0B0 and a split backward (0I0/0W0) are both present; use one form",
        ),
        ("rank 0: 0F0 0I0\n", "invalid schedule: 0W0 is missing (0I0 is present)"),
        (
            "rank 0: 1F0 0F0 0B0 1B0\n",
            "invalid schedule: 1F0 on rank 0 comes before 0F0, which produces its input on the same rank",
        ),
        (
            "rank 0: 0F0 0SF0 0B0\nrank 1: 1RF0 1F0 1B0\n",
            "invalid schedule: the lowered program has no message for 1B0 -> 0B0: expected 1SB0 on rank 1 and 0RB0 on rank 0",
        ),
        (
            "rank 0: 0SF0 0F0 0RB0 0B0\nrank 1: 1RF0 1F0 1B0 1SB0\n",
            "invalid schedule: 0SF0 on rank 0 comes before 0F0, which produces the data it sends",
        ),
        (
            "rank 0: 0F0 0SF0 0RB0 0B0\nrank 1: 1F0 1RF0 1B0 1SB0\n",
            "invalid schedule: 1F0 on rank 1 comes before 1RF0, which receives its input",
        ),
        (
            "rank 0: 0F0 0SF0 0RB0 0B0 0RF0\nrank 1: 1RF0 1F0 1B0 1SB0\n",
            "invalid schedule: 0RF0 leaves the pipeline: stage 0 has no previous stage",
        ),
        (
            "rank 0: 0F0 0RB0 0B0\nrank 1: 1F0 1SF0 1B0 1SB0\n",
            "invalid schedule: 1SF0 leaves the pipeline: the last stage has no next stage",
        ),
    ];
    for (text, expected) in cases {
        assert_eq!(err(&prog(text)), *expected, "for {text:?}");
    }
    // A message between two stages of the same rank.
    let mut p = interleaved(1, 2, 1).unwrap();
    p.ranks[0].insert(1, a("0SF0"));
    assert_eq!(
        err(&p),
        "invalid schedule: 0SF0 is a message between stages 0 and 1 on the same rank 0; \
         a local handoff needs no send or receive"
    );
    // An action on the wrong rank, an out-of-range action.
    let mut p = gpipe(2, 1).unwrap();
    p.ranks[0].push(a("1F0"));
    p.ranks[1].retain(|x| *x != a("1F0"));
    assert_eq!(
        err(&p),
        "invalid schedule: 1F0 is on rank 0, but stage 1 runs on rank 1"
    );
    let mut p = gpipe(2, 1).unwrap();
    p.ranks[0].push(a("0F5"));
    assert_eq!(
        err(&p),
        "invalid schedule: 0F5 on rank 0 is out of range: the program has 2 stages and 1 microbatches"
    );
    let mut p = gpipe(2, 1).unwrap();
    p.stage_to_rank = vec![0, 2];
    assert_eq!(
        err(&p),
        "invalid schedule: stage 1 is mapped to rank 2, but the program has 2 ranks"
    );
}

#[test]
fn generator_errors_say_what_to_change() {
    let e = |r: switchyard_schedule::Result<Program>| r.unwrap_err().to_string();
    assert_eq!(
        e(interleaved(4, 2, 6)),
        "interleaved 1F1B with 4 ranks needs the number of microbatches to be a multiple of 4, \
         got 6; use 4 or 8 (or use --virtual-stages 1, which is plain 1F1B)"
    );
    assert!(e(interleaved(4, 2, 3)).contains("got 3; use 4 ("));
    assert_eq!(
        e(gpipe(0, 4)),
        "a pipeline needs at least 1 rank (stage), got 0"
    );
    assert_eq!(
        e(one_f_one_b(4, 0)),
        "a schedule needs at least 1 microbatch, got 0"
    );
    assert_eq!(
        e(interleaved(4, 0, 4)),
        "interleaved 1F1B needs at least 1 virtual stage per rank, got 0"
    );
    for kind in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
    ] {
        assert!(generate(kind, 0, 1).is_err());
        assert!(generate(kind, 1, 0).is_err());
    }
    // v = 1 accepts any m and equals 1F1B.
    assert_eq!(interleaved(4, 1, 6).unwrap(), one_f_one_b(4, 6).unwrap());
    assert!(lower(&lower(&gpipe(2, 2).unwrap()).unwrap())
        .unwrap_err()
        .to_string()
        .contains("already lowered"));
}

/// Huge rank, stage or microbatch indices in a hand-written schedule are errors, not an
/// overflow or an allocation the size of the index.
#[test]
fn huge_indices_in_a_csv_are_errors() {
    let e = |t: &str| Program::from_csv(t).unwrap_err().to_string();
    assert_eq!(
        e("0,0F0,0B0\n18446744073709551615,0F1\n"),
        "rank 1 is missing"
    );
    assert_eq!(e("0,0F0,0B0\n1000000000000,0F1\n"), "rank 1 is missing");
    assert_eq!(
        e("0,0F0,0B0,4294967295F0\n"),
        "invalid schedule: stage 1 has no compute action on any rank, so its rank is unknown"
    );
    assert_eq!(
        e("0,0F4294967295,0B4294967295\n"),
        "invalid schedule: 0F4294967295 on rank 0: microbatch 4294967295 is out of range: \
         the program has 2 compute actions, too few for 4294967296 microbatches"
    );
    assert!(e("0,0F0,0B0,0SF4294967295\n").contains("microbatch 4294967295 is out of range"));
    // The text form shares the rules.
    assert!("rank 0: 0F0 0B0\nrank 99999999999: 1F0 1B0\n"
        .parse::<Program>()
        .unwrap_err()
        .to_string()
        .contains("rank 1 is missing"));
}

/// A program built by hand with more (stage, microbatch) pairs than actions is refused
/// before any table of that size is allocated.
#[test]
fn a_program_too_sparse_for_its_sizes_is_refused() {
    let mut p = gpipe(2, 1).unwrap();
    p.num_microbatches = u32::MAX;
    assert_eq!(
        err(&p),
        "invalid schedule: 2 stages × 4294967295 microbatches need at least 8589934590 forwards, \
         but the program has only 4 compute actions"
    );
    assert!(lower(&p).is_err());
    assert!(simulate(&p, &Costs::default()).is_err());
}
