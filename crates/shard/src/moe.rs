//! A mixture-of-experts MLP: a router sends each token to `k` of `E` expert MLPs.
//!
//! For a token `x`, with router weight `R` `[E, d]`:
//!
//! ```text
//! p = softmax(x·Rᵀ)                        (f32, over the E experts)
//! S = the k experts of largest p           (ties: the lower expert index first)
//! g_e = p_e / Σ_{j∈S} p_j   (k > 1)        (GShard's renormalised gates)
//! g_e = p_e                 (k = 1)        (Switch Transformer)
//! y = Σ_{e∈S, kept} g_e · MLP_e(x)
//! ```
//!
//! **Capacity.** With a capacity factor `C > 0` every expert takes at most
//! `⌈C · k · T / E⌉` tokens of each sequence of `T` tokens; a token over capacity gets
//! nothing from that expert (it passes through the block's residual). Within a sequence
//! the choices are placed in position order (a token's first choice before its second),
//! so whether a token's choice is kept depends on the tokens before it only: a language
//! model stays causal. Routing is per sequence and ties break by expert index, so it
//! does not depend on how a batch is cut into microbatches or replicas: every layout
//! drops the same tokens. (The capacity depends on `T`: a model evaluated on shorter or
//! longer sequences than it trained on routes with another capacity.)
//!
//! **Balancing loss** (Switch Transformer): per sequence `E · Σ_e f_e · P_e`, with `f_e`
//! the fraction of the sequence's `T·k` choices that picked `e` (before capacity) and
//! `P_e` the mean router probability of `e`; the objective adds `α` times its mean over
//! the job's sequences (the layer attaches it to its output with
//! [`switchyard_ops::attach_loss`], scaled by the [`LossScale`] the pipeline stage is
//! told).
//!
//! **Router z-loss** (ST-MoE, Zoph et al. 2022), optional: per sequence the mean over its
//! tokens of `(log Σ_e exp(z_e))²`, `z` the router's logits, which keeps the logits small
//! (the softmax in f32 stays accurate); the objective adds `β` times its mean over the
//! job's sequences, attached the same way.
//!
//! **Tensor parallelism.** The router is replicated (every rank routes the same way, as
//! its input is replicated); each expert is a [`ParallelMlp`], split over the group like
//! a dense MLP, so an expert costs one all-reduce forward and one backward on the tokens
//! it receives.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use candle_core::{DType, Result, Tensor, Var, D};
use switchyard_comm::Communicator;

use crate::all_to_all::all_to_all_rows;
use crate::attention::LayerInit;
use crate::error::ShardError;
use crate::mlp::ParallelMlp;
use crate::param::Builder;
use crate::spec::ShardSpec;

/// How a mixture-of-experts layer routes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeOptions {
    /// `E`, the number of experts.
    pub experts: usize,
    /// `k`, the experts each token goes to.
    pub top_k: usize,
    /// `C`: each expert takes at most `⌈C · k · T / E⌉` tokens of a sequence; 0 = no limit.
    pub capacity_factor: f64,
    /// `α`, the balancing loss's coefficient (0: none).
    pub aux_loss_coef: f64,
    /// `β`, the router z-loss's coefficient (0: none).
    pub z_loss_coef: f64,
}

impl MoeOptions {
    /// The most tokens of a sequence of `t` one expert takes, or `None` for no limit.
    pub fn capacity(&self, t: usize) -> Option<usize> {
        match self.capacity_factor > 0.0 {
            true => Some(
                (self.capacity_factor * (self.top_k * t) as f64 / self.experts as f64).ceil()
                    as usize,
            ),
            false => None,
        }
    }
}

