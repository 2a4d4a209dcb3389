//! Step time, predicted (issue 15 §3): the wall time of one training step of a
//! [`TrainConfig`], from the model's FLOPs, this machine's measured rates
//! ([`TimeModel::calibrate`]) and the schedule's simulator, without running the step.
//!
//! ## The formulas
//!
//! Notation: `T` the sequence length, `b = batch / (dp · m)` sequences per microbatch,
//! `n = b · T` tokens per microbatch, `m` microbatches, `w` the model's width
//! ([`Model::width`]; 0 when unknown), `c_e`, `c_ℓ`, `c_h` the training FLOPs per token of
//! the embeddings, of layer `ℓ` and of the head ([`Model::costs`]; for the GPT,
//! `6 · 12 · d² + 12 · T · d` a block), `t` the compute threads of a worker.
//!
//! * **A part's time.** A part is a layer, the embeddings or the head. `S₁(x)` is the
//!   measured time of one part of `x` training FLOPs (one microbatch, forward and
//!   backward) on one thread, one curve per model width (the efficiency of a product
//!   depends on its width as much as on its length): linear interpolation between a few
//!   calibrated sizes; below the smallest, the line through the two smallest (`o =
//!   S₁(0)`, the fixed overhead of a part: kernel launches, graph bookkeeping, what keeps
//!   small layers from their FLOP rate); above the largest, in proportion to `x` (at the
//!   largest's rate `r = x_n / S₁(x_n)`: a marginal slope extrapolates badly). A worker
//!   of `t` threads takes `S_t(x) = S₁(x) / (1 + e(x) · (t − 1))`, `e(x)` the measured
//!   gain of a second thread at that size (small parts do not split), interpolated the
//!   same way. When other workers compute on the machine's other cores at the same
//!   time, a part is slower by `c(x) ≥ 1`, measured with two workers computing at once
//!   (shared caches and memory bandwidth, the allocator). Between the calibrated
//!   widths, `S_t` is interpolated linearly in `log w`; outside them, the nearest
//!   width's curve is used.
//! * **Shared cores.** A calibrated model knows the machine's `c` cores
//!   ([`TimeModel::cores`]). When its `W` workers of `t` threads run more threads than
//!   that, they take turns: every part takes `W · t / c` times as long (an upper bound:
//!   it assumes every worker computes at once, which a pipeline's bubble does not), and
//!   the optimizer, on one thread a worker, `W / c` (so that `plan` never promises more
//!   FLOP/s than the cores have).
//! * **Stage `s`**, one microbatch, forward and backward together, on each of the `tp`
//!   ranks: `C_s = k_s · S_t(n · F_s / (tp · k_s))`, `F_s = Σ_{ℓ∈s} c_ℓ + [first] c_e +
//!   [last] c_h` and `k_s` the parts the stage runs (its parts taken at their mean size,
//!   as the calibration measures them). Forward takes `φ · C_s`, backward `(1 − φ) · C_s`
//!   (`φ` measured, about 1/3); a split backward's `I` and `W` half each.
//! * **Tensor parallelism** (Megatron): each layer all-reduces its `n · w · 4`-byte output
//!   twice in the forward (attention, MLP) and its input gradient twice in the backward;
//!   the embeddings once in the forward, the head's input gradient once in the backward
//!   and the parallel cross-entropy twice (max and sum, `n · 4` bytes) in the forward.
//!   An all-reduce of `x` bytes over `k` ranks takes
//!   `A_k(x) = (k − 1) · α_c + 2 · (k − 1)/k · x / β_c` (a ring's latency and volume;
//!   `α_c`, `β_c` measured on 2 ranks, where it is `α_c + x / β_c`, with one rank
//!   arriving late, as in training, so that `α` includes waking the waiting one). These terms are added
//!   to the stage's forward and backward times.
//! * **ZeRO 2 and 3**: a stage's backward of each microbatch reduce-scatters its
//!   `4 · N_s` bytes of gradients (`N_s` the stage's share of the parameters), one piece
//!   per segment, `R(x) = g · (k − 1) · α + (k − 1)/k · x / β` for `g` pieces over `k`
//!   replicas (half an all-reduce); stage 3 also all-gathers the parameters before each
//!   forward and each backward, `R` again. Prefetched (`zero_prefetch`, the default),
//!   each segment's gather runs on a communication thread while the segment before it
//!   computes, so only `max(0, R − compute)` of the forward's and of the backward's
//!   shows (the step's first gather is not counted). After the pipeline, stage 2
//!   all-gathers the updated parameters (`R` in buckets) instead of the all-reduce;
//!   stage 3 nothing.
//! * **Expert parallelism** (`--ep e`): each mixture of experts exchanges its tokens'
//!   `x = n · k · d · 4` bytes ([`Model::expert_exchange`]) with the other replicas of
//!   its group: in the forward three all-to-alls (the counts, the tokens to their
//!   experts, the outputs back), in the backward two, each taking `(e − 1) · α` and
//!   moving `(e − 1)/e` of its bytes at `β` (the data-parallel link): forward
//!   `3 · (e − 1) · α + 2 · (e − 1)/e · x / β`, backward `2 · (e − 1) · α` plus the same.
//!   Routing and the experts' compute are in the layer's FLOPs and unchanged by `e`.
//!   A rank holds `1/e` of its mixtures' experts ([`Model::expert_params`], placed by
//!   where the mixtures are): the data-parallel all-reduce (or ZeRO's collectives)
//!   carries the other parameters, and the experts' gradients are all-reduced after the
//!   pipeline over the `dp / e` replicas that hold the same experts.
//! * **Pipeline messages**: every send and every receive of the lowered program takes
//!   `P(n · w · 4) / 2`, `P(x) = α_p + x / β_p` the measured one-way time of a message
//!   (a send and its receive together).
//! * **The pipeline**: [`simulate_by_stage`] runs the program with these per-stage costs;
//!   its makespan `M` contains the compute, the tensor-parallel all-reduces, the messages
//!   and the bubble (the idle fraction it reports).
//! * **After the pipeline**, on the slowest rank: the data-parallel gradient all-reduce in
//!   `⌈4 · N_r / bucket⌉` buckets, `Σ A_dp(bucket)` (with `overlap_grad_reduce`, the
//!   default, only what the backward does not hide: the rank's `L_r` blocks are a bucket
//!   each, all-reduced during the last microbatch's backward `B_r`, so
//!   `A_dp(x) + max(0, (L_r − 1) · A_dp(x) − (L_r − 1)/L_r · B_r)` with `x` a block's
//!   bytes, plus the tied parameters' `Σ A_dp(bucket)` after it); the optimizer (AdamW, the gradient
//!   norm and the clipping), `N_r · a + K_r · a_t` with `a` measured per parameter and
//!   `a_t` per parameter tensor; and the world's all-gather of the losses, one `α_c`.
//!   `N_r` and `K_r`, a rank's parameters and parameter tensors, are the model's
//!   ([`Model::param_shapes`]) times the rank's share of the model's FLOPs, over `tp`
//!   for `N_r` (every tensor-parallel rank holds a shard of every tensor).
//!
//! Step time `= M + max_r (A_dp + N_r · a + K_r · a_t) + o_step + [workers > 1] ·
//! (α_c + o_world)` (`A_dp = 0` without data parallelism), `o_step` and `o_world` the
//! fixed costs of a step on one worker and on several, measured by training a model of
//! almost no FLOPs (what the rest of this model predicts for it taken off): tens to
//! hundreds of microseconds, which matter only to steps of a few milliseconds.
//!
//! A model whose [`Model::costs`] are relative weights rather than FLOPs (the trait's
//! default) gets times in those units divided by the rate: meaningless. The GPT's are
//! FLOPs.

