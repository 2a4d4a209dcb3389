//! `switchyard plan` (issue 15 §4): every layout of a model on `N` workers (dp × pp × tp,
//! schedule, microbatches, virtual stages), each with its predicted peak memory per
//! worker ([`super::memory`]) and step time (a caller's time model, [`super::time`]),
//! ranked: the layouts that fit the memory budget, fastest first, then the rejected ones
//! with why.
//!
//! A layout's text form is `dp2 pp2 tp1 1f1b m8` (`interleaved v2` for two virtual
//! stages; `ep2` for experts spread over groups of two replicas; `sp` for sequence
//! parallelism; `zero1` for ZeRO stage 1; `recompute-full` or `recompute-selective` for
//! activation recomputation): [`Layout`] parses and prints it.
//!
//! With tensor parallelism, each layout is tried with and without sequence parallelism
//! where the model supports it and the tensor-parallel ranks split the sequence evenly:
//! it divides the LayerNorms' and the residual stream's activations by `tp` and turns
//! each all-reduce into an all-gather and a reduce-scatter (both priced by the models).
//!
//! A model with experts ([`Model::experts`]) is planned at every expert-parallel degree
//! that divides both the replicas and the experts: `ep` trades the experts' memory (a
//! replica holds `1/ep` of them) for all-to-alls (priced by the time model).
//!
//! The memory savers are tried in order of what they cost: for each layout and each ZeRO
//! stage (0, and 1 with data parallelism: it shards the optimizer state and moves the
//! bytes of the all-reduce), no recomputation, then selective, then full, stopping at the
//! first that fits.

use std::fmt;
use std::str::FromStr;

use switchyard_mem::Category;
use switchyard_models::Model;
use switchyard_schedule::{ScheduleChoice, ScheduleKind};

use super::memory::{estimate_memory, RankEstimate};
use crate::{Recompute, TrainConfig};

/// Where a layout puts the workers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    pub schedule: ScheduleKind,
    pub microbatches: usize,
    pub recompute: Recompute,
    /// The ZeRO stage over the data-parallel axis.
    pub zero: u8,
    /// Expert parallelism: the replicas a mixture's experts are spread over (1: none).
    pub ep: usize,
    /// Sequence parallelism over the tensor-parallel axis (only with `tp > 1`).
    pub sequence_parallel: bool,
}

impl Layout {
    /// The layout of `cfg` (`None` for a schedule read from a file).
    pub fn of<M>(cfg: &TrainConfig<M>) -> Option<Layout> {
        let ScheduleChoice::Named(kind) = &cfg.schedule else {
            return None;
        };
        let schedule = match kind {
            ScheduleKind::Interleaved { .. } => ScheduleKind::Interleaved {
                virtual_stages: cfg.virtual_stages,
            },
            k => *k,
        };
        Some(Layout {
            dp: cfg.dp,
            pp: cfg.pp,
            tp: cfg.tp,
            schedule,
            microbatches: cfg.microbatches,
            recompute: cfg.recompute,
            zero: cfg.zero,
            ep: cfg.ep.max(1),
            sequence_parallel: cfg.splits_sequence(),
        })
    }

    /// `base` with this layout.
    pub fn apply<M: Clone>(&self, base: &TrainConfig<M>) -> TrainConfig<M> {
        let mut c = base.clone();
        c.dp = self.dp;
        c.pp = self.pp;
        c.tp = self.tp;
        c.microbatches = self.microbatches;
        c.virtual_stages = match self.schedule {
            ScheduleKind::Interleaved { virtual_stages } => virtual_stages,
            _ => 1,
        };
        c.schedule = ScheduleChoice::Named(self.schedule);
        c.recompute = self.recompute;
        c.zero = self.zero;
        c.ep = self.ep;
        c.sequence_parallel = self.sequence_parallel;
        c
    }

    pub fn workers(&self) -> usize {
        self.dp * self.pp * self.tp
    }
}

