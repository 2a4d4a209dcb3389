//! The composed twins of the fused ops: the same math as compositions of candle's own
//! differentiable operations, so they run on every candle device (CPU, CUDA, Metal) and
//! in every dtype. Same inputs, outputs and parameter layout as the fused functions of
//! the crate root; the fused kernels are an optimisation of the CPU path, tested against
//! these twins (`tests/composed.rs`).
//!
//! Candle keeps one graph node (and one gradient) per primitive here, so these cost more
//! memory traffic than the fused kernels; [`crate::OpsBackend`] chooses between the two.
//!
//! The tensor-parallel hooks are one small custom op (`Hook`), which has a forward for
//! every device (a copy through candle's backend traits): identity forward with a
//! collective on the gradient (`f`), or a collective forward with the identity backward
//! (`g`).

use std::sync::Mutex;

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, DType, Layout, MetalStorage, Result, Shape, Storage,
    Tensor, D,
};

use crate::{LinearOptions, PairOptions, PairWeights, Precision, Reduce};

const GELU_C: f64 = 0.797_884_560_802_865_4; // √(2/π)
const GELU_A: f64 = 0.044_715;

/// GELU, tanh approximation: `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))`, from
/// candle primitives (its backward is candle's exact chain rule through `tanh`).
pub fn gelu(x: &Tensor) -> Result<Tensor> {
    let inner = ((x.sqr()? * GELU_A)? + 1.0)?.mul(x)?;
    let t = (inner * GELU_C)?.tanh()?;
    ((t + 1.0)? * 0.5)?.mul(x)
}

/// LayerNorm over the last dim (biased variance), as [`crate::layer_norm`].
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    xc.broadcast_mul(&rstd)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
}

/// `x · wᵀ + b` with the options of [`LinearOptions`], as [`crate::linear_with`] (shapes
/// checked by the caller).
pub(crate) fn linear_with(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    opts: &LinearOptions,
) -> Result<Tensor> {
    let in_f = w.dim(1)?;
    let mut dims = x.dims().to_vec();
    let rows = x.elem_count() / in_f.max(1);
    let mut x = x.reshape((rows, in_f))?;
    if let Some(r) = &opts.reduce_input_grad {
        x = reduce_grad(&x, r)?;
    }
    let bf16 = opts.precision == Precision::Bf16;
    // At bf16, as the fused op: the product of the rounded operands, and the gradient
    // that reaches the product rounded too (a bf16 product reads it rounded); the
    // gradients of `x` and `w` themselves stay f32.
    let mut y = match bf16 {
        true => round_grad(&round_value(&x)?.matmul(&round_value(w)?.t()?)?)?,
        false => x.matmul(&w.t()?)?,
    };
    if let Some(r) = &opts.reduce_output {
        y = reduce_value(&y, r)?;
    }
    if let Some(b) = b {
        y = y.broadcast_add(b)?;
    }
    *dims.last_mut().expect("rank ≥ 2") = w.dim(0)?;
    let y = y.reshape(dims)?;
    match (opts.gelu, bf16) {
        (true, true) => gelu(&round_value(&y)?),
        (true, false) => gelu(&y),
        (false, _) => Ok(y),
    }
}

/// `x` rounded to the nearest bf16, as the same dtype (candle's `to_dtype` also rounds
/// the gradient on its way back).
fn round_bf16(x: &Tensor) -> Result<Tensor> {
    x.to_dtype(DType::BF16)?.to_dtype(x.dtype())
}

/// `x` rounded to bf16 in value; the gradient passes through unrounded.
fn round_value(x: &Tensor) -> Result<Tensor> {
    x + (round_bf16(x)? - x)?.detach()
}

/// `x` itself in value (`r − r + x` is exact); its gradient rounded to bf16 on the way
/// back.
fn round_grad(x: &Tensor) -> Result<Tensor> {
    let r = round_bf16(x)?;
    (&r - r.detach())? + x.detach()
}

/// The column-then-row pair of [`crate::mlp_with`] (`heads = None`, GELU in the middle)
/// or [`crate::attention_block_with`] (attention over `heads` heads in the middle).
pub(crate) fn pair(
    x: &Tensor,
    w: &PairWeights,
    heads: Option<usize>,
    opts: &PairOptions,
) -> Result<Tensor> {
    let (first, second) = pair_halves(opts, heads.is_none());
    let mut h = linear_with(x, &w.w[0], w.b[0].as_ref(), &first)?;
    if let Some(n) = heads {
        if opts.precision == Precision::Bf16 {
            h = round_value(&h)?;
        }
        h = causal_attention_packed(&h, n)?;
    }
    linear_with(&h, &w.w[1], w.b[1].as_ref(), &second)
}

