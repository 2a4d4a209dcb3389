//! The time model's rates ([`TimeModel`]): a link's `α + bytes / β`, a part's measured
//! time against its FLOPs per model width, and the machine's fixed costs; what
//! [`super::predict_step_time`] divides the work by.

use serde::{Deserialize, Serialize};

/// A link's cost: `α + bytes / β`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AlphaBeta {
    /// Latency, seconds.
    pub alpha_s: f64,
    /// Bandwidth, bytes per second.
    pub bytes_per_s: f64,
}

impl AlphaBeta {
    /// Seconds to move `bytes`.
    pub fn time(&self, bytes: f64) -> f64 {
        self.alpha_s + bytes / self.bytes_per_s
    }

    /// An all-reduce of `bytes` over `ranks` ranks (a ring): `(k − 1) · α + 2 · (k − 1)/k ·
    /// bytes / β`, which is [`AlphaBeta::time`] on 2 ranks and 0 on one.
    pub fn all_reduce(&self, bytes: f64, ranks: usize) -> f64 {
        if ranks <= 1 {
            return 0.0;
        }
        let k = ranks as f64;
        (k - 1.0) * self.alpha_s + 2.0 * (k - 1.0) / k * bytes / self.bytes_per_s
    }

    /// The least-squares fit of `(bytes, seconds)` points; the latency is kept at 0 or
    /// more, the bandwidth finite (1 PB/s when the times do not grow with the size).
    pub fn fit(points: &[(f64, f64)]) -> AlphaBeta {
        let (alpha, slope) = fit_line(points);
        let slope = slope.max(1e-15);
        AlphaBeta {
            alpha_s: alpha.max(0.0),
            bytes_per_s: 1.0 / slope,
        }
    }
}

/// One part's time against its FLOPs at one model width, measured (see
/// [`TimeModel::part_seconds`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PartCurve {
    /// The model width `d` the curve was measured at.
    pub width: usize,
    /// One part (a layer, the embeddings or the head) of one microbatch, forward and
    /// backward, on one thread: `(FLOPs, seconds)` at a few sizes, by increasing FLOPs
    /// (at least two points).
    pub points: Vec<(f64, f64)>,
    /// What a second thread adds at each of those sizes, as a fraction of the first
    /// (`e`: 0 gains nothing, 1 halves the time).
    pub thread_efficiency: Vec<f64>,
    /// How much slower each size runs on one thread while another worker computes on
    /// another core at the same time (`c ≥ 1`: shared caches, memory bandwidth, the
    /// allocator); empty: 1.
    #[serde(default)]
    pub concurrent_slowdown: Vec<f64>,
}

impl PartCurve {
    /// `(S₁(x), e(x), c(x))` on this curve: interpolated linearly between the points;
    /// below the first along the line through the first two (`e`, `c` the first's),
    /// above the last in proportion to `x` (`e`, `c` the last's).
    fn at(&self, x: f64) -> (f64, f64, f64) {
        let (pts, n) = (&self.points, self.points.len());
        let e = |i: usize| self.thread_efficiency.get(i).copied().unwrap_or(0.0);
        let c = |i: usize| self.concurrent_slowdown.get(i).copied().unwrap_or(1.0);
        match n {
            0 => (0.0, 0.0, 1.0),
            1 => (pts[0].1 * x / pts[0].0, e(0), c(0)),
            _ if x <= pts[0].0 => {
                let o = self.overhead();
                (o + (pts[0].1 - o) * x / pts[0].0, e(0), c(0))
            }
            _ if x >= pts[n - 1].0 => (pts[n - 1].1 * x / pts[n - 1].0, e(n - 1), c(n - 1)),
            _ => {
                let k = pts.iter().position(|p| p.0 > x).unwrap_or(n - 1);
                let ((x0, s0), (x1, s1)) = (pts[k - 1], pts[k]);
                let f = (x - x0) / (x1 - x0);
                let lerp = |g: &dyn Fn(usize) -> f64| g(k - 1) + f * (g(k) - g(k - 1));
                (s0 + f * (s1 - s0), lerp(&e), lerp(&c))
            }
        }
    }

    /// `S₁(0)`: the line through the first two points at 0 (at least 0).
    pub fn overhead(&self) -> f64 {
        match self.points[..] {
            [(x0, s0), (x1, s1), ..] if x1 > x0 => (s0 - (s1 - s0) / (x1 - x0) * x0).max(0.0),
            _ => 0.0,
        }
    }

    /// FLOP/s of one thread at the largest size, and beyond.
    pub fn rate(&self) -> f64 {
        self.points.last().map_or(0.0, |&(x, s)| x / s)
    }
}

