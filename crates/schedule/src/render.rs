//! Rendering a [`Timeline`]: a terminal grid, an SVG Gantt chart, JSON.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::action::Op;
use crate::simulate::Timeline;

/// Formats a time: integers without decimals, others with up to 3.
pub(crate) fn fmt_num(x: f64) -> String {
    if (x - x.round()).abs() < 1e-9 {
        format!("{}", x.round() as i64)
    } else {
        let s = format!("{x:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

fn pct(x: f64) -> String {
    format!("{:.1}%", 100.0 * x)
}

/// The time one grid column stands for: 1 if all times are integers, else
/// `1/k` for the smallest `k <= 12` that makes them integers, else a
/// 400th of the makespan.
fn grid_unit(tl: &Timeline) -> f64 {
    let times: Vec<f64> = tl
        .ranks
        .iter()
        .flat_map(|r| r.actions.iter())
        .flat_map(|a| [a.start, a.end])
        .collect();
    for k in 1..=12u32 {
        let k = f64::from(k);
        if times
            .iter()
            .all(|t| ((t * k) - (t * k).round()).abs() < 1e-6)
        {
            let u = 1.0 / k;
            if tl.makespan / u <= 400.0 {
                return u;
            }
            break;
        }
    }
    (tl.makespan / 400.0).max(f64::MIN_POSITIVE)
}

/// A time × rank grid for the terminal: one row per rank, one column per
/// time unit, each cell the label of the action running then (`0F3`, `1SB0`;
/// actions longer than one unit repeat their label) or `.` when idle,
/// followed by a summary line with the makespan, the bubble (overall and per
/// rank) and each rank's peak activations. Zero-length actions (messages
/// when `comm = 0`) do not show.
///
/// ```
/// use switchyard_schedule::{generate, render_text, simulate, Costs, ScheduleKind};
/// let tl = simulate(&generate(ScheduleKind::GPipe, 2, 2).unwrap(), &Costs::default()).unwrap();
/// assert_eq!(render_text(&tl), "\
/// time    0                   5
/// rank 0  0F0 0F1 .   .   .   0B0 0B0 0B1 0B1
/// rank 1  .   1F0 1F1 1B0 1B0 1B1 1B1 .   .
/// makespan 9, bubble 33.3% (per rank 33.3% 33.3%), peak activations 2 2
/// ");
/// ```
pub fn render_text(tl: &Timeline) -> String {
    let unit = grid_unit(tl);
    let ncols = if tl.makespan > 0.0 {
        (tl.makespan / unit - 1e-6).ceil() as usize
    } else {
        0
    };
    let width = tl
        .ranks
        .iter()
        .flat_map(|r| r.actions.iter())
        .filter(|a| a.end > a.start)
        .map(|a| a.action.to_string().len())
        .max()
        .unwrap_or(1)
        .max(1);
    let head = format!("rank {}", tl.ranks.len().saturating_sub(1)).len() + 2;
    let mut out = String::new();
    // Time axis: a tick every 5 columns.
    let mut axis = format!("{:head$}", "time");
    for c in (0..ncols).step_by(5) {
        let target = head + c * (width + 1);
        while axis.len() < target {
            axis.push(' ');
        }
        axis.push_str(&fmt_num(c as f64 * unit));
    }
    out.push_str(axis.trim_end());
    out.push('\n');
    for r in &tl.ranks {
        let mut row = format!("{:head$}", format!("rank {}", r.rank));
        let mut cells = vec![".".to_string(); ncols];
        for a in r.actions.iter().filter(|a| a.end > a.start) {
            let first = ((a.start / unit) + 0.5 - 1e-6).floor().max(0.0) as usize;
            let last = ((a.end / unit) - 0.5 + 1e-6).floor() as usize;
            let label = a.action.to_string();
            for cell in cells.iter_mut().take(last + 1).skip(first) {
                cell.clone_from(&label);
            }
        }
        let cells: Vec<String> = cells.iter().map(|c| format!("{c:width$}")).collect();
        row.push_str(&cells.join(" "));
        out.push_str(row.trim_end());
        out.push('\n');
    }
    let per_rank: Vec<String> = tl.ranks.iter().map(|r| pct(r.bubble_fraction)).collect();
    let peaks: Vec<String> = tl
        .ranks
        .iter()
        .map(|r| r.peak_activations.to_string())
        .collect();
    let _ = write!(
        out,
        "makespan {}, bubble {} (per rank {}), peak activations {}",
        fmt_num(tl.makespan),
        pct(tl.bubble_fraction),
        per_rank.join(" "),
        peaks.join(" ")
    );
    if (unit - 1.0).abs() > 1e-12 {
        let _ = write!(out, "; one column = {} time units", fmt_num(unit));
    }
    out.push('\n');
    out
}

/// The JSON form of a timeline:
/// `{num_stages, num_microbatches, costs: {f, b, i, w, comm}, makespan,
/// bubble_fraction, ranks: [{rank, busy, comm, idle, bubble_fraction,
/// peak_activations, actions: [{action: "0F0", start, end}, ...]}]}`.
/// [`Timeline::from_json`] reads it back.
pub fn to_json(tl: &Timeline) -> serde_json::Value {
    serde_json::to_value(tl).expect("a timeline always serializes")
}

const COLORS: [(Op, &str, &str); 4] = [
    (Op::F, "#4e79a7", "forward (F)"),
    (Op::B, "#59a14f", "backward (B)"),
    (Op::I, "#e8a33d", "input grad (I)"),
    (Op::W, "#9d6fb0", "weight grad (W)"),
];
const COMM_COLOR: &str = "#7f7f7f";

fn color(op: Op) -> &'static str {
    COLORS
        .iter()
        .find(|(o, _, _)| *o == op)
        .map_or(COMM_COLOR, |c| c.1)
}

/// Mixes a `#rrggbb` colour with white by `t` in `0..=1`.
fn lighten(hex: &str, t: f64) -> String {
    let c = |i: usize| u8::from_str_radix(&hex[i..i + 2], 16).unwrap_or(0);
    let mix = |v: u8| (f64::from(v) + (255.0 - f64::from(v)) * t).round() as u8;
    format!("#{:02x}{:02x}{:02x}", mix(c(1)), mix(c(3)), mix(c(5)))
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Options of [`render_svg_with`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SvgOptions {
    /// A title above the chart; none when empty.
    pub title: String,
    /// Horizontal scale in pixels per time unit. By default the chart is
    /// about 960 pixels wide; set it to draw several charts to one scale.
    pub px_per_unit: Option<f64>,
}

/// An SVG Gantt chart with default options (see [`render_svg_with`]).
pub fn render_svg(tl: &Timeline) -> String {
    render_svg_with(tl, &SvgOptions::default())
}

/// An SVG Gantt chart with a title (see [`render_svg_with`]).
pub fn render_svg_titled(tl: &Timeline, title: &str) -> String {
    render_svg_with(
        tl,
        &SvgOptions {
            title: title.to_string(),
            ..SvgOptions::default()
        },
    )
}

/// An SVG Gantt chart: a row per rank, a box per compute action coloured by
/// op (F, B, I, W distinct; later virtual stages of a rank lighter) with the
/// microbatch number inside and the action and its times as a tooltip,
/// messages as thin grey bars (omitted when they take no time), a time
/// axis, a legend and a summary line.
pub fn render_svg_with(tl: &Timeline, options: &SvgOptions) -> String {
    let title = options.title.as_str();
    let (left, top, row_h, gap) = (64.0, if title.is_empty() { 12.0 } else { 34.0 }, 26.0, 6.0);
    let span = tl.makespan.max(1e-9);
    let sx = options
        .px_per_unit
        .filter(|x| x.is_finite() && *x > 0.0)
        .unwrap_or_else(|| (960.0 / span).clamp(2.0, 48.0));
    let plot_w = span * sx;
    let rows = tl.ranks.len() as f64;
    let axis_y = top + rows * (row_h + gap);
    let width = left + plot_w + 24.0;
    let height = axis_y + 78.0;
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w:.0}" height="{h:.0}" viewBox="0 0 {w:.0} {h:.0}" font-family="sans-serif" font-size="12">"#,
        w = width,
        h = height
    );
    let _ = writeln!(s, r##"<rect width="100%" height="100%" fill="#ffffff"/>"##);
    if !title.is_empty() {
        let _ = writeln!(
            s,
            r#"<text x="{left}" y="22" font-size="15" font-weight="bold">{}</text>"#,
            escape(title)
        );
    }
    let mut chunks_per_rank = 1usize;
    for (r, rank) in tl.ranks.iter().enumerate() {
        let y = top + r as f64 * (row_h + gap);
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="end" dominant-baseline="middle">rank {}</text>"#,
            left - 8.0,
            y + row_h / 2.0,
            rank.rank
        );
        let _ = writeln!(
            s,
            r##"<rect x="{left}" y="{y:.1}" width="{plot_w:.1}" height="{row_h}" fill="#f3f3f3"/>"##
        );
        // Virtual-stage index of each stage on this rank.
        let stages: BTreeMap<u32, usize> = {
            let mut st: Vec<u32> = rank.actions.iter().map(|a| a.action.stage).collect();
            st.sort_unstable();
            st.dedup();
            st.into_iter().enumerate().map(|(i, s)| (s, i)).collect()
        };
        chunks_per_rank = chunks_per_rank.max(stages.len());
        for a in rank.actions.iter().filter(|a| a.end > a.start) {
            let x = left + a.start * sx;
            let w = (a.end - a.start) * sx;
            let tip = format!("{} [{}, {})", a.action, fmt_num(a.start), fmt_num(a.end));
            if a.action.op.is_comm() {
                let _ = writeln!(
                    s,
                    r#"<rect x="{x:.2}" y="{:.1}" width="{w:.2}" height="5" fill="{COMM_COLOR}"><title>{tip}</title></rect>"#,
                    y + row_h - 5.0
                );
                continue;
            }
            let chunk = stages.get(&a.action.stage).copied().unwrap_or(0);
            let fill = lighten(
                color(a.action.op),
                0.45 * chunk as f64 / stages.len() as f64,
            );
            let _ = writeln!(
                s,
                r##"<rect x="{x:.2}" y="{y:.1}" width="{w:.2}" height="{row_h}" fill="{fill}" stroke="#ffffff" stroke-width="1"><title>{tip}</title></rect>"##
            );
            if w >= 9.0 {
                let fs = (w * 0.55).min(11.0);
                let _ = writeln!(
                    s,
                    r##"<text x="{:.2}" y="{:.1}" text-anchor="middle" dominant-baseline="middle" font-size="{fs:.1}" fill="#ffffff">{}</text>"##,
                    x + w / 2.0,
                    y + row_h / 2.0,
                    a.action.microbatch
                );
            }
        }
    }
    // Time axis.
    let _ = writeln!(
        s,
        r##"<line x1="{left}" y1="{axis_y:.1}" x2="{:.1}" y2="{axis_y:.1}" stroke="#333333"/>"##,
        left + plot_w
    );
    let step = [1.0, 2.0, 5.0]
        .iter()
        .flat_map(|m| (-3..7).map(move |e| m * 10f64.powi(e)))
        .filter(|st| span / st <= 20.0)
        .fold(f64::INFINITY, f64::min);
    let mut t = 0.0;
    while t <= span + 1e-9 {
        let x = left + t * sx;
        let _ = writeln!(
            s,
            r##"<line x1="{x:.1}" y1="{axis_y:.1}" x2="{x:.1}" y2="{:.1}" stroke="#333333"/><text x="{x:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}</text>"##,
            axis_y + 4.0,
            axis_y + 15.0,
            fmt_num(t)
        );
        t += step;
    }
    // Legend and summary.
    let ly = axis_y + 34.0;
    let mut x = left;
    let has = |op: Op| {
        tl.ranks
            .iter()
            .flat_map(|r| &r.actions)
            .any(|a| a.action.op == op)
    };
    for (op, col, name) in COLORS.iter().filter(|(op, _, _)| has(*op)) {
        let _ = writeln!(
            s,
            r#"<rect x="{x:.1}" y="{:.1}" width="12" height="12" fill="{col}"/><text x="{:.1}" y="{ly:.1}" dominant-baseline="middle">{name}</text>"#,
            ly - 6.0,
            x + 16.0
        );
        x += 16.0 + 8.0 * name.len() as f64 + 14.0;
        let _ = op;
    }
    if tl
        .ranks
        .iter()
        .flat_map(|r| &r.actions)
        .any(|a| a.action.op.is_comm() && a.end > a.start)
    {
        let _ = writeln!(
            s,
            r#"<rect x="{x:.1}" y="{:.1}" width="12" height="5" fill="{COMM_COLOR}"/><text x="{:.1}" y="{ly:.1}" dominant-baseline="middle">send/recv</text>"#,
            ly - 2.0,
            x + 16.0
        );
    }
    let mut summary = format!(
        "makespan {}, bubble {}, peak activations per rank {}",
        fmt_num(tl.makespan),
        pct(tl.bubble_fraction),
        tl.peak_activations()
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" ")
    );
    if chunks_per_rank > 1 {
        summary.push_str("; lighter boxes are later virtual stages");
    }
    let _ = writeln!(
        s,
        r#"<text x="{left}" y="{:.1}" font-size="11">{}</text>"#,
        ly + 22.0,
        escape(&summary)
    );
    s.push_str("</svg>\n");
    s
}
