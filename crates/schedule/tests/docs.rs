//! The pictures and numbers in docs/schedules.md come from this crate.
//!
//! Regenerate the SVGs with
//! `SWITCHYARD_REGEN_DOCS=1 cargo test -p switchyard-schedule --test docs`;
//! without the variable the test checks that the committed files (when
//! present) are up to date and that the table in docs/schedules.md matches
//! what the simulator measures.

use std::path::PathBuf;

use switchyard_schedule::{
    generate, render_svg_with, simulate, Costs, ScheduleKind, SvgOptions, Timeline,
};

const P: usize = 4;
const M: usize = 8;
const V: usize = 2;

fn cases() -> Vec<(&'static str, &'static str, ScheduleKind, Costs)> {
    let d = Costs::default();
    let vf = V as f64;
    vec![
        ("gpipe", "GPipe", ScheduleKind::GPipe, d),
        ("1f1b", "1F1B", ScheduleKind::OneFOneB, d),
        (
            "interleaved",
            "Interleaved 1F1B (v=2)",
            ScheduleKind::Interleaved { virtual_stages: V },
            // A virtual stage is half a rank's layers: half the time.
            Costs {
                f: 1.0 / vf,
                b: 2.0 / vf,
                ..d
            },
        ),
        ("zb-h1", "ZB-H1", ScheduleKind::ZbH1, d),
        ("zb-h2", "ZB-H2", ScheduleKind::ZbH2, d),
    ]
}

fn docs_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../docs")
}

fn timeline(kind: ScheduleKind, costs: &Costs) -> Timeline {
    simulate(&generate(kind, P, M).unwrap(), costs).unwrap()
}

/// The row of the table in docs/schedules.md for one schedule.
fn table_row(title: &str, tl: &Timeline) -> String {
    let fmt = |x: f64| {
        let s = format!("{x:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    };
    let peaks: Vec<String> = tl.peak_activations().iter().map(u32::to_string).collect();
    format!(
        "| {title} | {} | {:.1}% | {} |",
        fmt(tl.makespan),
        100.0 * tl.bubble_fraction,
        peaks.join(" ")
    )
}

#[test]
fn docs_match_the_simulator() {
    let regen = std::env::var("SWITCHYARD_REGEN_DOCS").is_ok_and(|v| v == "1");
    let img = docs_dir().join("img");
    let md = std::fs::read_to_string(docs_dir().join("schedules.md")).ok();
    for (name, title, kind, costs) in cases() {
        let tl = timeline(kind, &costs);
        let options = SvgOptions {
            title: format!("{title}: p={P}, m={M}"),
            px_per_unit: Some(28.0),
        };
        let svg = render_svg_with(&tl, &options);
        let path = img.join(format!("schedule-{name}.svg"));
        if regen {
            std::fs::create_dir_all(&img).unwrap();
            std::fs::write(&path, &svg).unwrap();
            println!("wrote {}", path.display());
            println!("{}", table_row(title, &tl));
        } else if let Ok(old) = std::fs::read_to_string(&path) {
            assert!(
                old == svg,
                "{} is stale: run SWITCHYARD_REGEN_DOCS=1 cargo test -p switchyard-schedule --test docs",
                path.display()
            );
        }
        if let (Some(md), false) = (&md, regen) {
            let row = table_row(title, &tl);
            assert!(
                md.contains(&row),
                "docs/schedules.md lacks the measured row {row}"
            );
        }
    }
}
