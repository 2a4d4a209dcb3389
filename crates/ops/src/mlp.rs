//! The two halves of a transformer block, each as one op with a hand-written backward:
//! Megatron's column-then-row pair `y = mid(x · w1ᵀ + b1) · w2ᵀ + b2` with a middle
//! function that needs no communication, and the hooks of tensor parallelism (`f` on the
//! input gradient, `g` on the output before `b2`):
//!
//! * [`mlp`]: `mid` = GELU, `w1` = `c_fc`, `w2` = `c_proj`;
//! * [`attention_block`]: `mid` = causal self-attention over the packed q | k | v
//!   projection ([`crate::causal_attention_packed`]), `w1` = `c_attn`, `w2` = `c_proj`.
//!
//! As separate ops, the activations between them (the `[N, hidden]` MLP activation, the
//! `[N, 3·d]` qkv projection, the `[N, d]` attention output) are tensors of candle's
//! graph, so backward allocates a zeroed gradient for each and adds the next op's
//! gradient into it: 4 × their bytes of memory traffic that does nothing (56 MiB a layer
//! at the reference workload's 4,096 tokens). Here they stay inside the op.
//!
//! Candle's custom ops take at most three inputs, so each bias travels as the last
//! column of its weight (`[w | b]`, built with `Tensor::cat`, whose backward hands the
//! two parts of the gradient back to the weight and the bias): parameter-sized copies,
//! against activation-sized savings.
//!
//! Forward: `pre = x·w1ᵀ + b1` (bias placed first, product accumulated onto it), `h =
//! mid(pre)`, `y = h·w2ᵀ` (+ `g`) `+ b2`; keeps `pre` and `h`. Backward, from `G`:
//! `dw2 = Gᵀ·h`, `db2 = Σ_rows G`, `dh = G·w2`, `dpre = mid′(dh)`, `dw1 = dpreᵀ·x`,
//! `db1 = Σ_rows dpre`, `dx = dpre·w1` (+ `f`).

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

use crate::attention::AttentionEpilogue;

use crate::bf16::{held_slice, keep, storage_as, widened, Held};
use crate::deferred::Owned;
use crate::gelu::{gelu_backward, gelu_backward_bf16, gelu_forward, gelu_forward_bf16};
use crate::kernel::{self, slice, view, Float};
use crate::linear::{
    affine_forward, affine_input_grad, affine_weight_grad, check_precision, column_sums, halve_at,
    halve_held, input_grad, round_at, Reduce, Regather,
};
use crate::DeferredWeights;
use crate::{composed, OpsBackend, Precision};

/// The collectives around [`mlp`] and [`attention_block`] (tensor parallelism).
#[derive(Clone, Default)]
pub struct PairOptions {
    /// Reduce `h · w2ᵀ` (before `b2`) with this collective: the row-parallel layer's `g`.
    /// Its backward pass is the identity.
    pub reduce_output: Option<Reduce>,
    /// Reduce the input gradient with this collective: the column-parallel layer's `f`.
    pub reduce_input_grad: Option<Reduce>,
    /// The fused op or its composed twin ([`OpsBackend`]).
    pub backend: OpsBackend,
    /// Selective recomputation, for the MLP (GELU in the middle): keep only the
    /// pre-activation `pre = x · w1ᵀ + b1` for the backward, which computes `GELU(pre)`
    /// again (4·d/tp fewer elements per token for one elementwise pass). The same
    /// kernel runs on the same input, so the gradients are those without it. The
    /// attention and the composed twin ignore it.
    pub recompute_gelu: bool,
    /// What the products multiply in and what the op keeps for its backward
    /// ([`Precision`]): at `Bf16` the pre-activation is rounded to bf16 before the
    /// middle function, and the pre-activation and the middle function's output are kept
    /// as bf16 (half the bytes). `Bf16` takes f32 tensors, or bf16 activations (the
    /// output is then bf16 too).
    ///
    /// At `Bf16` the op also keeps its input as the products read it, rounded to bf16
    /// once, and its backward never reads the input tensor's values again: a caller
    /// that owns the input (a LayerNorm's output that nothing else reads) may free it in
    /// place after the forward (`switchyard_shard::free_in_place`), so what stays for
    /// the backward is bf16.
    pub precision: Precision,
    /// A split backward (zero-bubble schedules): while it is split, the backward
    /// computes only the input gradient, returns no gradient for the two fused weights,
    /// and defers their products to [`DeferredWeights::run_oldest`], which gives
    /// `d[w1 | b1]` and `d[w2 | b2]` (the same values as without it). The forward of a
    /// split backward's fused op reads its weights without their graph
    /// ([`PairWeights::detached`]: candle wants a gradient for every tracked input). The
    /// composed twin ignores it.
    pub defer: Option<DeferredWeights>,
    /// Where the backward gets the input's values: from this (a sequence-parallel
    /// block's all-gather, again) instead of the input tensor, which the caller may then
    /// free in place after the forward ([`PairWeights::runs_fused`] says whether the
    /// fused op runs; its composed twin reads the input tensor). At `Bf16` the op then
    /// keeps no bf16 copy of its input either, and rounds what this returns as the
    /// forward rounded the input.
    pub input_again: Option<Regather>,
}

