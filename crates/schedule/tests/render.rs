//! Snapshot tests of the terminal grid, and checks of the SVG and JSON output.

use switchyard_schedule::{
    generate, lower, render_svg, render_svg_titled, render_text, report, simulate, Costs, Format,
    ScheduleKind,
};

fn grid(kind: ScheduleKind, p: usize, m: usize, costs: &str, lowered: bool) -> String {
    let mut program = generate(kind, p, m).unwrap();
    if lowered {
        program = lower(&program).unwrap();
    }
    render_text(&simulate(&program, &costs.parse().unwrap()).unwrap())
}

#[test]
fn grid_1f1b_p2_m3() {
    assert_eq!(
        grid(ScheduleKind::OneFOneB, 2, 3, "", false),
        "\
time    0                   5                   10
rank 0  0F0 0F1 .   .   0B0 0B0 0F2 0B1 0B1 .   0B2 0B2
rank 1  .   1F0 1B0 1B0 1F1 1B1 1B1 1F2 1B2 1B2 .   .
makespan 12, bubble 25.0% (per rank 25.0% 25.0%), peak activations 2 1
"
    );
}

#[test]
fn grid_gpipe_p2_m2() {
    assert_eq!(
        grid(ScheduleKind::GPipe, 2, 2, "", false),
        "\
time    0                   5
rank 0  0F0 0F1 .   .   .   0B0 0B0 0B1 0B1
rank 1  .   1F0 1F1 1B0 1B0 1B1 1B1 .   .
makespan 9, bubble 33.3% (per rank 33.3% 33.3%), peak activations 2 2
"
    );
}

#[test]
fn grid_zb_h1_p2_m2() {
    assert_eq!(
        grid(ScheduleKind::ZbH1, 2, 2, "", false),
        "\
time    0                   5
rank 0  0F0 0F1 .   0I0 0W0 0I1 0W1
rank 1  .   1F0 1I0 1F1 1I1 1W0 1W1
makespan 7, bubble 14.3% (per rank 14.3% 14.3%), peak activations 2 2
"
    );
}

#[test]
fn grid_interleaved_p2_v2_m2() {
    assert_eq!(
        grid(
            ScheduleKind::Interleaved { virtual_stages: 2 },
            2,
            2,
            "",
            false
        ),
        "\
time    0                   5                   10
rank 0  0F0 0F1 2F0 2F1 .   .   2B0 2B0 .   2B1 2B1 0B0 0B0 0B1 0B1
rank 1  .   1F0 1F1 3F0 3B0 3B0 3F1 3B1 3B1 1B0 1B0 1B1 1B1 .   .
makespan 15, bubble 20.0% (per rank 20.0% 20.0%), peak activations 4 3
"
    );
}

#[test]
fn grid_shows_messages_that_take_time() {
    assert_eq!(
        grid(ScheduleKind::OneFOneB, 2, 1, "comm=1", true),
        "\
time    0                        5
rank 0  0F0  0SF0 .    .    .    .    .    0RB0 0B0  0B0
rank 1  .    .    1RF0 1F0  1B0  1B0  1SB0 .    .    .
makespan 10, bubble 50.0% (per rank 50.0% 50.0%), peak activations 1 1
"
    );
    // With comm = 0 the lowered grid equals the un-lowered one.
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
        assert_eq!(grid(kind, 3, 4, "", true), grid(kind, 3, 4, "", false));
    }
}

#[test]
fn grid_uses_fractional_columns_when_needed() {
    assert_eq!(
        grid(ScheduleKind::GPipe, 2, 1, "F=0.5,B=1", false),
        "\
time    0                   2.5
rank 0  0F0 .   .   .   0B0 0B0
rank 1  .   1F0 1B0 1B0 .   .
makespan 3, bubble 50.0% (per rank 50.0% 50.0%), peak activations 1 1; one column = 0.5 time units
"
    );
}

#[test]
fn svg_has_a_box_per_action_with_its_microbatch() {
    let program = lower(&generate(ScheduleKind::ZbH1, 3, 4).unwrap()).unwrap();
    let costs = Costs {
        comm: 0.1,
        ..Costs::default()
    };
    let tl = simulate(&program, &costs).unwrap();
    let svg = render_svg_titled(&tl, "ZB-H1 <p=3>");
    assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("ZB-H1 &lt;p=3&gt;"));
    // One tooltip per action that takes time (compute and, here, messages).
    assert_eq!(svg.matches("<title>").count(), program.num_actions());
    assert!(svg.contains("<title>2I3 ["));
    for name in [
        "forward (F)",
        "input grad (I)",
        "weight grad (W)",
        "send/recv",
        "rank 2",
    ] {
        assert!(svg.contains(name), "missing {name}");
    }
    assert!(
        !svg.contains("backward (B)"),
        "no B in a split-backward program"
    );
    // Distinct colours for F, I, W.
    for c in ["#4e79a7", "#e8a33d", "#9d6fb0"] {
        assert!(svg.contains(c), "missing colour {c}");
    }
    // Microbatch numbers are printed in the boxes.
    assert!(svg.contains(">3</text>"));
    // With comm = 0 messages are omitted.
    let svg0 = render_svg(&simulate(&program, &Costs::default()).unwrap());
    assert_eq!(svg0.matches("<title>").count(), 3 * 4 * 3);
    assert!(!svg0.contains("send/recv"));
}

#[test]
fn svg_marks_virtual_stages() {
    let tl = simulate(
        &generate(ScheduleKind::Interleaved { virtual_stages: 2 }, 2, 2).unwrap(),
        &Costs::default(),
    )
    .unwrap();
    let svg = render_svg(&tl);
    assert!(svg.contains("lighter boxes are later virtual stages"));
    assert!(svg.contains("backward (B)"));
}

#[test]
fn report_renders_every_format() {
    let program = generate(ScheduleKind::OneFOneB, 2, 3).unwrap();
    let costs = Costs::default();
    assert_eq!(
        report(&program, &costs, Format::Text).unwrap(),
        grid(ScheduleKind::OneFOneB, 2, 3, "", false)
    );
    let json: serde_json::Value =
        serde_json::from_str(&report(&program, &costs, Format::Json).unwrap()).unwrap();
    assert_eq!(json["makespan"], 12.0);
    assert_eq!(json["bubble_fraction"], 0.25);
    assert_eq!(json["ranks"][1]["peak_activations"], 1);
    assert_eq!(json["ranks"][1]["actions"][1]["action"], "1B0");
    assert_eq!(json["ranks"][1]["actions"][1]["start"], 2.0);
    let svg = report(&program, &costs, Format::Svg).unwrap();
    assert!(svg.contains("2 ranks, 2 stages, 3 microbatches"));
    // Invalid programs are refused, not rendered.
    let bad: switchyard_schedule::Program = "rank 0: 0B0 0F0\n".parse().unwrap();
    assert!(report(&bad, &costs, Format::Text).is_err());
}
