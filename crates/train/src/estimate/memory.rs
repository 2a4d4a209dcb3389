//! Peak memory per rank, predicted (issue 15 §2), from the model's arithmetic
//! ([`Model::footprint`]) and the rank's action list, without building anything.
//!
//! For a rank that holds `Ψ` parameter elements (its stages' shards, a tied copy
//! counted once per rank) the estimate is, in bytes (f32 values, AdamW's moments in f64):
//!
//! | category | bytes |
//! |---|---|
//! | parameters | `4·Ψ` + bookkeeping per tensor |
//! | optimizer | `16·Ψ` (two f64 moments) + bookkeeping per tensor |
//! | gradients | what the step's timeline holds at the peak (below) + a matrix-multiply scratch per rank thread |
//! | activations | what the timeline holds at the peak |
//! | other | the weights the fused ops pack for the step + a matrix-multiply scratch per extra compute thread |
//!
//! The timeline walks the rank's actions in program order. A forward of stage `s` adds
//! `A_s = tokens · a_s + per-microbatch` bytes (`a_s`: the saved elements per token the
//! model declares, times 4). A backward holds, on top of everything live, the stage's new
//! parameter gradients `G_s = 4·Ψ_s`, the running sum's copy when gradients of an
//! earlier microbatch are already kept, and the gradients flowing back
//! (`tokens · backward_per_token · 4`); then it frees `A_s` and keeps `G_s`. A split
//! backward (`I`, `W`) keeps the weight gradients pending from `I` to `W`. After the last
//! action every parameter has a gradient (`4·Ψ`), and the step adds at most one of: the
//! data-parallel all-reduce of a bucket (three bucket-sized copies), the clipped copy of
//! every gradient (`4·Ψ`), or AdamW's f64 copies of the largest tensor's gradient
//! (`16·largest`). The peak is the largest of these moments.
//!
//! Two constants are measured, not derived: the bookkeeping per tensor (candle's tensor
//! and shape headers and the store's names, about 200 bytes) and the scratch the matrix
//! multiply keeps per compute thread (2 MiB). `tests/estimate.rs` holds the prediction
//! to within 10 % of `switchyard-mem`'s measurement for every rank of many layouts.

use std::collections::BTreeMap;

use switchyard_mem::Category;
use switchyard_models::{plan_stages, Activations, Footprint, Model};
use switchyard_schedule::{simulate, Costs, Op};

use crate::error::{err, TrainError};
use crate::TrainConfig;

/// Bytes of bookkeeping per tensor besides its data (measured).
pub const BYTES_PER_TENSOR: usize = 200;
/// The scratch the matrix multiply keeps per compute thread (measured).
pub const SCRATCH_PER_THREAD: usize = 2 << 20;
/// Bytes per element of parameters, gradients and activations (f32).
const ELEM: usize = 4;
/// Bytes per parameter of AdamW's state (two f64 moments).
const OPT_PER_PARAM: usize = 16;

/// One pipeline rank's predicted peak (every data- and tensor-parallel rank of a
/// pipeline rank holds the same).
#[derive(Debug, Clone, PartialEq)]
pub struct RankEstimate {
    /// The pipeline rank.
    pub pp: usize,
    pub peak_bytes: usize,
    /// Bytes by category at the peak, indexed like [`Category::ALL`].
    pub at_peak: [usize; 6],
    /// Parameter elements the rank holds.
    pub params: usize,
}

impl RankEstimate {
    /// `(category name, bytes)` at the peak, in [`Category::ALL`] order.
    pub fn by_category(&self) -> BTreeMap<String, usize> {
        Category::ALL
            .iter()
            .zip(self.at_peak)
            .map(|(c, b)| (c.name().to_string(), b))
            .collect()
    }

    /// The category holding the most bytes at the peak.
    pub fn dominant(&self) -> Category {
        let i = (0..6).max_by_key(|&i| self.at_peak[i]).unwrap_or(0);
        Category::ALL[i]
    }
}