/// This machine's rates: what [`super::predict_step_time`] divides the work by.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TimeModel {
    /// A part's time against its FLOPs, at a few widths, by increasing width.
    pub curves: Vec<PartCurve>,
    /// FLOP/s of one compute thread at the largest size of the widest curve (`r`).
    pub flops_per_s_per_thread: f64,
    /// Seconds of a part with no FLOPs on the narrowest curve (`o`).
    pub overhead_per_part_s: f64,
    /// The forward's share of a part's forward and backward time (`φ`).
    pub forward_fraction: f64,
    /// Seconds per parameter of the step's end: gradient norm, clipping, AdamW (`a`).
    pub optimizer_s_per_param: f64,
    /// Seconds per parameter tensor of the step's end, besides its elements (`a_t`).
    #[serde(default)]
    pub optimizer_s_per_tensor: f64,
    /// Pipeline messages, one way (a send and its receive).
    pub p2p: AlphaBeta,
    /// All-reduces on 2 ranks.
    pub collective: AlphaBeta,
    /// The data-parallel all-reduces' link when it is not [`TimeModel::collective`]'s (a
    /// cluster whose replicas span nodes).
    #[serde(default)]
    pub dp_collective: Option<AlphaBeta>,
    /// Seconds a training step costs besides its parts, its messages and its optimizer
    /// (`o_step`: cutting the batch, building the executor, collecting the gradients, the
    /// bookkeeping of the report), measured on one worker.
    #[serde(default)]
    pub step_overhead_s: f64,
    /// What a step of several workers costs on top of `o_step` (`o_world`: waking the
    /// ranks' threads at each collective and message beyond what `α` counts).
    #[serde(default)]
    pub world_overhead_s: f64,
    /// The cores the workers share (this machine's, calibrated), or `None` when each
    /// worker has a device of its own (a cluster, [`TimeModel::linear`]). More threads
    /// than cores take turns (the module doc of [`super::predict_step_time`]'s: "Shared
    /// cores").
    #[serde(default)]
    pub cores: Option<usize>,
}

/// `(intercept, slope)` of the least-squares line through `points` (a horizontal line
/// through their mean when all `x` are equal).
fn fit_line(points: &[(f64, f64)]) -> (f64, f64) {
    let n = points.len().max(1) as f64;
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    (my - slope * mx, slope)
}

impl TimeModel {
    /// A rate `r` per thread and a fixed `o` per part at any width, nothing gained from
    /// more threads: `S₁(x) = o + x / r` (for tests and back-of-the-envelope models).
    pub fn linear(flops_per_s_per_thread: f64, overhead_per_part_s: f64) -> TimeModel {
        let s = |x: f64| overhead_per_part_s + x / flops_per_s_per_thread;
        TimeModel {
            curves: vec![PartCurve {
                width: 1,
                points: vec![(1e6, s(1e6)), (1e30, s(1e30))],
                thread_efficiency: vec![0.0, 0.0],
                concurrent_slowdown: Vec::new(),
            }],
            flops_per_s_per_thread,
            overhead_per_part_s,
            forward_fraction: 1.0 / 3.0,
            optimizer_s_per_param: 0.0,
            optimizer_s_per_tensor: 0.0,
            step_overhead_s: 0.0,
            world_overhead_s: 0.0,
            cores: None,
            p2p: AlphaBeta {
                alpha_s: 0.0,
                bytes_per_s: 1e15,
            },
            collective: AlphaBeta {
                alpha_s: 0.0,
                bytes_per_s: 1e15,
            },
            dp_collective: None,
        }
    }

    /// Seconds of one part of `flops` FLOPs of a model of `width` (`None`: the widest
    /// curve's) on a worker of `threads` threads, `shared` when other workers compute
    /// on the machine's other cores at the same time: `S₁(x) · [shared] c(x) / (1 + e(x)
    /// · (t − 1))` on each curve ([`PartCurve`]), interpolated linearly in `log(width)`
    /// between the two curves around `width` (the nearest one outside them).
    pub fn part_seconds(
        &self,
        width: Option<usize>,
        flops: f64,
        threads: usize,
        shared: bool,
    ) -> f64 {
        let on = |curve: &PartCurve| {
            let (s, e, c) = curve.at(flops);
            let c = if shared { c.max(1.0) } else { 1.0 };
            s.max(0.0) * c / (1.0 + e * (threads.max(1) - 1) as f64)
        };
        let (Some(first), Some(last)) = (self.curves.first(), self.curves.last()) else {
            return 0.0;
        };
        let w = width.map_or(last.width, |w| w.max(1)) as f64;
        match self.curves.iter().position(|c| c.width as f64 >= w) {
            None => on(last),
            Some(0) => on(first),
            Some(k) => {
                let (a, b) = (&self.curves[k - 1], &self.curves[k]);
                let (la, lb) = ((a.width as f64).ln(), (b.width as f64).ln());
                let f = (w.ln() - la) / (lb - la);
                on(a) + f * (on(b) - on(a))
            }
        }
    }
}