/// The linear options of the two halves of a pair.
pub(crate) fn pair_halves(opts: &PairOptions, gelu: bool) -> (LinearOptions, LinearOptions) {
    let first = LinearOptions {
        gelu,
        reduce_input_grad: opts.reduce_input_grad.clone(),
        precision: opts.precision,
        ..LinearOptions::default()
    };
    let second = LinearOptions {
        reduce_output: opts.reduce_output.clone(),
        precision: opts.precision,
        ..LinearOptions::default()
    };
    (first, second)
}

/// `softmax(q · kᵀ / √hd + M) · v` with the causal mask `M`, as
/// [`crate::causal_self_attention`]; `(B, H, T, hd)` in and out.
pub fn causal_self_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (_, _, t, hd) = q.dims4()?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let scale = 1.0 / (hd as f64).sqrt();
    let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?;
    let scores = scores.broadcast_add(&causal_mask(t, scores.dtype(), scores.device())?)?;
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)
}

/// Causal self-attention over a packed `[B, T, 3·H·hd]` projection (columns `q | k | v`),
/// as [`crate::causal_attention_packed`]. Returns `[B, T, H·hd]`.
pub fn causal_attention_packed(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    let (b, t, c) = qkv.dims3()?;
    if n_head == 0 || c == 0 || c % (3 * n_head) != 0 {
        bail!(
            "causal_attention_packed: the last dim of qkv {:?} must be 3 × n_head ({n_head}) × head_dim, with n_head and head_dim at least 1",
            qkv.dims()
        );
    }
    let hd = c / (3 * n_head);
    if b == 0 || t == 0 {
        return Tensor::zeros((b, t, n_head * hd), qkv.dtype(), qkv.device());
    }
    let qkv = qkv.reshape((b, t, 3, n_head, hd))?;
    let part = |i: usize| qkv.narrow(2, i, 1)?.squeeze(2)?.transpose(1, 2);
    let y = causal_self_attention(&part(0)?, &part(1)?, &part(2)?)?;
    y.transpose(1, 2)?.reshape((b, t, n_head * hd))
}

/// A `(t, t)` tensor on `device` with 0 at and below the diagonal and −∞ above it.
pub(crate) fn causal_mask(t: usize, dtype: DType, device: &candle_core::Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(m, (t, t), device)?.to_dtype(dtype)
}

/// Mean cross-entropy of `[N, V]` logits and `[N]` u32 targets (checked by the caller), as
/// [`crate::cross_entropy`].
pub(crate) fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let max = logits.max_keepdim(1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(1)?.log()?;
    let targets = targets.to_device(logits.device())?;
    let picked = shifted.gather(&targets.unsqueeze(1)?.contiguous()?, 1)?;
    (lse - picked)?.mean_all()
}

/// Cross-entropy over a vocabulary-parallel slice, as [`crate::cross_entropy_parallel`]
/// (arguments checked by the caller; `tg` the targets on the host). The same collectives
/// in the same order: `reduce_max` on the `[N]` row maxima, then `reduce_sum` once on the
/// `[N, 2]` pairs (sum of exponentials, target logit), nothing backward.
pub(crate) fn cross_entropy_parallel(
    z: &Tensor,
    tg: &[u32],
    start: usize,
    vocab_size: usize,
    reduce_max: &Reduce,
    reduce_sum: &Reduce,
) -> Result<Tensor> {
    let (n, width) = z.dims2()?;
    let dev = z.device();
    let real = vocab_size.saturating_sub(start).min(width);
    // The local row maxima over the real columns (−∞ for a slice of padding only).
    let local_max = match real {
        0 => Tensor::full(f32::NEG_INFINITY, n, dev)?.to_dtype(z.dtype())?,
        _ => z.narrow(1, 0, real)?.max_keepdim(1)?.squeeze(1)?.detach(),
    };
    let m = reduce_max(&local_max)?.reshape((n, 1))?.detach();
    let (s, picked) = match real {
        0 => (
            Tensor::zeros((n, 1), z.dtype(), dev)?,
            Tensor::zeros((n, 1), z.dtype(), dev)?,
        ),
        _ => {
            let zr = z.narrow(1, 0, real)?.broadcast_sub(&m)?;
            let s = zr.exp()?.sum_keepdim(1)?;
            // The target's column when it lies in this slice (else column 0, masked out).
            let (idx, mask): (Vec<u32>, Vec<f32>) = tg
                .iter()
                .map(|&t| match (t as usize).checked_sub(start) {
                    Some(j) if j < real => (j as u32, 1.0),
                    _ => (0, 0.0),
                })
                .unzip();
            let idx = Tensor::from_vec(idx, (n, 1), dev)?;
            let mask = Tensor::from_vec(mask, (n, 1), dev)?.to_dtype(z.dtype())?;
            (s, zr.gather(&idx, 1)?.mul(&mask)?)
        }
    };
    let both = reduce_value(&Tensor::cat(&[&s, &picked], 1)?, reduce_sum)?;
    let (s, picked) = (both.narrow(1, 0, 1)?, both.narrow(1, 1, 1)?);
    (s.log()? - picked)?.mean_all()
}

