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
//! `A_s = 4 · (tokens · (a_s + i_s) + per-microbatch)` bytes (`a_s`: the saved elements
//! per token the model declares; `i_s`: its input's, which the executor copies into a
//! variable of its own to take its gradient, on every stage but the first). A backward holds, on top of everything live, the stage's new
//! parameter gradients `G_s = 4·Ψ_s` (one segment's at a time where the data-parallel
//! all-reduce overlaps the backward, which then runs segment by segment) and the gradients flowing back
//! (`tokens · backward_per_token · 4`); then it frees `A_s`, and adds `G_s` into the
//! gradients kept from earlier microbatches one tensor at a time (the new ones and one
//! sum live at once), or keeps them when they are the first. A split backward's `I`
//! keeps what its `W` reads (`deferred_per_token`; `G_s` when `I` runs it all), and `W`
//! computes `G_s` one op at a time, freeing each op's copies as it goes, and adds `G_s`
//! in. (By segment, last first, an `I` also frees each segment's activations as it makes
//! that segment's copies.) A gradient a rank sends back stays
//! its memory until the previous stage's backward has used it (the in-process transport
//! moves tensors without copying; when is the schedule simulator's). After the last
//! action every parameter has a gradient (`4·Ψ`), and the step adds at most one of: the
//! data-parallel all-reduce of a bucket (the concatenated bucket and the rank's copy of
//! the sum), the clipped copy of every gradient (`4·Ψ`), or AdamW's f64 copies of the
//! largest tensor's gradient (`16·largest`). The peak is the largest of these moments.
//!
//! With ZeRO (`--zero 1|2`, [`crate::zero`]) the optimizer holds `16·⌈Ψ/dp⌉`; after the
//! pipeline the step adds the reduce-scatter (the padded bucket `B_p` and its shard),
//! then keeps the shards `4·⌈Ψ/dp⌉` (stage 1 also the full `4·Ψ`), the clipped copy of
//! the shards, and during the update the parameter shard and the gathered bucket
//! (`4·(B_p/dp + B_p)`, communication buffers).
//!
//! Two things are measured, not derived: the bookkeeping per tensor (candle's tensor and
//! shape headers and the store's names, about 200 bytes) and the packing buffer the
//! matrix multiply keeps per compute thread (the L2 cache's size, once products reach
//! 128 rows or columns). `tests/estimate.rs` holds the prediction
//! to within 10 % of `switchyard-mem`'s measurement for every rank of many layouts.

use std::collections::BTreeMap;

use switchyard_mem::Category;
use switchyard_models::{plan_stages, Activations, Footprint, Model};
use switchyard_schedule::{simulate, Costs, Op};

use crate::error::{err, TrainError};
use crate::{Recompute, TrainConfig};

/// Bytes of bookkeeping per tensor besides its data (measured).
pub const BYTES_PER_TENSOR: usize = 200;

/// The buffer the matrix-multiply library (`gemm`, under candle and the fused ops) keeps
/// on each thread that packed a product through it: the size of the CPU's L2 cache
/// (read from Linux's `/sys`; 2 MiB elsewhere).
pub fn scratch_per_thread() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/cpu0/cache/index2/size")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            let (n, scale) = match s.strip_suffix('K') {
                Some(n) => (n, 1024),
                None => match s.strip_suffix('M') {
                    Some(n) => (n, 1 << 20),
                    None => (s, 1),
                },
            };
            n.parse::<usize>().ok().map(|n| n * scale)
        })
        .filter(|&b| b > 0)
        .unwrap_or(2 << 20)
}

/// Whether products of `tokens` rows and `width` columns go through that buffer when
/// candle computes them (the composed ops): measured with `gemm` 0.19 (smaller ones are
/// packed in a buffer of their own size).
fn packs_through_scratch(tokens: usize, width: usize) -> bool {
    tokens >= 128 || width >= 128
}