/// Where the tokens of a batch `[B, T]` go.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Per expert, the flat token indices (`b·T + t`) it computes, ascending.
    pub tokens: Vec<Vec<u32>>,
    /// `[B·T, E]`, 1 where the expert is one of the token's top k (before capacity).
    pub chosen: Vec<f32>,
    /// `[B·T, E]`, 1 where the token reaches the expert (within capacity).
    pub kept: Vec<f32>,
    /// `[B, E]`: per sequence, the choices of each expert before capacity.
    pub counts: Vec<f32>,
    /// Choices over capacity, over the batch.
    pub dropped: usize,
}

/// Routes `B` sequences of `T` tokens from their router probabilities `probs`
/// (`[B·T, E]`, row-major); see the module docs for the rules.
pub fn route(probs: &[f32], b: usize, t: usize, opts: &MoeOptions) -> Routing {
    let e_n = opts.experts;
    let k = opts.top_k.min(e_n);
    let cap = opts.capacity(t).unwrap_or(usize::MAX);
    let n = b * t;
    let mut chosen = vec![0f32; n * e_n];
    let mut kept = vec![0f32; n * e_n];
    let mut counts = vec![0f32; b * e_n];
    let mut dropped = 0;
    let mut order: Vec<usize> = Vec::with_capacity(e_n);
    let mut top = vec![0usize; n * k];
    for tok in 0..n {
        let p = &probs[tok * e_n..(tok + 1) * e_n];
        order.clear();
        order.extend(0..e_n);
        order.sort_by(|&i, &j| p[j].total_cmp(&p[i]).then(i.cmp(&j)));
        top[tok * k..(tok + 1) * k].copy_from_slice(&order[..k]);
        for &e in &order[..k] {
            chosen[tok * e_n + e] = 1.0;
            counts[(tok / t) * e_n + e] += 1.0;
        }
    }
    for row in 0..b {
        let mut load = vec![0usize; e_n];
        for tok in row * t..(row + 1) * t {
            for j in 0..k {
                let e = top[tok * k + j];
                match load[e] < cap {
                    true => {
                        load[e] += 1;
                        kept[tok * e_n + e] = 1.0;
                    }
                    false => dropped += 1,
                }
            }
        }
    }
    let tokens = (0..e_n)
        .map(|e| {
            (0..n)
                .filter(|tok| kept[tok * e_n + e] > 0.0)
                .map(|tok| tok as u32)
                .collect()
        })
        .collect();
    Routing {
        tokens,
        chosen,
        kept,
        counts,
        dropped,
    }
}

/// The scale of the objective's gradient, shared between a pipeline stage (which is
/// told it: `switchyard_pipeline::Stage::set_loss_scale`) and its layers that add
/// losses of their own. 1 until set.
#[derive(Debug, Clone)]
pub struct LossScale(Arc<AtomicU64>);

impl Default for LossScale {
    fn default() -> Self {
        LossScale(Arc::new(AtomicU64::new(1f64.to_bits())))
    }
}

impl LossScale {
    pub fn set(&self, scale: f64) {
        self.0.store(scale.to_bits(), Ordering::Relaxed)
    }
    pub fn get(&self) -> f64 {
        f64::from_bits(self.0.load(Ordering::Relaxed))
    }
}

/// What a stage's mixtures of experts counted since the last [`MoeStats::take`],
/// summed by name: `moe/aux_loss` (the balancing loss's part of the objective, already
/// a mean over the job's sequences once summed over microbatches and replicas),
/// `moe/choices` and `moe/dropped` (the tokens' choices, and those over capacity), and
/// `{layer}.experts.{e}.tokens` (the choices each expert computed). A forward run
/// again in a backward ([`MoeStats::set_recomputing`]) is not counted twice.
#[derive(Debug, Clone, Default)]
pub struct MoeStats(Arc<Mutex<StatsInner>>);

#[derive(Debug, Default)]
struct StatsInner {
    sums: BTreeMap<String, f64>,
    recomputing: bool,
}

impl MoeStats {
    /// Whether the forwards from now on are recomputations (not counted).
    pub fn set_recomputing(&self, on: bool) {
        self.lock().recomputing = on;
    }

