//! Text, CSV and JSON forms round-trip; parse errors are clear; tags match.

use std::collections::HashSet;

use switchyard_schedule::{
    generate, interleaved, lower, simulate, tag, Action, Costs, Format, Op, Program, ScheduleKind,
    Timeline,
};

fn samples() -> Vec<Program> {
    let mut out = Vec::new();
    for p in 1..=4 {
        for m in [1, 3, 4, 8] {
            for kind in [
                ScheduleKind::GPipe,
                ScheduleKind::OneFOneB,
                ScheduleKind::ZbH1,
                ScheduleKind::ZbH2,
            ] {
                out.push(generate(kind, p, m).unwrap());
            }
            if m % p == 0 {
                out.push(interleaved(p, 3, m).unwrap());
            }
        }
    }
    let lowered: Vec<Program> = out.iter().map(|p| lower(p).unwrap()).collect();
    out.extend(lowered);
    out
}

#[test]
fn actions_round_trip_through_text() {
    for op in Op::ALL {
        for (s, mb) in [(0, 0), (1, 3), (12, 345), (u32::MAX, u32::MAX)] {
            let a = Action::new(s, op, mb);
            let text = a.to_string();
            assert_eq!(text.parse::<Action>().unwrap(), a, "{text}");
        }
    }
    assert_eq!("1F3".parse::<Action>().unwrap(), Action::new(1, Op::F, 3));
    assert_eq!(
        "2RB0".parse::<Action>().unwrap(),
        Action::new(2, Op::RecvB, 0)
    );
    assert_eq!(
        " 2sf7 ".parse::<Action>().unwrap(),
        Action::new(2, Op::SendF, 7)
    );
    assert_eq!(Action::new(1, Op::SendB, 3).to_string(), "1SB3");
}

#[test]
fn action_parse_errors_name_the_text() {
    for bad in ["x1F", "F3", "1F", "1X3", "1F3x", "", "1F99999999999"] {
        let e = bad.parse::<Action>().unwrap_err().to_string();
        assert!(e.contains(&format!("{bad:?}")), "{e}");
        assert!(e.contains("expected <stage><op><microbatch>"), "{e}");
    }
    let e = "1X3".parse::<Action>().unwrap_err().to_string();
    assert!(e.contains("unknown op \"X\""), "{e}");
}

#[test]
fn programs_round_trip_through_text_csv_and_json() {
    for p in samples() {
        let text = p.to_string();
        assert_eq!(text.parse::<Program>().unwrap(), p, "{text}");
        let csv = p.to_csv();
        assert_eq!(Program::from_csv(&csv).unwrap(), p, "{csv}");
        let json = serde_json::to_string(&p).unwrap();
        assert_eq!(serde_json::from_str::<Program>(&json).unwrap(), p, "{json}");
    }
}

#[test]
fn text_and_csv_forms_look_as_documented() {
    let p = generate(ScheduleKind::GPipe, 2, 2).unwrap();
    assert_eq!(
        p.to_string(),
        "rank 0: 0F0 0F1 0B0 0B1\nrank 1: 1F0 1F1 1B0 1B1\n"
    );
    assert_eq!(
        p.to_csv(),
        "# switchyard schedule: 2 stages, 2 microbatches, 2 ranks\n0,0F0,0F1,0B0,0B1\n1,1F0,1F1,1B0,1B1\n"
    );
    let json = serde_json::to_value(&p).unwrap();
    assert_eq!(json["stage_to_rank"], serde_json::json!([0, 1]));
    assert_eq!(json["ranks"][1][2], "1B0");
}