use serde::{Deserialize, Serialize};
use switchyard_comm::threads;
use switchyard_models::{plan_stages, Model, StagePlan};
use switchyard_schedule::{simulate_by_stage, Costs};

use crate::error::{err, TrainError};
use crate::{Recompute, TrainConfig};

mod model;
pub use model::{AlphaBeta, PartCurve, TimeModel};

/// A predicted step, in seconds, with where the time goes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StepTime {
    /// The whole step.
    pub seconds: f64,
    /// The pipeline's makespan (compute, tensor-parallel all-reduces, messages, bubble).
    pub pipeline_s: f64,
    /// Compute of the busiest pipeline rank (forward and backward of its stages).
    pub compute_s: f64,
    /// That rank's tensor-parallel all-reduces.
    pub tp_comm_s: f64,
    /// That rank's expert-parallel all-to-alls (`--ep`).
    #[serde(default)]
    pub ep_comm_s: f64,
    /// That rank's pipeline sends and receives.
    pub p2p_s: f64,
    /// The data-parallel gradient all-reduce (slowest rank).
    pub dp_allreduce_s: f64,
    /// Gradient norm, clipping and AdamW (slowest rank).
    pub optimizer_s: f64,
    /// The simulated pipeline's idle fraction over all its ranks.
    pub bubble_fraction: f64,
    /// The step's fixed cost, `o_step` and, with several workers, `o_world`.
    #[serde(default)]
    pub overhead_s: f64,
}