    /// The sums since the last take, by name.
    pub fn take(&self) -> Vec<(String, f64)> {
        std::mem::take(&mut self.lock().sums).into_iter().collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, StatsInner> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, values: impl IntoIterator<Item = (String, f64)>) {
        let mut s = self.lock();
        if s.recomputing {
            return;
        }
        for (k, v) in values {
            *s.sums.entry(k).or_default() += v;
        }
    }
}

/// What a stage's mixtures of experts share with the stage: the scale of the
/// objective's gradient it is told, and where they count their routing.
#[derive(Debug, Clone, Default)]
pub struct MoeShared {
    pub loss_scale: LossScale,
    pub stats: MoeStats,
}

/// A mixture-of-experts MLP on a tensor-parallel group.
///
/// Given the *block's* builder (prefix `transformer.h.{i}`), it creates
/// `mlp.router.weight` `[E, d]` (replicated) and, for each expert `e`,
/// `mlp.experts.{e}.c_fc.*` and `mlp.experts.{e}.c_proj.*`, the parameters of a
/// [`ParallelMlp`] of width `hidden`. Under expert parallelism
/// ([`crate::ParamStore::set_expert_group`]) it creates only the experts this rank
/// computes, marked with their peers on the other ranks ([`crate::Param::expert`]).
pub struct ParallelMoe {
    router: Var,
    /// The experts this rank holds: `local`, in order.
    experts: Vec<ParallelMlp>,
    opts: MoeOptions,
    loss_scale: LossScale,
    stats: MoeStats,
    name: String,
    /// Expert parallelism ([`crate::ParamStore::set_expert_group`]): the group, and the
    /// experts this rank computes for all of it.
    ep: Option<Arc<dyn Communicator>>,
    local: Range<usize>,
}