#[test]
fn csv_accepts_comments_spaces_and_any_row_order() {
    let csv = "# custom schedule\n\n1, 1F0 ,1B0,\n# rank 0 below\n0,0F0,0B0\n";
    let p = Program::from_csv(csv).unwrap();
    assert_eq!(p.num_stages, 2);
    assert_eq!(p.num_microbatches, 1);
    assert_eq!(p.stage_to_rank, vec![0, 1]);
    assert_eq!(p.to_string(), "rank 0: 0F0 0B0\nrank 1: 1F0 1B0\n");
    // Interleaved placement is inferred from who runs what.
    let p = Program::from_csv(&interleaved(2, 2, 2).unwrap().to_csv()).unwrap();
    assert_eq!(p.stage_to_rank, vec![0, 1, 0, 1]);
    assert_eq!(p.stages_of_rank(1), vec![1, 3]);
}

#[test]
fn csv_errors_are_clear() {
    let e = |t: &str| Program::from_csv(t).unwrap_err().to_string();
    assert_eq!(
        e("0,0F0,1F0\n1,1B0,0B0\n"),
        "invalid schedule: stage 1 has compute actions on two ranks: rank 0 and rank 1 (1B0)"
    );
    assert_eq!(e("0,0F0\n2,2F0\n"), "rank 1 is missing");
    assert_eq!(e("0,0F0\n0,0B0\n"), "rank 0 is listed twice");
    assert!(e("a,0F0\n").contains("the first column must be the rank index, got \"a\""));
    assert!(e("0,0F0,0Q0\n").starts_with("CSV line 1: invalid action \"0Q0\""));
    assert_eq!(e("# nothing\n"), "CSV has no rank rows");
    assert_eq!(
        e("0,0F0,2F0\n"),
        "invalid schedule: stage 1 has no compute action on any rank, so its rank is unknown"
    );
}