impl fmt::Display for Layout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "dp{} pp{} tp{} ", self.dp, self.pp, self.tp)?;
        match self.schedule {
            ScheduleKind::Interleaved { virtual_stages } => {
                write!(f, "interleaved v{virtual_stages}")?
            }
            ref k => write!(f, "{k}")?,
        }
        write!(f, " m{}", self.microbatches)?;
        if self.ep > 1 {
            write!(f, " ep{}", self.ep)?;
        }
        if self.sequence_parallel {
            write!(f, " sp")?;
        }
        if self.zero > 0 {
            write!(f, " zero{}", self.zero)?;
        }
        match self.recompute {
            Recompute::None => Ok(()),
            r => write!(f, " recompute-{r}"),
        }
    }
}

impl FromStr for Layout {
    type Err = String;
    /// `dp2 pp2 tp1 1f1b m8`: the axes and `m` in any order, each at most once; missing
    /// axes are 1; `interleaved` takes `vN` (default 2).
    fn from_str(s: &str) -> Result<Layout, String> {
        let (mut dp, mut pp, mut tp, mut m, mut v) = (None, None, None, None, None);
        let mut ep = None;
        let mut zero = None;
        let mut sequence_parallel = false;
        let (mut schedule, mut recompute) = (None, None);
        for word in s.split_whitespace() {
            if word == "sp" {
                if std::mem::replace(&mut sequence_parallel, true) {
                    return Err(format!("`{s}`: `sp` given twice"));
                }
                continue;
            }
            if let Some(mode) = word.strip_prefix("recompute-") {
                let r = mode
                    .parse::<Recompute>()
                    .map_err(|e| format!("`{s}`: {e}"))?;
                if recompute.replace(r).is_some() {
                    return Err(format!("`{s}`: two recompute modes"));
                }
                continue;
            }
            let num = |prefix: &str| -> Option<Result<usize, String>> {
                let rest = word.strip_prefix(prefix)?;
                if rest.is_empty() || !rest.bytes().all(|b| b.is_ascii_digit()) {
                    return None;
                }
                Some(
                    rest.parse::<usize>()
                        .ok()
                        .filter(|&n| n > 0)
                        .ok_or_else(|| format!("`{word}`: the count must be a positive number")),
                )
            };
            let slot = if let Some(n) = num("dp") {
                Some((&mut dp, n?))
            } else if let Some(n) = num("pp") {
                Some((&mut pp, n?))
            } else if let Some(n) = num("tp") {
                Some((&mut tp, n?))
            } else if let Some(n) = num("m") {
                Some((&mut m, n?))
            } else if let Some(n) = num("v") {
                Some((&mut v, n?))
            } else if let Some(n) = num("ep") {
                Some((&mut ep, n?))
            } else if let Some(n) = word.strip_prefix("zero").and_then(|z| z.parse::<u8>().ok()) {
                if zero.replace(n).is_some() {
                    return Err(format!("`{s}`: `{word}` given twice"));
                }
                continue;
            } else {
                None
            };
            match slot {
                Some((slot, n)) => {
                    if slot.replace(n).is_some() {
                        return Err(format!("`{s}`: `{word}` given twice"));
                    }
                }
                None => {
                    let kind: ScheduleKind = word.parse().map_err(|_| {
                        format!(
                            "`{s}`: `{word}` is neither an axis (dpN, ppN, tpN, mN, vN, epN), a \
                             schedule (gpipe, 1f1b, interleaved, zb-h1, zb-h2), sp, zeroN nor \
                             recompute-MODE"
                        )
                    })?;
                    if schedule.replace(kind).is_some() {
                        return Err(format!("`{s}`: two schedules"));
                    }
                }
            }
        }
        let mut schedule = schedule.unwrap_or(ScheduleKind::OneFOneB);
        match (&mut schedule, v) {
            (ScheduleKind::Interleaved { virtual_stages }, v) => *virtual_stages = v.unwrap_or(2),
            (_, Some(_)) => return Err(format!("`{s}`: vN is for the interleaved schedule")),
            _ => {}
        }
        let pp = pp.unwrap_or(1);
        let tp = tp.unwrap_or(1);
        if sequence_parallel && tp == 1 {
            return Err(format!(
                "`{s}`: sp splits the sequence over the tensor-parallel ranks: it needs tpN \
                 with N > 1"
            ));
        }
        Ok(Layout {
            dp: dp.unwrap_or(1),
            pp,
            tp,
            schedule,
            microbatches: m.unwrap_or(pp),
            recompute: recompute.unwrap_or_default(),
            zero: zero.unwrap_or(0),
            ep: ep.unwrap_or(1),
            sequence_parallel,
        })
    }
}