/// Megatron's `f` around a hook: the identity forward, `r` on the gradient backward.
pub(crate) fn reduce_grad(x: &Tensor, r: &Reduce) -> Result<Tensor> {
    if !x.track_op() {
        return Ok(x.clone());
    }
    apply_hook(x, None, Some(r.clone()), "switchyard-reduce-grad")
}

/// Megatron's `g` around a hook: `r` forward (on the detached value), the identity
/// backward.
pub(crate) fn reduce_value(x: &Tensor, r: &Reduce) -> Result<Tensor> {
    let reduced = r(&x.detach())?;
    if !x.track_op() {
        return Ok(reduced);
    }
    if reduced.dims() != x.dims() {
        bail!(
            "switchyard-reduce: the collective changed the shape {:?} to {:?}",
            x.dims(),
            reduced.dims()
        );
    }
    apply_hook(x, Some(reduced), None, "switchyard-reduce")
}

fn apply_hook(
    x: &Tensor,
    result: Option<Tensor>,
    backward: Option<Reduce>,
    name: &'static str,
) -> Result<Tensor> {
    x.apply_op1(Hook {
        name,
        result: Mutex::new(result),
        backward,
    })
}

/// A differentiable identity (or a precomputed forward result) with an optional
/// collective on the gradient; see [`reduce_grad`] and [`reduce_value`].
struct Hook {
    name: &'static str,
    /// The forward value, when it is not the input; taken by the forward.
    result: Mutex<Option<Tensor>>,
    backward: Option<Reduce>,
}

/// A fresh copy of `s` viewed through `l`, on the device of `s`.
pub(crate) fn copy<B>(s: &B, l: &Layout) -> Result<B>
where
    B: BackendStorage,
    B::Device: BackendDevice<Storage = B>,
{
    let mut dst = s.device().zeros_impl(l.shape(), s.dtype())?;
    s.copy_strided_src(&mut dst, 0, l)?;
    Ok(dst)
}

impl Hook {
    /// The forward value: a copy of the precomputed result, or of the input.
    fn forward<B>(&self, s: &B, l: &Layout, pick: fn(&Storage) -> Option<&B>) -> Result<(B, Shape)>
    where
        B: BackendStorage,
        B::Device: BackendDevice<Storage = B>,
    {
        let result = self.result.lock().unwrap_or_else(|e| e.into_inner()).take();
        match result {
            None => Ok((copy(s, l)?, l.shape().clone())),
            Some(r) => {
                let (storage, layout) = r.storage_and_layout();
                match pick(&storage) {
                    Some(c) => Ok((copy(c, layout)?, layout.shape().clone())),
                    None => bail!(
                        "{}: the collective returned a tensor on another device",
                        self.name
                    ),
                }
            }
        }
    }
}

impl CustomOp1 for Hook {
    fn name(&self) -> &'static str {
        self.name
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(s, l, |s| match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        })
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        self.forward(s, l, |s| match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        })
    }

    fn metal_fwd(&self, s: &MetalStorage, l: &Layout) -> Result<(MetalStorage, Shape)> {
        self.forward(s, l, |s| match s {
            Storage::Metal(c) => Some(c),
            _ => None,
        })
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        match &self.backward {
            Some(r) => Ok(Some(r(grad)?)),
            None => Ok(Some(grad.clone())),
        }
    }
}