mod weights;
pub use weights::PairWeights;

/// `gelu(x · w1ᵀ + b1) · w2ᵀ + b2` for `x` `[.., d]` (rank 2 or 3), `w1` `[hidden, d]`,
/// `b1` `[hidden]`, `w2` `[out, hidden]`, `b2` `[out]` (PyTorch layouts; GELU is the tanh
/// approximation of [`crate::gelu`]). Returns `[.., out]`.
pub fn mlp(
    x: &Tensor,
    w1: &Tensor,
    b1: Option<&Tensor>,
    w2: &Tensor,
    b2: Option<&Tensor>,
    opts: &PairOptions,
) -> Result<Tensor> {
    mlp_with(x, &PairWeights::new(w1, b1, w2, b2)?, opts)
}

/// [`mlp`] with weights fused beforehand.
pub fn mlp_with(x: &Tensor, w: &PairWeights, opts: &PairOptions) -> Result<Tensor> {
    let [(hidden, _), _] = w.dims()?;
    check("mlp", x, w, hidden)?;
    pair(x, w, None, opts)
}

/// `attention(x · w_qkvᵀ + b_qkv) · w_projᵀ + b_proj`: causal self-attention over
/// `n_head` heads of the packed projection (columns `q | k | v`, each `n_head` heads of
/// `hd`), then the output projection. `x` `[B, T, d]`, `w_qkv` `[3·H·hd, d]`, `b_qkv`
/// `[3·H·hd]`, `w_proj` `[out, H·hd]`, `b_proj` `[out]`. Returns `[B, T, out]`.
pub fn attention_block(
    x: &Tensor,
    w_qkv: &Tensor,
    b_qkv: Option<&Tensor>,
    w_proj: &Tensor,
    b_proj: Option<&Tensor>,
    n_head: usize,
    opts: &PairOptions,
) -> Result<Tensor> {
    let w = PairWeights::new(w_qkv, b_qkv, w_proj, b_proj)?;
    attention_block_with(x, &w, n_head, opts)
}

/// [`attention_block`] with weights fused beforehand.
pub fn attention_block_with(
    x: &Tensor,
    w: &PairWeights,
    n_head: usize,
    opts: &PairOptions,
) -> Result<Tensor> {
    let [(three_dl, _), _] = w.dims()?;
    if x.rank() != 3 || n_head == 0 || !three_dl.is_multiple_of(3 * n_head) {
        bail!(
            "attention_block: x must be [B, T, d] and the qkv width ({three_dl}) a multiple of 3 × n_head ({n_head}); got x {:?}",
            x.dims()
        );
    }
    check("attention_block", x, w, three_dl / 3)?;
    pair(x, w, Some(n_head), opts)
}

/// Shapes: `x` `[.., d]` for `w1` `[n1, d]`, and `w2` `[out, mid]`.
fn check(what: &str, x: &Tensor, w: &PairWeights, mid: usize) -> Result<()> {
    let [(_, d), (_, m)] = w.dims()?;
    if m != mid || !(2..=3).contains(&x.rank()) || x.dim(D::Minus1)? != d {
        bail!(
            "{what}: shapes must be x [.., d], w1 [n, d], w2 [out, {mid}]; got x {:?}, w1 {:?}, w2 {:?}",
            x.dims(),
            w.w[0].dims(),
            w.w[1].dims()
        );
    }
    Ok(())
}