#[test]
fn csv_files_save_and_load() {
    let dir = std::env::temp_dir().join(format!("switchyard-schedule-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("zb.csv");
    let p = lower(&generate(ScheduleKind::ZbH1, 3, 4).unwrap()).unwrap();
    p.save_csv(&path).unwrap();
    assert_eq!(Program::load_csv(&path).unwrap(), p);
    std::fs::write(&path, "0,0F0,bad\n").unwrap();
    let e = Program::load_csv(&path).unwrap_err().to_string();
    assert!(
        e.starts_with(&path.display().to_string()) && e.contains("\"bad\""),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
    let e = Program::load_csv(dir.join("missing.csv"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("missing.csv"), "{e}");
}

#[test]
fn timelines_round_trip_through_json() {
    let costs: Costs = "F=1,B=2,comm=0.5".parse().unwrap();
    for p in samples().into_iter().step_by(3) {
        let tl = simulate(&p, &costs).unwrap();
        let json = tl.to_json();
        let text = serde_json::to_string(&json).unwrap();
        let back = Timeline::from_json(&serde_json::from_str(&text).unwrap()).unwrap();
        assert_eq!(back, tl);
        assert_eq!(json["makespan"], serde_json::json!(tl.makespan));
        assert_eq!(
            json["bubble_fraction"],
            serde_json::json!(tl.bubble_fraction)
        );
        let r0 = &json["ranks"][0];
        for key in [
            "rank",
            "busy",
            "idle",
            "comm",
            "bubble_fraction",
            "peak_activations",
        ] {
            assert!(r0.get(key).is_some(), "missing {key} in {r0}");
        }
        assert_eq!(
            r0["actions"][0]["action"],
            tl.ranks[0].actions[0].action.to_string()
        );
    }
    assert!(Timeline::from_json(&serde_json::json!({"makespan": 1})).is_err());
}

#[test]
fn costs_parse_any_subset_case_insensitively() {
    assert_eq!("".parse::<Costs>().unwrap(), Costs::default());
    let c: Costs = "f=2, b=4 ,I=1.5,w=0.5,COMM=0.25".parse().unwrap();
    assert_eq!(
        c,
        Costs {
            f: 2.0,
            b: 4.0,
            i: 1.5,
            w: 0.5,
            comm: 0.25
        }
    );
    let c: Costs = "B=3".parse().unwrap();
    assert_eq!(
        c,
        Costs {
            b: 3.0,
            ..Costs::default()
        }
    );
    assert_eq!(Costs::default().to_string(), "F=1,B=2,I=1,W=1,comm=0");
    assert_eq!(
        Costs::default().to_string().parse::<Costs>().unwrap(),
        Costs::default()
    );
    let e = |t: &str| t.parse::<Costs>().unwrap_err().to_string();
    assert!(e("X=1").contains("unknown key \"x\""));
    assert!(e("F=fast").contains("\"fast\" is not a number"));
    assert!(e("F").contains("is not KEY=VALUE"));
    assert_eq!(e("B=-1"), "cost B=-1 must be a finite number >= 0");
}

#[test]
fn kinds_and_formats_parse() {
    assert_eq!(
        "gpipe".parse::<ScheduleKind>().unwrap(),
        ScheduleKind::GPipe
    );
    assert_eq!(
        "1F1B".parse::<ScheduleKind>().unwrap(),
        ScheduleKind::OneFOneB
    );
    assert_eq!("zb-h1".parse::<ScheduleKind>().unwrap(), ScheduleKind::ZbH1);
    assert_eq!(
        "interleaved".parse::<ScheduleKind>().unwrap(),
        ScheduleKind::Interleaved { virtual_stages: 2 }
    );
    assert_eq!(
        "interleaved:3".parse::<ScheduleKind>().unwrap(),
        ScheduleKind::Interleaved { virtual_stages: 3 }
    );
    for k in [
        ScheduleKind::GPipe,
        ScheduleKind::OneFOneB,
        ScheduleKind::ZbH1,
        ScheduleKind::ZbH2,
        ScheduleKind::Interleaved { virtual_stages: 4 },
    ] {
        assert_eq!(k.to_string().parse::<ScheduleKind>().unwrap(), k);
    }
    assert_eq!(
        ScheduleKind::from_name("interleaved", Some(4)).unwrap(),
        ScheduleKind::Interleaved { virtual_stages: 4 }
    );
    assert_eq!(
        ScheduleKind::from_name("1f1b", Some(2))
            .unwrap_err()
            .to_string(),
        "virtual stages (2) only apply to the interleaved schedule, not 1f1b"
    );
    assert_eq!(
        "pipedream".parse::<ScheduleKind>().unwrap_err().to_string(),
        "unknown schedule \"pipedream\": expected gpipe, 1f1b, interleaved, zb-h1 or zb-h2"
    );
    assert_eq!("SVG".parse::<Format>().unwrap(), Format::Svg);
    assert!("png".parse::<Format>().is_err());
}

#[test]
fn tags_match_sends_to_receives_and_are_unique() {
    let s: Action = "1SF3".parse().unwrap();
    let r: Action = "2RF3".parse().unwrap();
    assert_eq!(tag(&s), tag(&r));
    assert_eq!(tag(&s), (2 << 33) | (3 << 1));
    assert_eq!(tag(&"2SB3".parse().unwrap()), tag(&"1RB3".parse().unwrap()));
    assert_eq!(tag(&"2SB3".parse().unwrap()), (1 << 33) | (3 << 1) | 1);
    for p in samples().into_iter().filter(Program::is_lowered) {
        let mut sends = HashSet::new();
        let mut recvs = HashSet::new();
        for a in p.ranks.iter().flatten() {
            if a.op.is_send() {
                assert!(sends.insert(tag(a)), "duplicate tag for {a}");
                assert_eq!(tag(a), tag(&a.matching().unwrap()));
                assert_eq!(
                    p.peer_rank(a),
                    Some(p.rank_of_stage(a.matching().unwrap().stage))
                );
            } else if a.op.is_recv() {
                assert!(recvs.insert(tag(a)), "duplicate tag for {a}");
            }
        }
        assert_eq!(sends, recvs);
    }
}