impl ParallelMoe {
    pub fn new(
        vb: &Builder,
        comm: Arc<dyn Communicator>,
        d_model: usize,
        hidden: usize,
        init: LayerInit,
        opts: MoeOptions,
        shared: MoeShared,
    ) -> Result<Self> {
        let MoeShared { loss_scale, stats } = shared;
        let vb = vb.pp("mlp");
        let name = vb.prefix().to_string();
        if opts.experts == 0 || opts.top_k == 0 || opts.top_k > opts.experts {
            return Err(ShardError::Invalid(format!(
                "{name}: a mixture of experts needs 1 ≤ top-k ≤ experts, got top-k {} of {} experts",
                opts.top_k, opts.experts
            ))
            .into());
        }
        let router = vb.pp("router").param(
            "weight",
            &[opts.experts, d_model],
            ShardSpec::Replicated,
            init.weight,
        )?;
        let ep = vb.store().expert_group();
        let local = match &ep {
            None => 0..opts.experts,
            Some(g) => {
                let n = g.world_size();
                if !opts.experts.is_multiple_of(n) {
                    return Err(ShardError::Invalid(format!(
                        "{name}: {} experts do not divide over an expert-parallel group of {n}",
                        opts.experts
                    ))
                    .into());
                }
                let per = opts.experts / n;
                g.rank() * per..(g.rank() + 1) * per
            }
        };
        // Under expert parallelism this rank holds only the experts it computes; the
        // k-th of them matches the k-th of every other rank of the group.
        let experts = local
            .clone()
            .map(|e| {
                let mut b = vb.pp(format!("experts.{e}"));
                if let Some(g) = &ep {
                    let (k, per) = (e - local.start, local.len());
                    let peers = (0..g.world_size())
                        .map(|j| vb.path(&format!("experts.{}", j * per + k)))
                        .collect();
                    b = b.expert(peers);
                }
                ParallelMlp::at(&b, comm.clone(), d_model, hidden, init)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ParallelMoe {
            router,
            experts,
            opts,
            loss_scale,
            stats,
            name,
            ep,
            local,
        })
    }

    /// Every expert on its tokens: `xs` holds `counts[e]` rows for expert `e`, expert
    /// by expert; the outputs in the same order.
    fn run_experts(&self, xs: &Tensor, counts: &[usize]) -> Result<Tensor> {
        let mut ys = Vec::new();
        let mut off = 0;
        for (expert, &n) in self.experts.iter().zip(counts) {
            if n > 0 {
                ys.push(expert.forward(&xs.narrow(0, off, n)?)?);
            }
            off += n;
        }
        Tensor::cat(&ys, 0)
    }

    /// [`Self::run_experts`] over the expert-parallel group: the rows go to the ranks
    /// that compute their experts (an all-to-all of the counts, then of the rows), each
    /// rank runs its experts on what it received from the whole group, and a second
    /// all-to-all brings the outputs back, in the order they were sent.
    fn dispatched(
        &self,
        xs: &Tensor,
        counts: &[usize],
        ep: &Arc<dyn Communicator>,
    ) -> Result<Tensor> {
        let (n, per) = (ep.world_size(), self.local.len());
        let mine = |r: usize| &counts[r * per..(r + 1) * per];
        let send: Vec<usize> = (0..n).map(|r| mine(r).iter().sum()).collect();
        let parts = (0..n)
            .map(|r| {
                let c: Vec<u32> = mine(r).iter().map(|&c| c as u32).collect();
                Tensor::from_vec(c, per, &candle_core::Device::Cpu)
            })
            .collect::<Result<Vec<_>>>()?;
        let from: Vec<Vec<u32>> = ep
            .all_to_all(parts)?
            .iter()
            .map(|t| t.to_vec1::<u32>())
            .collect::<Result<_>>()?;
        let (recv, sizes) = all_to_all_rows(xs, ep, &send)?;
        // The received rows: rank by rank, within each this rank's experts in order.
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); per];
        let mut at = 0u32;
        for c in &from {
            for (e, &k) in c.iter().enumerate() {
                rows[e].extend(at..at + k);
                at += k;
            }
        }
        let dev = xs.device();
        let (mut ys, mut pos) = (Vec::new(), vec![0u32; at as usize]);
        let mut done = 0u32;
        for (e, rows) in rows.iter().enumerate() {
            if rows.is_empty() {
                continue;
            }
            let ids = Tensor::from_slice(rows, rows.len(), dev)?;
            ys.push(self.experts[e].forward(&recv.index_select(&ids, 0)?)?);
            for (k, &row) in rows.iter().enumerate() {
                pos[row as usize] = done + k as u32;
            }
            done += rows.len() as u32;
        }
        // Back in the order received (an empty `recv` still carries the gradient's
        // way back, so that every rank takes part in both backward exchanges).
        let back = match ys.is_empty() {
            true => recv,
            false => {
                Tensor::cat(&ys, 0)?.index_select(&Tensor::from_vec(pos, at as usize, dev)?, 0)?
            }
        };
        let (out, got) = all_to_all_rows(&back, ep, &sizes)?;
        if got != send {
            return Err(ShardError::Invalid(format!(
                "{}: sent {send:?} rows to the experts, got {got:?} back",
                self.name
            ))
            .into());
        }
        Ok(out)
    }

    /// `x` `[B, T, d]` (replicated) to `[B, T, d]` (replicated).
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_inner(x)
            .map_err(|e| e.context(format!("{} (mixture of experts)", self.name)))
    }

    fn forward_inner(&self, x: &Tensor) -> Result<Tensor> {
        let (b, t, d) = x.dims3()?;
        let e_n = self.opts.experts;
        let xf = x.reshape((b * t, d))?;
        let logits = xf
            .to_dtype(DType::F32)?
            .matmul(&self.router.as_tensor().to_dtype(DType::F32)?.t()?)?;
        let probs = {
            let z = logits
                .broadcast_sub(&logits.max_keepdim(D::Minus1)?)?
                .exp()?;
            z.broadcast_div(&z.sum_keepdim(D::Minus1)?)?
        };
        let r = route(&probs.flatten_all()?.to_vec1::<f32>()?, b, t, &self.opts);
        let dev = x.device();
        let mat = |v: &[f32], rows: usize| Tensor::from_slice(v, (rows, e_n), dev);
        let picked = (&probs * mat(&r.chosen, b * t)?)?;
        let gates = match self.opts.top_k {
            1 => picked,
            _ => picked.broadcast_div(&picked.sum_keepdim(D::Minus1)?)?,
        };
        let gates = (gates * mat(&r.kept, b * t)?)?.to_dtype(x.dtype())?;
        // The kept choices in dispatch order: expert by expert, tokens ascending.
        let counts: Vec<usize> = r.tokens.iter().map(|t| t.len()).collect();
        let ids: Vec<u32> = r.tokens.concat();
        let mut out = xf.zeros_like()?;
        if !ids.is_empty() || self.ep.is_some() {
            let flat: Vec<u32> = r
                .tokens
                .iter()
                .enumerate()
                .flat_map(|(e, ts)| ts.iter().map(move |&t| t * e_n as u32 + e as u32))
                .collect();
            let n = ids.len();
            let ids = Tensor::from_vec(ids, n, dev)?;
            let xs = xf.index_select(&ids, 0)?;
            let ys = match &self.ep {
                None => self.run_experts(&xs, &counts)?,
                Some(ep) => self.dispatched(&xs, &counts, ep)?,
            };
            let g = gates
                .flatten_all()?
                .index_select(&Tensor::from_vec(flat, n, dev)?, 0)?;
            // One scatter-add of every gated output (in expert order for each token).
            out = out.index_add(&ids, &ys.broadcast_mul(&g.unsqueeze(1)?)?, 0)?;
        }
        let mut aux_part = 0.0;
        if self.opts.aux_loss_coef > 0.0 {
            // Σ over the sequences of E · Σ_e f_e · P_e.
            let p_sum = probs.reshape((b, t, e_n))?.sum(1)?;
            let aux = (p_sum * mat(&r.counts, b)?)?.sum_all()?;
            let aux = (aux * (e_n as f64 / (self.opts.top_k * t * t) as f64))?;
            let scale = self.opts.aux_loss_coef * self.loss_scale.get() / b as f64;
            aux_part = scale * aux.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            out = switchyard_ops::attach_loss(&out, &aux, scale)?;
        }
        let mut z_part = 0.0;
        if self.opts.z_loss_coef > 0.0 {
            // Σ over the sequences of the mean over its tokens of logsumexp(z)²; the
            // max is a constant shift (its gradient would cancel).
            let max = logits.max_keepdim(D::Minus1)?.detach();
            let lse = (logits
                .broadcast_sub(&max)?
                .exp()?
                .sum_keepdim(D::Minus1)?
                .log()?
                + max)?;
            let z = (lse.sqr()?.sum_all()? / t as f64)?;
            let scale = self.opts.z_loss_coef * self.loss_scale.get() / b as f64;
            z_part = scale * z.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            out = switchyard_ops::attach_loss(&out, &z, scale)?;
        }
        let name = &self.name;
        self.stats.add(
            [
                ("moe/aux_loss".to_string(), aux_part),
                ("moe/z_loss".to_string(), z_part),
                ("moe/choices".into(), (b * t * self.opts.top_k) as f64),
                ("moe/dropped".into(), r.dropped as f64),
            ]
            .into_iter()
            .chain(
                counts
                    .iter()
                    .enumerate()
                    .map(|(e, &n)| (format!("{name}.experts.{e}.tokens"), n as f64)),
            ),
        );
        out.reshape((b, t, d))
    }

    /// Fuses the weights of every expert this rank computes for the step (see
    /// [`ParallelMlp::begin_step`]).
    pub fn begin_step(&self) -> Result<()> {
        self.experts.iter().try_for_each(|e| e.begin_step())
    }

    pub fn end_step(&self) {
        self.experts.iter().for_each(|e| e.end_step())
    }

    pub fn release_step(&self) -> Result<()> {
        self.experts.iter().try_for_each(|e| e.release_step())
    }

    /// The router's weight.
    pub fn router(&self) -> &Var {
        &self.router
    }

    pub fn options(&self) -> &MoeOptions {
        &self.opts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(experts: usize, top_k: usize, capacity_factor: f64) -> MoeOptions {
        MoeOptions {
            experts,
            top_k,
            capacity_factor,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.0,
        }
    }

    #[test]
    fn top_k_breaks_ties_by_the_lower_expert() {
        // Two tokens of one sequence, three experts; the first token ties 0 and 2.
        let p = [0.4, 0.2, 0.4, 0.1, 0.6, 0.3];
        let r = route(&p, 1, 2, &opts(3, 1, 0.0));
        assert_eq!(r.tokens, vec![vec![0], vec![1], vec![]]);
        let r = route(&p, 1, 2, &opts(3, 2, 0.0));
        assert_eq!(r.tokens, vec![vec![0], vec![1], vec![0, 1]]);
        assert_eq!(r.counts, vec![1.0, 1.0, 2.0]);
        assert_eq!(r.dropped, 0);
    }

    #[test]
    fn choices_are_placed_in_position_order_so_routing_stays_causal() {
        // Two tokens, 2 experts, top 2, capacity ⌈0.5·2·2/2⌉ = 1: token 0 takes both
        // experts, token 1 gets neither (placing first choices first would give token
        // 1 its first choice at token 0's expense: token 0 would see the future).
        let p = [0.9, 0.1, 0.2, 0.8];
        let r = route(&p, 1, 2, &opts(2, 2, 0.5));
        assert_eq!(r.tokens, vec![vec![0], vec![0]]);
        assert_eq!(r.dropped, 2);
        // Token 0's routing is the same whatever token 1 prefers.
        for q in [[0.9, 0.1], [0.1, 0.9], [0.5, 0.5]] {
            let p = [0.9, 0.1, q[0], q[1]];
            let r = route(&p, 1, 2, &opts(2, 2, 0.5));
            assert_eq!((&r.kept[..2], r.tokens[0][0]), (&[1.0, 1.0][..], 0));
        }
    }

    #[test]
    fn capacity_is_per_sequence() {
        // One sequence of 4 tokens, 2 experts, top 2, C 0.5: capacity ⌈0.5·2·4/2⌉ = 2.
        // Every token prefers expert 0: tokens 0 and 1 fill both experts; the choices
        // of tokens 2 and 3 are dropped.
        let p = [0.9, 0.1, 0.8, 0.2, 0.7, 0.3, 0.6, 0.4];
        let r = route(&p, 1, 4, &opts(2, 2, 0.5));
        assert_eq!(r.tokens, vec![vec![0, 1], vec![0, 1]]);
        assert_eq!(r.dropped, 4);
        // The same sequence twice: the second is routed as if alone.
        let p2: Vec<f32> = p.iter().chain(p.iter()).copied().collect();
        let r2 = route(&p2, 2, 4, &opts(2, 2, 0.5));
        assert_eq!(r2.tokens, vec![vec![0, 1, 4, 5], vec![0, 1, 4, 5]]);
        assert_eq!(r2.dropped, 8);
        assert_eq!(r2.counts, vec![4.0, 4.0, 4.0, 4.0]);
    }

    #[test]
    fn no_capacity_limit_keeps_every_choice() {
        let p = [0.9, 0.1, 0.8, 0.2, 0.7, 0.3];
        let r = route(&p, 1, 3, &opts(2, 1, 0.0));
        assert_eq!(r.tokens, vec![vec![0, 1, 2], vec![]]);
        assert_eq!(r.kept, r.chosen);
        assert_eq!(opts(8, 2, 1.25).capacity(64), Some(20));
        assert_eq!(opts(8, 2, 0.0).capacity(64), None);
    }
}