/// Whether a stage's products give its rank's thread, and the other threads of its
/// compute pool, the matrix multiply's packing buffer: `(rank thread, pool threads)`.
/// The fused ops send small products to a kernel without one, and split only large ones
/// over the pool (`switchyard_ops::product_path`).
fn scratch_threads(a: &Activations, tokens: usize, width: usize) -> (bool, bool) {
    match a.fused_products {
        // bf16 products on a native kernel pack into buffers of their own.
        true if a.bf16_products && switchyard_ops::Bf16Kernel::best().is_native() => (false, false),
        true => switchyard_ops::product_path(tokens * a.largest_product),
        false => {
            let packs = packs_through_scratch(tokens, width);
            (packs, packs)
        }
    }
}
/// Bytes per element of parameters, gradients and activations (f32).
const ELEM: usize = 4;
/// Bytes per parameter of AdamW's state (two f64 moments).
pub(super) const OPT_PER_PARAM: usize = 16;

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
        .map(|p| {
            let sp = cfg.splits_sequence();
            cfg.model.footprint(p, cfg.tp, cfg.seq_len, sp)
        })
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
    let width = cfg.model.width().unwrap_or(0);
    let rows = cfg.microbatch_size() * cfg.seq_len;
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
    let bytes = |elems: f64| (ELEM as f64 * elems) as usize;
    // A stage before the last injects the gradient it receives, `g`, by back-propagating
    // `Σ out ⊙ g`: the product, the output's gradient and a contiguous copy of it, each
    // the size of the output (the next stage's input).
    let injected = |s: usize| {
        acts.get(s + 1)
            .map_or(0.0, |next| 3.0 * next.input_per_token)
    };
    // `--ep N`: a rank holds `1/N` of the experts.
    let ep = cfg.ep.max(1);
    let per_stage = |s: usize| {
        let (f, a): (&Footprint, &Activations) = (&feet[s], acts[s]);
        let (saved, backward) = match cfg.recompute {
            // The executor keeps a stage's input as a variable of its own (a copy) to
            // take its gradient.
            Recompute::None | Recompute::Selective => {
                let kept = match cfg.recompute {
                    Recompute::Selective => a.per_token - a.selective_per_token,
                    _ => a.per_token,
                };
                // ZeRO 2 and 3, and the overlapped all-reduce, run the stage segment by
                // segment: each segment after the first keeps its input as a variable of
                // its own too.
                let boundaries = match cfg.zero >= 2 || cfg.overlaps_grad_reduce() {
                    true => (a.segments - 1) as f64 * a.segment_input_per_token,
                    false => 0.0,
                };
                (
                    bytes(
                        tokens * (kept + a.input_per_token + boundaries) + a.per_microbatch as f64,
                    ) + BYTES_PER_TENSOR * a.tensors,
                    bytes(tokens * a.backward_per_token),
                )
            }
            // Each segment's input (token ids count as one element); the backward runs
            // one segment again at a time, with a copy of its input as a variable.
            Recompute::Full => {
                let first = a.input_per_token.max(1.0);
                let rest = (a.segments - 1) as f64 * a.segment_input_per_token;
                let one = a.per_microbatch as f64 / a.segments as f64;
                (
                    bytes(tokens * (first + rest)) + BYTES_PER_TENSOR * a.segments,
                    bytes(
                        tokens
                            * (a.segment_per_token
                                + a.segment_input_per_token
                                + a.backward_per_token)
                            + one,
                    ) + BYTES_PER_TENSOR * a.tensors.div_ceil(a.segments),
                )
            }
        };
        StageBytes {
            grads: ELEM * (f.params - f.experts + f.experts / ep),
            deferred: bytes(tokens * a.deferred_per_token),
            saved,
            backward: backward
                + bytes(tokens * injected(s))
                + ELEM * a.backward_scratch_per_thread * threads,
            largest: ELEM * f.largest,
            input: bytes(tokens * a.input_per_token),
            segments: a.segments.max(1),
        }
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
        // ZeRO 2 and 3: the largest segment's parameters, and those that stay whole
        // (several segments', or summed with copies on other ranks).
        let (mut segment, mut resident, mut blocks) = (0, 0, 0);
        // `--ep`: the experts this rank holds, which ZeRO keeps whole and resident.
        let mut whole = 0;
        for &s in &mine {
            let f = &feet[s];
            params += f.params - f.experts + f.experts / ep;
            tensors += f.tensors - f.expert_tensors + f.expert_tensors / ep;
            largest = largest.max(f.largest);
            cache += f.step_cache - f.expert_cache + f.expert_cache / ep;
            let held = match ep {
                1 => 0,
                _ => f.experts / ep,
            };
            segment = segment.max(match ep {
                1 => f.largest_segment,
                _ => f.largest_segment_without_experts,
            });
            whole += held;
            resident += f.shared + held;
            blocks += acts[s].segments;
            for (name, n) in &f.tied {
                match tied.insert(name, *n).is_some() {
                    true => {
                        params -= n;
                        tensors -= 1;
                    }
                    false => resident += n,
                }
            }
        }
        // ZeRO keeps the moments of 1/dp of every bucket (one vector per bucket instead
        // of one per tensor).
        let sharded = (params - whole).div_ceil(cfg.dp) + whole;
        let optimizer = match cfg.zero {
            0 => OPT_PER_PARAM * params + BYTES_PER_TENSOR * tensors,
            _ => OPT_PER_PARAM * sharded,
        };
        let shards = ELEM * sharded;
        let segmented = cfg.zero >= 2;
        // With the overlapped all-reduce (`overlap_grad_reduce`, no ZeRO) a backward runs
        // segment by segment too, and hands each segment's new gradients to the sums.
        let by_segment = cfg.overlaps_grad_reduce();
        let zero3 = cfg.zero == 3;
        let (on_rank, on_pool) = mine
            .iter()
            .map(|&s| scratch_threads(acts[s], rows, width))
            .fold((false, false), |x, y| (x.0 || y.0, x.1 || y.1));
        let scratch = |on: bool| if on { scratch_per_thread() } else { 0 };
        // ZeRO 3 holds the shards and the resident parameters; one segment's parameters
        // and fused weights are gathered at a time (`gathered`, during compute), and
        // with prefetching the next one's gathered bucket.
        let fixed = Fixed {
            params: match zero3 {
                true => shards + ELEM * resident + BYTES_PER_TENSOR * tensors,
                false => ELEM * params + BYTES_PER_TENSOR * tensors,
            },
            optimizer,
            other: match zero3 {
                true => 0,
                false => ELEM * cache,
            } + scratch(on_pool) * threads.saturating_sub(1),
            scratch: scratch(on_rank),
        };
        // With prefetching, the next segment's gathered bucket (`comm`) is in flight
        // while one computes. This replica's shard of it, which the thread sends, lives
        // only until the gather is done, and is not counted (at 1/dp of a segment).
        let prefetched = match cfg.zero_prefetch {
            true => ELEM * segment,
            false => 0,
        };
        let gathered = match zero3 {
            true => [
                ELEM * segment,
                0,
                0,
                0,
                prefetched,
                ELEM * cache / blocks.max(1),
            ],
            false => [0; 6],
        };
        let bytes: BTreeMap<usize, StageBytes> = mine.iter().map(|&s| (s, per_stage(s))).collect();
        let mut t = Timeline::new(fixed);
        t.extra = gathered;
        let mut kept: BTreeMap<usize, bool> = mine.iter().map(|&s| (s, false)).collect();
        // Gradients this rank sent back: (bytes, until when the receiver holds them).
        let mut sent: Vec<(usize, f64)> = Vec::new();
        for (a, at) in actions.iter().zip(&timeline.ranks[r].actions) {
            // The rank's actions start in order: a gradient used by then stays used.
            sent.retain(|(_, until)| *until > at.start);
            t.in_flight = sent.iter().map(|(b, _)| b).sum();
            let s = a.stage as usize;
            let (Some(b), Some(k)) = (bytes.get(&s), kept.get_mut(&s)) else {
                continue;
            };
            match a.op {
                Op::F => {
                    t.acts += b.saved;
                    t.observe(0, 0);
                }
                Op::B | Op::I if segmented => {
                    // Segment by segment: one segment's new gradients and what flows
                    // back; as its backward ends, the bucket they are flattened into.
                    // On the reduce-scatter thread (`overlap_grad_reduce`) the bucket
                    // before is in flight while a segment computes instead, and the
                    // shard it returns waits for the rank.
                    let returned = match cfg.overlaps_reduce_scatter() {
                        true => ELEM * segment.div_ceil(cfg.dp),
                        false => 0,
                    };
                    t.comm = ELEM * segment;
                    t.observe(ELEM * segment + b.backward + returned, 0);
                    t.comm = 0;
                    t.acts = t.acts.saturating_sub(b.saved);
                    if s > 0 {
                        let until = consumed.get(&(a.stage - 1, a.microbatch)).copied();
                        sent.push((b.input, until.unwrap_or(at.end)));
                    }
                    // The shards from the first reduce-scatter on, and the resident
                    // parameters' full gradients; a split backward's wait for `W`.
                    t.grads = t.grads.max(shards + ELEM * resident);
                    if a.op == Op::I {
                        t.grads += b.pending();
                    }
                }
                Op::W if segmented => {
                    t.comm = ELEM * segment;
                    t.observe(b.computed_at_w(), 0);
                    t.comm = 0;
                    t.grads = t.grads.saturating_sub(b.pending());
                }
                Op::B | Op::I => {
                    // The backward: its activations, the new gradients (a split one's
                    // copies for `W` instead; one segment's at a time when the backward
                    // runs by segment), what flows back.
                    let new = match a.op {
                        Op::I => b.pending(),
                        _ if by_segment => b.grads.min(ELEM * segment),
                        _ => b.grads,
                    };
                    if a.op == Op::I && by_segment {
                        // By segment, the last first: each segment's graph goes as its
                        // copies for `W` are made, so what is held moves linearly from
                        // one segment's copies beside every activation to all of them
                        // beside the first segment's.
                        let n = b.segments;
                        t.observe(new / n + b.backward, 0);
                        let before = t.acts;
                        t.acts = before.saturating_sub(b.saved / n * (n - 1));
                        t.observe(new + b.backward, 0);
                        t.acts = before;
                    } else {
                        t.observe(new + b.backward, 0);
                    }
                    t.acts = t.acts.saturating_sub(b.saved);
                    if s > 0 {
                        let until = consumed.get(&(a.stage - 1, a.microbatch)).copied();
                        sent.push((b.input, until.unwrap_or(at.end)));
                    }
                    match (a.op, *k) {
                        // Added into the kept sum one tensor at a time.
                        (Op::B, true) => t.observe(new + b.largest, 0),
                        (Op::B, false) => t.grads += b.grads,
                        // A split backward's wait for `W`: the gradients, or the copies
                        // the deferred weight products read.
                        _ => t.grads += b.pending(),
                    }
                    *k |= a.op == Op::B;
                }
                Op::W => {
                    match (b.deferred, *k) {
                        // `I` ran the whole backward: its gradients go into the sum.
                        (0, true) => {
                            t.observe(b.largest, 0);
                            t.grads -= b.grads;
                        }
                        (0, false) => {}
                        // The deferred products' gradients beside the copies they read;
                        // the copies go, the gradients into the sum (or are kept).
                        // The deferred jobs run one op at a time, each freeing its
                        // copies as its gradients come: the copies and at most about a
                        // segment's gradients, never both whole.
                        (d, kept) => {
                            t.observe(b.grads.min(ELEM * segment), 0);
                            t.grads -= d;
                            match kept {
                                true => t.observe(b.grads + b.largest, 0),
                                false => t.grads += b.grads,
                            }
                        }
                    }
                    *k = true;
                }
                _ => {}
            }
        }
        // Every parameter has a gradient after the pipeline's step (under ZeRO 2 and 3
        // a shard, and the resident parameters' whole ones).
        t.grads = if segmented {
            shards + ELEM * resident
        } else {
            ELEM * params
        };
        t.in_flight = 0;
        t.extra = [0; 6]; // Between the pipeline and the update nothing is gathered.
        let bucket = (cfg.bucket_mib * 1024.0 * 1024.0) as usize;
        let clips = cfg.grad_clip > 0.0;
        match cfg.zero {
            0 => {
                // A bucket flattened and its sum (overlapped: a block's, or the resident
                // parameters' after the pipeline).
                let all_reduce = match (cfg.dp > 1, cfg.overlaps_grad_reduce()) {
                    (false, _) => 0,
                    (true, true) => (2 * bucket.min(ELEM * resident)).max(2 * ELEM * segment),
                    (true, false) => 2 * bucket.min(ELEM * params),
                };
                t.observe(all_reduce.max(if clips { ELEM * params } else { 0 }), 0);
                t.observe(0, 2 * ELEM * 2 * largest);
            }
            zero => {
                // The largest bucket stage 1 reduce-scatters now (a tensor larger than a
                // bucket is one alone; stages 2 and 3: the resident parameters'),
                // padded to a multiple of dp, and one replica's shard of it.
                let dp = cfg.dp;
                let now = match segmented {
                    true => resident.min(bucket / ELEM),
                    false => (bucket / ELEM).max(largest).min(params),
                };
                let b = now.div_ceil(dp) * dp;
                let shard = b / dp;
                // The reduce-scatter: the concatenated bucket and the shard it returns.
                t.observe(ELEM * (b + shard), 0);
                // Stage 1 keeps the full gradients to the step's end; 2 and 3 the shards.
                t.grads = shards + if zero == 1 { ELEM * params } else { 0 };
                // The clipped copy of the shards.
                t.observe(if clips { shards } else { 0 }, 0);
                // AdamW on a bucket's shard updates its parameters in a buffer the
                // all-gather then sends; the gathered bucket (communication buffers).
                // Stage 3 updates its shards in place and gathers at the next use.
                let gathered = match segmented {
                    true => segment.max(resident.min(bucket / ELEM)).div_ceil(dp) * dp,
                    false => b,
                };
                t.comm = match zero3 {
                    true => 0,
                    false => ELEM * (gathered / dp + gathered),
                };
                t.observe(0, 0);
                t.comm = 0;
            }
        }
        out.push(t.estimate(r, params));
    }
    Ok(out)
}

mod timeline;
use timeline::{Fixed, StageBytes, Timeline};

#[cfg(test)]
mod tests;