/// The fused pair, or its composed twin (another backend, dtype or device).
fn pair(x: &Tensor, w: &PairWeights, heads: Option<usize>, opts: &PairOptions) -> Result<Tensor> {
    let [(n1, d), (out, mid)] = w.dims()?;
    check_precision(
        if heads.is_some() {
            "attention_block"
        } else {
            "mlp"
        },
        opts.precision,
        x,
    )?;
    let half = x.dtype() == DType::BF16 && opts.precision == Precision::Bf16;
    let wt = w.fused[0].dtype();
    if !w.runs_fused(x, opts) {
        if half && wt == DType::F32 {
            // bf16 activations on the composed twin: it multiplies f32 tensors.
            return composed::pair(&x.to_dtype(DType::F32)?, w, heads, opts)?.to_dtype(DType::BF16);
        }
        return composed::pair(x, w, heads, opts);
    }
    // A split backward: the fused op's weight gradients come from the deferred
    // products, not from candle's graph, which wants one for every tracked input.
    let detached;
    let w = match opts.defer.as_ref().is_some_and(|q| q.is_split()) {
        true => {
            detached = w.detached();
            &detached
        }
        false => w,
    };
    let op = Pair {
        opts: opts.clone(),
        d,
        n1,
        mid,
        out,
        bias: [w.b[0].is_some(), w.b[1].is_some()],
        attention: heads.map(AttentionEpilogue::new),
        saved: OnceLock::new(),
        input: OnceLock::new(),
    };
    x.contiguous()?.apply_op3(&w.fused[0], &w.fused[1], op)
}

struct Pair {
    opts: PairOptions,
    d: usize,
    /// Width of `pre` (`w1`'s rows) and of `h` (`w2`'s columns): equal for GELU, `3·dl`
    /// and `dl` for attention.
    n1: usize,
    mid: usize,
    out: usize,
    /// Whether `w1` and `w2` carry a bias column.
    bias: [bool; 2],
    /// The middle function: attention, or GELU when `None`.
    attention: Option<AttentionEpilogue>,
    /// `pre` and `h = mid(pre)`, for the backward pass (`h` recomputed there instead
    /// under [`PairOptions::recompute_gelu`]); bf16 at [`Precision::Bf16`].
    saved: OnceLock<(CpuStorage, Option<CpuStorage>)>,
    /// The input rounded to bf16 at [`Precision::Bf16`] (an f32 input): what the
    /// products read forward and the weight gradient backward, so that the input
    /// tensor may be freed.
    input: OnceLock<CpuStorage>,
}

impl Pair {
    const NAME: &'static str = "switchyard-column-row-pair";

    /// Whether the backward computes `h = GELU(pre)` again instead of keeping it.
    fn recomputes_h(&self) -> bool {
        self.opts.recompute_gelu && self.attention.is_none()
    }

    /// Row strides of the two weight inputs: their width plus the bias column.
    fn lds(&self) -> (usize, usize) {
        (
            self.d + self.bias[0] as usize,
            self.mid + self.bias[1] as usize,
        )
    }

    /// The shape of `pre` for the attention: `[B, T, n1]` from the input's shape.
    fn pre_shape(&self, x: &Shape) -> Shape {
        let mut dims = x.dims().to_vec();
        *dims.last_mut().expect("rank ≥ 2") = self.n1;
        Shape::from(dims)
    }

    fn forward<T: Float>(
        &self,
        x: Held<T>,
        w1: &[T],
        w2: &[T],
        shape: &Shape,
    ) -> Result<(CpuStorage, Shape)> {
        let (d, n1, mid, out) = (self.d, self.n1, self.mid, self.out);
        let (ld1, ld2) = self.lds();
        let bias = |on: bool, w: &[T], n: usize, ld: usize| -> Option<Vec<T>> {
            on.then(|| (0..n).map(|i| w[i * ld + ld - 1]).collect())
        };
        let b1 = bias(self.bias[0], w1, n1, ld1);
        let prec = self.opts.precision;
        // At bf16 an f32 input is rounded once and kept so (see `Pair::input`).
        let half_out = matches!(x, Held::Half(_));
        let x_half = halve_held(prec, x);
        let x = x.or_half(x_half.as_deref());
        let pre = affine_forward(x, d, w1, ld1, b1.as_deref(), n1, None, prec)?;
        // The middle function. At bf16 `pre` and `h` are rounded to bf16: the middle
        // function and the backward see the same values, the second product reads `h`
        // so, and the backward keeps both so. The MLP does it in one pass over `pre`.
        let fused = match (&self.attention, prec) {
            (None, Precision::Bf16) => kernel::as_f32(&pre).map(gelu_forward_bf16).transpose()?,
            _ => None,
        };
        let (pre, h, half) = match fused {
            Some((pre, h)) => (CpuStorage::BF16(pre), Vec::new(), Some(h)),
            None => {
                let mut pre = pre;
                let pre_half = round_at(prec, &mut pre);
                let h = match &self.attention {
                    Some(attn) => attn.forward(&pre, &self.pre_shape(shape))?.0,
                    None => gelu_forward(&pre)?,
                };
                let half = halve_at(prec, &h);
                (keep(pre, pre_half), h, half)
            }
        };
        let b2 = bias(self.bias[1], w2, out, ld2);
        let reduce = self.opts.reduce_output.as_ref();
        let y = affine_forward(
            Held::of(&h, half.as_deref()),
            mid,
            w2,
            ld2,
            b2.as_deref(),
            out,
            reduce,
            prec,
        )?;
        let h = (!self.recomputes_h()).then(|| keep(h, half));
        let _ = self.saved.set((pre, h));
        if let Some(x) = x_half.filter(|_| self.opts.input_again.is_none()) {
            let _ = self.input.set(CpuStorage::BF16(x));
        }
        let mut dims = shape.dims().to_vec();
        *dims.last_mut().expect("rank ≥ 2") = out;
        Ok((storage_as(y, half_out)?, Shape::from(dims)))
    }