/// The predicted peak of every pipeline rank of `cfg`, in pipeline order.
pub fn estimate_memory<M: Model>(cfg: &TrainConfig<M>) -> Result<Vec<RankEstimate>, TrainError> {
    let stages = cfg.num_stages();
    let plans = plan_stages(&cfg.model.costs(cfg.seq_len), stages, &cfg.split)?;
    let feet: Vec<Footprint> = plans
        .iter()
        .map(|p| cfg.model.footprint(p, cfg.tp, cfg.seq_len))
        .collect::<Result<_, _>>()?;
    let acts: Vec<&Activations> = feet
        .iter()
        .map(|f| {
            f.activations.as_ref().ok_or_else(|| {
                err!(
                    Config,
                    "cannot predict the memory of a {} model: its Model::footprint does not \
                     describe its activations",
                    M::NAME
                )
            })
        })
        .collect::<Result<_, _>>()?;
    let program = cfg.program()?;
    let tokens = (cfg.microbatch_size() * cfg.seq_len) as f64;
    let threads = match cfg.threads_per_worker {
        0 => switchyard_comm::threads::default_threads_per_worker(cfg.world_size()),
        n => n,
    };
    // When each action runs (unit costs, as the report's prediction), to know how long a
    // gradient a rank sends back waits for the previous stage's backward: until then it
    // is the sender's memory.
    let costs = match program.has_split_backward() {
        true => Costs {
            i: 2.0,
            w: 0.0,
            ..Costs::default()
        },
        false => Costs::default(),
    };
    let timeline = simulate(&program, &costs)?;
    let consumed: BTreeMap<(u32, u32), f64> = timeline
        .ranks
        .iter()
        .flat_map(|r| &r.actions)
        .filter(|t| matches!(t.action.op, Op::B | Op::I))
        .map(|t| ((t.action.stage, t.action.microbatch), t.end))
        .collect();
    let per_stage = |f: &Footprint, a: &Activations| StageBytes {
        grads: ELEM * f.params,
        saved: (ELEM as f64 * (tokens * a.per_token + a.per_microbatch as f64)) as usize
            + BYTES_PER_TENSOR * a.tensors,
        backward: (ELEM as f64 * tokens * a.backward_per_token) as usize,
        input: (ELEM as f64 * tokens * a.input_per_token) as usize,
    };
    let mut out = Vec::with_capacity(cfg.pp);
    for (r, actions) in program.ranks.iter().enumerate() {
        let mine: Vec<usize> = program
            .stages_of_rank(r as u32)
            .into_iter()
            .map(|s| s as usize)
            .collect();
        // Tied parameters: one copy per rank.
        let mut tied: BTreeMap<&str, usize> = BTreeMap::new();
        let (mut params, mut tensors, mut largest, mut cache) = (0, 0, 0, 0);
        for &s in &mine {
            let f = &feet[s];
            params += f.params;
            tensors += f.tensors;
            largest = largest.max(f.largest);
            cache += f.step_cache;
            for (name, n) in &f.tied {
                if tied.insert(name, *n).is_some() {
                    params -= n;
                    tensors -= 1;
                }
            }
        }
        let fixed = Fixed {
            params: ELEM * params + BYTES_PER_TENSOR * tensors,
            optimizer: OPT_PER_PARAM * params + BYTES_PER_TENSOR * tensors,
            other: ELEM * cache + SCRATCH_PER_THREAD * threads.saturating_sub(1),
            scratch: SCRATCH_PER_THREAD,
        };
        let bytes: BTreeMap<usize, StageBytes> = mine
            .iter()
            .map(|&s| (s, per_stage(&feet[s], acts[s])))
            .collect();
        let mut t = Timeline::new(fixed);
        let mut kept: BTreeMap<usize, bool> = mine.iter().map(|&s| (s, false)).collect();
        // Gradients this rank sent back: (bytes, until when the receiver holds them).
        let mut sent: Vec<(usize, f64)> = Vec::new();
        for (a, at) in actions.iter().zip(&timeline.ranks[r].actions) {
            t.in_flight = sent
                .iter()
                .filter(|(_, until)| *until > at.start)
                .map(|(b, _)| b)
                .sum();
            let s = a.stage as usize;
            let (Some(b), Some(k)) = (bytes.get(&s), kept.get_mut(&s)) else {
                continue;
            };
            let sum_copy = if *k { b.grads } else { 0 };
            match a.op {
                Op::F => {
                    t.acts += b.saved;
                    t.observe(0, 0);
                }
                Op::B | Op::I => {
                    t.observe(
                        b.grads + sum_copy * usize::from(a.op == Op::B) + b.backward,
                        0,
                    );
                    t.acts = t.acts.saturating_sub(b.saved);
                    if s > 0 {
                        let until = consumed.get(&(a.stage - 1, a.microbatch)).copied();
                        sent.push((b.input, until.unwrap_or(at.end)));
                    }
                    t.grads += b.grads;
                    if a.op == Op::B && *k {
                        t.grads -= b.grads;
                    }
                    *k |= a.op == Op::B;
                }
                Op::W => {
                    t.observe(sum_copy, 0);
                    if *k {
                        t.grads -= b.grads;
                    }
                    *k = true;
                }
                _ => {}
            }
        }
        // Every parameter has a gradient after the pipeline's step.
        t.grads = ELEM * params;
        t.in_flight = 0;
        let bucket = (cfg.bucket_mib * 1024.0 * 1024.0) as usize;
        let all_reduce = match cfg.dp > 1 {
            true => 3 * bucket.min(ELEM * params),
            false => 0,
        };
        let clip = match cfg.grad_clip > 0.0 {
            true => ELEM * params,
            false => 0,
        };
        t.observe(all_reduce.max(clip), 0);
        t.observe(0, 2 * ELEM * 2 * largest);
        out.push(t.estimate(r, params));
    }
    Ok(out)
}

/// What a backward of one microbatch of a stage adds, in bytes.
struct StageBytes {
    grads: usize,
    saved: usize,
    backward: usize,
    input: usize,
}

/// Bytes held all step long.
#[derive(Clone, Copy)]
struct Fixed {
    params: usize,
    optimizer: usize,
    other: usize,
    /// The rank thread's matrix-multiply scratch (counted with the gradients: the
    /// backward first needs it).
    scratch: usize,
}

struct Timeline {
    fixed: Fixed,
    acts: usize,
    grads: usize,
    /// Sent gradients the receiver still holds.
    in_flight: usize,
    peak: usize,
    at_peak: [usize; 6],
}

impl Timeline {
    fn new(fixed: Fixed) -> Timeline {
        Timeline {
            fixed,
            acts: 0,
            grads: 0,
            in_flight: 0,
            peak: 0,
            at_peak: [0; 6],
        }
    }

    /// A moment holding what is live plus `grads` more gradient bytes and `opt` more
    /// optimizer bytes.
    fn observe(&mut self, grads: usize, opt: usize) {
        let f = self.fixed;
        let now = [
            f.params,
            self.grads + grads + f.scratch + self.in_flight,
            f.optimizer + opt,
            self.acts,
            0,
            f.other,
        ];
        let total = now.iter().sum();
        if total > self.peak {
            self.peak = total;
            self.at_peak = now;
        }
    }

    fn estimate(&self, pp: usize, params: usize) -> RankEstimate {
        RankEstimate {
            pp,
            peak_bytes: self.peak,
            at_peak: self.at_peak,
            params,
        }
    }
}