/// Why a layout is out.
#[derive(Debug, Clone, PartialEq)]
pub enum Verdict {
    /// It fits the budget.
    Fits,
    /// Its worst rank's predicted peak exceeds the budget.
    TooBig { peak: u64 },
    /// The trainer would refuse it (the reason, as the trainer says it).
    Invalid(String),
}

/// One layout, predicted.
#[derive(Debug, Clone)]
pub struct Candidate {
    pub layout: Layout,
    pub verdict: Verdict,
    /// Every pipeline rank's predicted peak (empty for an invalid layout).
    pub memory: Vec<RankEstimate>,
    /// The predicted step time, seconds (`None` without a time model or when it fails).
    pub step_s: Option<f64>,
}

impl Candidate {
    /// The worst rank's predicted peak.
    pub fn peak_bytes(&self) -> u64 {
        self.memory
            .iter()
            .map(|r| r.peak_bytes as u64)
            .max()
            .unwrap_or(0)
    }

    /// The category that dominates the worst rank's peak.
    pub fn dominant(&self) -> Option<Category> {
        self.memory
            .iter()
            .max_by_key(|r| r.peak_bytes)
            .map(|r| r.dominant())
    }
}

/// Every layout of exactly `workers` workers for `base`'s model and batch: each
/// factorisation `dp × pp × tp`, each generated schedule (interleaved with 2, 4 and 8
/// virtual stages, as long as every stage gets a layer), and microbatches of 1 to 64
/// sequences that divide a replica's batch, at least `pp` of them; for a model with
/// experts, each expert-parallel degree that divides the replicas and the experts; with
/// tensor parallelism, with and without sequence parallelism where the model supports it
/// and `tp` divides the sequence; without memory savers ([`plan`] adds them where
/// needed).
pub fn layouts<M: Model>(base: &TrainConfig<M>, workers: usize) -> Vec<Layout> {
    let mut out = Vec::new();
    let experts = base.model.experts();
    let splits =
        |tp: usize| tp > 1 && base.model.sequence_parallel() && base.seq_len.is_multiple_of(tp);
    for l in dense_layouts(base, workers) {
        if splits(l.tp) {
            out.push(Layout {
                sequence_parallel: true,
                ..l.clone()
            });
        }
        let eps: Vec<usize> = match experts {
            0 => vec![1],
            e => divisors(l.dp)
                .into_iter()
                .filter(|ep| e.is_multiple_of(*ep))
                .collect(),
        };
        out.extend(eps.into_iter().map(|ep| Layout { ep, ..l.clone() }));
    }
    out
}

/// [`layouts`] without expert parallelism.
fn dense_layouts<M: Model>(base: &TrainConfig<M>, workers: usize) -> Vec<Layout> {
    let layers = base.model.costs(base.seq_len).blocks.len();
    let mut out = Vec::new();
    for dp in divisors(workers) {
        for pp in divisors(workers / dp) {
            let tp = workers / dp / pp;
            let schedules: Vec<ScheduleKind> = match pp {
                1 => vec![ScheduleKind::OneFOneB],
                _ => [ScheduleKind::GPipe, ScheduleKind::OneFOneB]
                    .into_iter()
                    .chain(
                        [2, 4, 8]
                            .into_iter()
                            .filter(|&v| v == 2 || pp * v <= layers)
                            .map(|virtual_stages| ScheduleKind::Interleaved { virtual_stages }),
                    )
                    .chain([ScheduleKind::ZbH1, ScheduleKind::ZbH2])
                    .collect(),
            };
            let per_replica = base.batch / dp.max(1);
            for schedule in schedules {
                // Microbatches of 1 to 64 sequences that divide the replica's batch.
                for size in divisors(per_replica).into_iter().filter(|&b| b <= 64) {
                    let m = per_replica / size;
                    if m >= pp {
                        out.push(Layout {
                            dp,
                            pp,
                            tp,
                            schedule,
                            microbatches: m,
                            recompute: Recompute::None,
                            zero: 0,
                            ep: 1,
                            sequence_parallel: false,
                        });
                    }
                }
            }
        }
    }
    out
}

fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n.is_multiple_of(*d)).collect()
}

/// Predicts `layout` on `base`: valid? how much memory? how long a step (by `time`)?
pub fn candidate<M: Model>(
    base: &TrainConfig<M>,
    layout: &Layout,
    budget: Option<u64>,
    time: &dyn Fn(&TrainConfig<M>) -> Option<f64>,
) -> Candidate {
    let mut c = memory_only(base, layout, budget);
    if !c.memory.is_empty() {
        c.step_s = time(&layout.apply(base));
    }
    c
}

/// [`candidate`] without the step time.
fn memory_only<M: Model>(base: &TrainConfig<M>, layout: &Layout, budget: Option<u64>) -> Candidate {
    let cfg = layout.apply(base);
    let invalid = |why: String| Candidate {
        layout: layout.clone(),
        verdict: Verdict::Invalid(why),
        memory: Vec::new(),
        step_s: None,
    };
    if let Err(e) = cfg.validate_layout() {
        return invalid(e.to_string());
    }
    let memory = match estimate_memory(&cfg) {
        Ok(m) => m,
        Err(e) => return invalid(e.to_string()),
    };
    let mut c = Candidate {
        layout: layout.clone(),
        verdict: Verdict::Fits,
        memory,
        step_s: None,
    };
    let peak = c.peak_bytes();
    if budget.is_some_and(|b| peak > b) {
        c.verdict = Verdict::TooBig { peak };
    }
    c
}

/// `layout` with each ZeRO stage worth trying (0, and 1 to 3 with data parallelism) and, for
/// each, the cheapest recomputation that fits `budget` (the last tried, `full`, when none
/// does).
fn with_savers<M: Model>(
    base: &TrainConfig<M>,
    layout: &Layout,
    budget: Option<u64>,
    time: &(dyn Fn(&TrainConfig<M>) -> Option<f64> + Sync),
) -> Vec<Candidate> {
    let zeros: &[u8] = if layout.dp > 1 { &[0, 1, 2, 3] } else { &[0] };
    let mut out = Vec::new();
    for &zero in zeros {
        for recompute in Recompute::ALL {
            let l = Layout {
                recompute,
                zero,
                ..layout.clone()
            };
            // Timed only once chosen: the time model costs more than the memory's.
            let mut c = memory_only(base, &l, budget);
            let done = !matches!(c.verdict, Verdict::TooBig { .. });
            if done || recompute == Recompute::Full {
                if !c.memory.is_empty() {
                    c.step_s = time(&l.apply(base));
                }
                out.push(c);
                break;
            }
        }
    }
    out
}

/// Every layout of `workers` workers, with the memory savers it needs, predicted and
/// ranked: those that fit, fastest first (least memory first without times); then those
/// too big, smallest first; then the invalid ones.
pub fn plan<M: Model + Sync>(
    base: &TrainConfig<M>,
    workers: usize,
    budget: Option<u64>,
    time: &(dyn Fn(&TrainConfig<M>) -> Option<f64> + Sync),
) -> Vec<Candidate> {
    use rayon::prelude::*;
    let mut all: Vec<Candidate> = layouts(base, workers)
        .par_iter()
        .flat_map_iter(|l| with_savers(base, l, budget, time))
        .collect();
    let rank = |c: &Candidate| match c.verdict {
        Verdict::Fits => 0,
        Verdict::TooBig { .. } => 1,
        Verdict::Invalid(_) => 2,
    };
    all.sort_by(|a, b| {
        rank(a)
            .cmp(&rank(b))
            .then_with(|| match (a.step_s, b.step_s) {
                (Some(x), Some(y)) if rank(a) == 0 => x.total_cmp(&y),
                _ => a.peak_bytes().cmp(&b.peak_bytes()),
            })
    });
    all
}

#[cfg(test)]
mod tests;