    /// `(dx, d[w1 | b1], d[w2 | b2])`; `dx` only when `x` tracks gradients, the weights'
    /// only when not deferred ([`PairOptions::defer`]).
    #[allow(clippy::type_complexity)]
    fn backward<T: Float>(
        &self,
        x: &Tensor,
        w1: &Tensor,
        w2: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let defer = self.opts.defer.as_ref().filter(|q| q.is_split());
        let (d, n1, mid, out) = (self.d, self.n1, self.mid, self.out);
        let (ld1, ld2) = self.lds();
        let Some((pre, h)) = self.saved.get() else {
            bail!("{}: backward before forward", Self::NAME)
        };
        let prec = self.opts.precision;
        // At bf16 the MLP's GELU backward reads its kept bf16 `pre` in one fused pass;
        // `pre` is widened only for the other middle functions, or to recompute `h`.
        let fused = self.attention.is_none()
            && prec == Precision::Bf16
            && matches!(pre, CpuStorage::BF16(_));
        let wide = match (fused, h) {
            (true, Some(_)) => None,
            _ => Some(T::kept(pre)?),
        };
        // `h` as the products read it (kept bf16 is not widened for them).
        let recomputed: Vec<T> = match (h, &wide) {
            (None, Some(pre)) => gelu_forward(pre)?,
            _ => Vec::new(),
        };
        let h_held = match h {
            Some(h) => T::held(h)?,
            None => Held::Full(&recomputed[..]),
        };
        let grad = grad.contiguous()?;
        let n = Self::NAME;
        let (xv, w1v, w2v, gv) = (view(x, n)?, view(w1, n)?, view(w2, n)?, view(&grad, n)?);
        // The input as the forward's products read it: kept rounded (the tensor's
        // values may have been freed: only a view of them is taken), gathered again
        // (and rounded as the forward rounded it), or the values.
        let again = match (self.input.get(), &self.opts.input_again) {
            (None, Some(f)) => Some(f()?.contiguous()?),
            _ => None,
        };
        let again_view = again.as_ref().map(|t| view(t, n)).transpose()?;
        let again_held = again_view.as_ref().map(|v| v.held::<T>()).transpose()?;
        let again_half = again_held.and_then(|h| halve_held(prec, h));
        let xs = match (self.input.get(), again_held) {
            (Some(kept), _) => T::held(kept)?,
            (None, Some(h)) => h.or_half(again_half.as_deref()),
            (None, None) => xv.held::<T>()?,
        };
        let (w1s, w2s, g_in) = (w1v.get::<T>()?, w2v.get::<T>()?, gv.held::<T>()?);
        // The second affine map (`g`'s backward is the identity), then the middle
        // function, then the first. At bf16 each operand that two products read (`G`,
        // then `dpre`) is rounded once (a bf16 `G`, the gradient of a bf16 output, is
        // read as it is and widened only for the bias's sums).
        let sums = |on: bool, g: &[T], width: usize| on.then(|| column_sums(g, width));
        let g = widened(g_in)?;
        let half = halve_held(prec, g_in);
        let gh = g_in.or_half(half.as_deref());
        let g = &g[..];
        // A split backward (an `I`) leaves a bias's sums to the `W` where the rows it
        // keeps for it are the rows summed (not rounded to bf16 since): less for `I`,
        // which the previous stage waits for.
        let late_db2 = defer.is_some() && half.is_none() && self.bias[1];
        let db2 = sums(self.bias[1] && !late_db2, g, out);
        // Split (an `I`): what `dW2` reads, copied for the `W`.
        let (dw2, deferred2) = match defer {
            None => (
                Some(affine_weight_grad(gh, h_held, mid, out, ld2, db2, prec)?),
                None,
            ),
            Some(_) => (None, Some((Owned::of(gh), Owned::of(h_held), db2))),
        };
        let dh = affine_input_grad(gh, w2s, ld2, mid, out, prec)?;
        drop((half, recomputed));
        let middle = match (fused, pre, kernel::as_f32(&dh)) {
            (true, CpuStorage::BF16(pre), Some(dh)) => {
                let width = self.bias[0].then_some(n1);
                let (dpre, db1) = gelu_backward_bf16(pre, dh, width)?;
                let db1 = db1.map(|v| v.into_iter().map(|s| T::from_f64(s as f64)).collect());
                Some((Vec::new(), Some(dpre), db1))
            }
            _ => None,
        };
        let (dpre, half, db1) = match (middle, wide) {
            (Some(m), _) => m,
            (None, Some(pre)) => {
                let dpre = match &self.attention {
                    Some(attn) => {
                        let h = match h {
                            Some(h) => T::kept(h)?,
                            None => bail!("{n}: the attention's output was not kept"),
                        };
                        attn.backward(&pre, &h, &dh, &self.pre_shape(x.shape()))?
                    }
                    None => gelu_backward(&pre, &dh)?,
                };
                let half = halve_at(prec, &dpre);
                let late = defer.is_some() && half.is_none();
                let db1 = sums(self.bias[0] && !late, &dpre, n1);
                // With a bf16 copy, only it is read from here on: the f32 one is freed.
                let dpre = if half.is_some() { Vec::new() } else { dpre };
                (dpre, half, db1)
            }
            (None, None) => bail!("{n}: the pre-activation was not widened"),
        };
        drop(dh);
        let late_db1 = defer.is_some() && half.is_none() && self.bias[0] && db1.is_none();
        let reduce = self.opts.reduce_input_grad.as_ref();
        let dx = input_grad(
            x,
            Held::of(&dpre, half.as_deref()),
            w1s,
            ld1,
            d,
            n1,
            reduce,
            prec,
        )?;
        let dw1 = match (defer, deferred2) {
            (Some(q), Some((g2, h2, db2))) => {
                // `dpre` is this backward's own: moved, not copied.
                let (d1, x1) = (Owned::moved(dpre, half), Owned::of(xs));
                q.defer(Box::new(move || {
                    let late = |on: bool, rows: Held<T>, width: usize| -> Result<Option<Vec<T>>> {
                        on.then(|| widened(rows).map(|r| column_sums(&r, width)))
                            .transpose()
                    };
                    let db1 = db1.or(late(late_db1, d1.held(), n1)?);
                    let db2 = db2.or(late(late_db2, g2.held(), out)?);
                    let dw1 = affine_weight_grad(d1.held(), x1.held(), d, n1, ld1, db1, prec)?;
                    let dw2 = affine_weight_grad(g2.held(), h2.held(), mid, out, ld2, db2, prec)?;
                    Ok(vec![
                        kernel::tensor(dw1, (n1, ld1))?,
                        kernel::tensor(dw2, (out, ld2))?,
                    ])
                }));
                None
            }
            _ => Some(affine_weight_grad(
                Held::of(&dpre, half.as_deref()),
                xs,
                d,
                n1,
                ld1,
                db1,
                prec,
            )?),
        };
        let dw1 = dw1.map(|v| kernel::tensor(v, (n1, ld1))).transpose()?;
        let dw2 = dw2.map(|v| kernel::tensor(v, (out, ld2))).transpose()?;
        Ok((dx, dw1, dw2))
    }
}

impl CustomOp3 for Pair {
    fn name(&self) -> &'static str {
        Self::NAME
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = Self::NAME;
        match s1.dtype() {
            DType::F32 | DType::BF16 => self.forward::<f32>(
                held_slice(s1, l1, n)?,
                slice(s2, l2, n)?,
                slice(s3, l3, n)?,
                l1.shape(),
            ),
            DType::F64 => self.forward::<f64>(
                held_slice(s1, l1, n)?,
                slice(s2, l2, n)?,
                slice(s3, l3, n)?,
                l1.shape(),
            ),
            d => bail!("{n}: unsupported dtype {d:?}"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        w1: &Tensor,
        w2: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        match x.dtype() {
            DType::F32 | DType::BF16 => self.backward::<f32>(x, w1, w2, grad),
            _ => self.backward::<f64>(x, w1, w2, grad),
        }
    }
}
