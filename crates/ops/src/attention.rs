//! Causal scaled-dot-product self-attention, differentiable in q, k and v.

use candle_core::{bail, DType, Device, Result, Tensor, D};

/// `softmax(q · kᵀ / √hd + M) · v` for `q`, `k`, `v` of shape `(B, H, T, hd)`, where the
/// additive causal mask `M` is 0 where the key position is at or before the query
/// position and −∞ after it. Returns `(B, H, T, hd)`.
///
/// The softmax subtracts the detached row maximum before `exp` (exact gradient, no
/// overflow); every row has at least its diagonal unmasked, so no row is all −∞.
pub fn causal_self_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (_, _, t, hd) = q.dims4()?;
    if k.dims() != q.dims() || v.dims() != q.dims() {
        bail!(
            "causal_self_attention: q {:?}, k {:?} and v {:?} must all have shape (B, H, T, hd)",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    let q = q.contiguous()?;
    let k = k.contiguous()?;
    let v = v.contiguous()?;
    let scale = 1.0 / (hd as f64).sqrt();
    let scores = (q.matmul(&k.t()?)? * scale)?;
    let mask = causal_mask(t, scores.dtype(), scores.device())?;
    let scores = scores.broadcast_add(&mask)?;
    let max = scores.max_keepdim(D::Minus1)?.detach();
    let e = scores.broadcast_sub(&max)?.exp()?;
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
    p.matmul(&v)
}

/// A `(t, t)` tensor with 0 at and below the diagonal and −∞ above it.
fn causal_mask(t: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(m, (t, t), device)?.to_dtype(dtype)
}