/// Predicts the wall time of one training step of `cfg` on a machine with rates `tm`
/// (see the module docs for the formulas).
pub fn predict_step_time<M: Model>(
    cfg: &TrainConfig<M>,
    tm: &TimeModel,
) -> Result<StepTime, TrainError> {
    let m = &cfg.model;
    m.validate()?;
    m.check_layout(cfg.tp, cfg.seq_len)?;
    cfg.mesh().validate()?;
    let split = cfg.dp.checked_mul(cfg.microbatches).unwrap_or(0);
    if split == 0 || cfg.batch == 0 || !cfg.batch.is_multiple_of(split) {
        return Err(err!(
            Config,
            "--batch {} does not split into --dp {} × --microbatches {} (each at least 1): \
             no step to predict",
            cfg.batch,
            cfg.dp,
            cfg.microbatches
        ));
    }
    let program = cfg.program()?;
    let costs = m.costs(cfg.seq_len);
    let plans = plan_stages(&costs, program.num_stages as usize, &cfg.split)?;
    let threads = match cfg.threads_per_worker {
        0 => threads::default_threads_per_worker(cfg.world_size()),
        t => t,
    };
    let tokens = (cfg.microbatch_size() * cfg.seq_len) as f64;
    let shared = cfg.world_size() > 1;
    // More threads than the cores they share take turns: the compute threads (every
    // worker's at once, an upper bound when a bubble idles some), and the workers' own
    // threads for the optimizer, which runs on one.
    let over = |threads: usize| {
        tm.cores
            .map_or(1.0, |c| {
                (cfg.world_size() * threads) as f64 / c.max(1) as f64
            })
            .max(1.0)
    };
    let (turns, optimizer_turns) = (over(threads), over(1));
    let activation = tokens * m.width().unwrap_or(0) as f64 * 4.0;
    let all_reduce = |bytes: f64| tm.collective.all_reduce(bytes, cfg.tp);
    let width = m.width().unwrap_or(0) as f64 * 4.0;
    let sequence_parallel = cfg.splits_sequence();
    // A split backward (`I` and `W`): its segments' gradients are final at `W`.
    let split_backward = program
        .ranks
        .iter()
        .flatten()
        .any(|a| a.op == switchyard_schedule::Op::W);
    let flops = |p: &StagePlan| stage_flops(&costs, p);
    let total_flops = costs.embed + costs.blocks.iter().sum::<f64>() + costs.head;
    let shapes = m.param_shapes()?;
    let tensors = shapes.len() as f64;
    let params = shapes
        .iter()
        .map(|(_, s)| s.iter().product::<usize>() as f64)
        .sum::<f64>();
    // The tied parameters (a token table shared with the head, on one stage or two) are
    // all-reduced after the backward even with `overlap_grad_reduce`, whole on each rank
    // that holds a copy.
    let tied_names: Vec<String> = m
        .tied(cfg.num_stages().max(2))
        .into_iter()
        .map(|t| t.name)
        .collect();
    let tied_params = shapes
        .iter()
        .filter(|(n, _)| tied_names.contains(n))
        .map(|(_, s)| s.iter().product::<usize>() as f64)
        .sum::<f64>()
        / cfg.tp as f64;
    // ZeRO's collectives over the data-parallel replicas: a reduce-scatter or an
    // all-gather of `bytes` in `calls` pieces is half a ring all-reduce, each piece
    // paying the latency.
    // Expert parallelism: the experts' parameters, spread over `ep` replicas and summed
    // over the `dp / ep` that hold the same ones; ZeRO keeps them whole and resident
    // (none of its collectives carries them).
    let (ep, expert_params) = (cfg.ep.max(1), m.expert_params() as f64);
    let sharded = match ep {
        1 => params,
        _ => params - expert_params,
    };
    let dp_link = tm.dp_collective.unwrap_or(tm.collective);
    let half = |bytes: f64, calls: f64| {
        let latency = dp_link.all_reduce(0.0, cfg.dp);
        calls * latency + (dp_link.all_reduce(bytes, cfg.dp) - latency) / 2.0
    };
    // ZeRO 2 and 3 reduce-scatter every segment's gradients as its backward of each
    // microbatch ends; stage 3 also gathers a segment's parameters before its forward
    // and before its backward.
    // Returns (forward's gathers, backward's gathers, backward's reduce-scatters).
    let zero_comm = |p: &StagePlan| {
        let bytes = 4.0 * sharded * flops(p) / total_flops.max(f64::MIN_POSITIVE) / cfg.tp as f64;
        let segments = p.blocks.len().max(1) as f64;
        let one = half(bytes, segments);
        match cfg.zero {
            2 => (0.0, 0.0, one),
            3 => (one, one, one),
            _ => (0.0, 0.0, 0.0),
        }
    };
    // Expert parallelism: each mixture's all-to-alls over `ep` replicas, one microbatch:
    // (forward, backward).
    let exchange = m.expert_exchange();
    let expert_comm = |p: &StagePlan| {
        let ep = cfg.ep.max(1) as f64;
        let per_token: Vec<usize> = p
            .blocks
            .clone()
            .filter_map(|i| exchange.get(i).copied())
            .filter(|&x| x > 0)
            .collect();
        if ep <= 1.0 || per_token.is_empty() {
            return (0.0, 0.0);
        }
        let (mixtures, bytes) = (
            per_token.len() as f64,
            tokens * 4.0 * per_token.iter().sum::<usize>() as f64,
        );
        let (alpha, volume) = (
            (ep - 1.0) * dp_link.alpha_s,
            2.0 * (ep - 1.0) / ep * bytes / dp_link.bytes_per_s,
        );
        (
            3.0 * mixtures * alpha + volume,
            2.0 * mixtures * alpha + volume,
        )
    };
    let phi = tm.forward_fraction;
    let parts =
        |p: &StagePlan| (p.blocks.len() + usize::from(p.embed) + usize::from(p.head)) as f64;
    // Per stage: (compute, tp forward, tp backward) of one microbatch.
    let a2a: Vec<(f64, f64)> = plans.iter().map(expert_comm).collect();
    let stages: Vec<(f64, f64, f64)> = plans
        .iter()
        .zip(&a2a)
        .map(|(p, &(f_a2a, b_a2a))| {
            let k = parts(p);
            let x = tokens * flops(p) / (cfg.tp as f64 * k);
            let compute = turns * k * tm.part_seconds(m.width(), x, threads, shared);
            let layers = p.blocks.len() as f64;
            let mut fwd = 2.0 * layers * all_reduce(activation);
            // Sequence parallelism: an all-gather and a reduce-scatter move an
            // all-reduce's bytes; the backward also gathers the two freed inputs again
            // (half an all-reduce each) and sums six replicated parameters' gradients.
            let mut bwd = match sequence_parallel {
                true => 3.0 * layers * all_reduce(activation) + 6.0 * layers * all_reduce(width),
                false => fwd,
            };
            if p.embed {
                fwd += all_reduce(activation);
            }
            if p.head {
                fwd += 2.0 * all_reduce(tokens * 4.0);
                bwd += all_reduce(activation);
            }
            fwd += f_a2a;
            bwd += b_a2a;
            let (mut gf, gb, sb) = zero_comm(p);
            // What runs on communication threads during the backward hides behind the
            // same backward, once: ZeRO 3's prefetched gathers, and the reduce-scatters
            // on their thread (each segment's while the segment before computes; at
            // least the last segment's shows). A split backward hands its segments over
            // at `W`, back to back: its reduce-scatters hide behind nothing.
            let segments = p.blocks.len().max(1) as f64;
            let again = if cfg.recompute == Recompute::Full {
                phi
            } else {
                0.0
            };
            let window = (1.0 - phi + again) * compute;
            let scatter_thread = cfg.overlaps_reduce_scatter() && !split_backward;
            let last = sb / segments;
            let (hidden, shown) = match (cfg.zero_prefetch, scatter_thread) {
                (true, true) => (gb + sb - last, last),
                (true, false) => (gb, sb),
                (false, true) => (sb - last, gb + last),
                (false, false) => (0.0, gb + sb),
            };
            let backward_comm = (hidden - window).max(0.0) + shown;
            if cfg.zero_prefetch {
                gf = (gf - phi * compute).max(0.0);
            }
            (compute, fwd + gf, bwd + backward_comm)
        })
        .collect();
    let comm = if program.num_ranks() > 1 {
        // Under sequence parallelism a stage sends its rank's positions only.
        let split = if sequence_parallel {
            cfg.tp as f64
        } else {
            1.0
        };
        tm.p2p.time(activation / split) / 2.0
    } else {
        0.0
    };
    let stage_costs: Vec<Costs> = stages
        .iter()
        .map(|&(c, f, b)| {
            let mut backward = (1.0 - phi) * c + b;
            // Full recomputation runs the forward (with its collectives) again first.
            if cfg.recompute == Recompute::Full {
                backward += phi * c + f;
            }
            Costs {
                f: phi * c + f,
                b: backward,
                i: backward / 2.0,
                w: backward / 2.0,
                comm,
            }
        })
        .collect();
    let timeline = simulate_by_stage(&program, &stage_costs)?;
    // Per pipeline rank: compute, tp all-reduces, parameters.
    let mb = cfg.microbatches as f64;
    let mixtures = exchange.iter().filter(|&&x| x > 0).count() as f64;
    let ranks: Vec<(f64, f64, f64, f64, f64)> = (0..program.num_ranks() as u32)
        .map(|r| {
            let mine = program.stages_of_rank(r);
            let sum = |f: &dyn Fn(usize) -> f64| mine.iter().map(|&s| f(s as usize)).sum::<f64>();
            let share = sum(&|s| flops(&plans[s])) / total_flops.max(f64::MIN_POSITIVE);
            // Full recomputation: each stage's forward (and its collectives) once more.
            let again = if cfg.recompute == Recompute::Full {
                1.0
            } else {
                0.0
            };
            // The experts by where their mixtures are (a replica holds `1/ep` of
            // them), the rest by the rank's share of the FLOPs.
            let mixtures_here = sum(&|s| {
                plans[s]
                    .blocks
                    .clone()
                    .filter(|&i| exchange.get(i).is_some_and(|&x| x > 0))
                    .count() as f64
            });
            // (A model that does not say where its mixtures are: by the FLOPs too.)
            let experts = match mixtures > 0.0 {
                true => expert_params * mixtures_here / mixtures / cfg.tp as f64,
                false => expert_params * share / cfg.tp as f64,
            };
            let dense = (params - expert_params) * share / cfg.tp as f64;
            // Without expert parallelism they are summed with the rest.
            let (n, apart) = match ep {
                1 => (dense + experts, 0.0),
                _ => (dense, experts / ep as f64),
            };
            (
                mb * sum(&|s| stages[s].0 * (1.0 + again * phi)),
                mb * sum(&|s| stages[s].1 * (1.0 + again) + stages[s].2),
                n,
                tensors * share,
                apart,
            )
        })
        .collect();
    // Per pipeline rank, for `overlap_grad_reduce`: its transformer blocks (one bucket
    // each) and the backward of its last microbatch, behind which their all-reduces hide.
    let overlap: Vec<(f64, f64, bool)> = (0..program.num_ranks() as u32)
        .map(|r| {
            let mine = program.stages_of_rank(r);
            let blocks = mine
                .iter()
                .map(|&s| plans[s as usize].blocks.len())
                .sum::<usize>();
            let window = mine.iter().map(|&s| stage_costs[s as usize].b).sum::<f64>();
            let tied = mine
                .iter()
                .any(|&s| plans[s as usize].embed || plans[s as usize].head);
            (blocks.max(1) as f64, window, tied)
        })
        .collect();
    let busiest = (0..ranks.len())
        .max_by(|&a, &b| timeline.ranks[a].busy.total_cmp(&timeline.ranks[b].busy))
        .unwrap_or(0);
    let bucket = (cfg.bucket_mib * 1024.0 * 1024.0).max(4.0);
    let after = |n: f64, k: f64, experts: f64, (blocks, window, tied): (f64, f64, bool)| {
        let bytes = 4.0 * n;
        // Each bucket pays the latency; together they move the bytes once. ZeRO 2
        // all-gathers the updated parameters after the pipeline (its reduce-scatters ran
        // inside it), stage 3 nothing.
        let latency = dp_link.all_reduce(0.0, cfg.dp);
        let buckets = |bytes: f64| (bytes / bucket).ceil().max(1.0);
        let after_backward =
            |bytes: f64| buckets(bytes) * latency + (dp_link.all_reduce(bytes, cfg.dp) - latency);
        let dp = match cfg.zero {
            // One bucket per block during the last microbatch's backward: what the rest
            // of that backward does not cover shows, and the first block's (final last)
            // and the tied parameters' all-reduces show whole.
            0 if cfg.overlaps_grad_reduce() => {
                let resident = match tied {
                    true => (4.0 * tied_params).min(bytes),
                    false => 0.0,
                };
                let block = dp_link.all_reduce((bytes - resident) / blocks, cfg.dp);
                let hidden = (blocks - 1.0) / blocks * window;
                let late = ((blocks - 1.0) * block - hidden).max(0.0);
                block
                    + late
                    + if resident > 0.0 {
                        after_backward(resident)
                    } else {
                        0.0
                    }
            }
            0 | 1 => after_backward(bytes),
            2 => half(bytes, buckets(bytes)),
            _ => 0.0,
        };
        // The experts (resident, whole under ZeRO) after the pipeline, over the
        // replicas that hold the same ones.
        let edp = cfg.dp / ep;
        let experts_sum = match edp > 1 && experts > 0.0 {
            true => {
                let latency = dp_link.all_reduce(0.0, edp);
                let x = 4.0 * experts;
                buckets(x) * latency + (dp_link.all_reduce(x, edp) - latency)
            }
            false => 0.0,
        };
        (
            dp + experts_sum,
            optimizer_turns
                * ((n + experts) * tm.optimizer_s_per_param + k * tm.optimizer_s_per_tensor),
        )
    };
    let slowest = ranks
        .iter()
        .zip(&overlap)
        .map(|(r, &o)| after(r.2, r.3, r.4, o))
        .max_by(|a, b| (a.0 + a.1).total_cmp(&(b.0 + b.1)))
        .unwrap_or((0.0, 0.0));
    let gather = if cfg.world_size() > 1 {
        tm.collective.alpha_s
    } else {
        0.0
    };
    let pipeline_s = timeline.makespan;
    // Of the busiest rank's collectives in its stages, the all-to-alls (a recomputed
    // forward's once more).
    let forwards = if cfg.recompute == Recompute::Full {
        2.0
    } else {
        1.0
    };
    let ep_comm_s = mb
        * program
            .stages_of_rank(busiest as u32)
            .iter()
            .map(|&s| a2a[s as usize].0 * forwards + a2a[s as usize].1)
            .sum::<f64>();
    let overhead_s = tm.step_overhead_s + if shared { tm.world_overhead_s } else { 0.0 };
    Ok(StepTime {
        seconds: pipeline_s + slowest.0 + slowest.1 + gather + overhead_s,
        pipeline_s,
        compute_s: ranks.get(busiest).map_or(0.0, |r| r.0),
        tp_comm_s: (ranks.get(busiest).map_or(0.0, |r| r.1) - ep_comm_s).max(0.0),
        ep_comm_s,
        p2p_s: timeline.ranks.get(busiest).map_or(0.0, |r| r.comm),
        dp_allreduce_s: slowest.0,
        optimizer_s: slowest.1,
        bubble_fraction: timeline.bubble_fraction,
        overhead_s,
    })
}

/// Training FLOPs per token of one stage.
pub(super) fn stage_flops(costs: &switchyard_models::LayerCosts, p: &StagePlan) -> f64 {
    let blocks: f64 = costs.blocks[p.blocks.clone()].iter().sum();
    blocks + if p.embed { costs.embed } else { 0.0 } + if p.head { costs.head } else { 0.0 }
}

#[cfg(test)]
mod tests;
