//! LayerNorm over the last dim, differentiable in the input, the weight and the bias.

use candle_core::{bail, Result, Tensor, D};

/// LayerNorm over the last dim of `x`:
/// `y = (x − mean(x)) / sqrt(var(x) + eps) · weight + bias`, where `var` is the biased
/// (population) variance, as in PyTorch. `weight` and `bias` have shape `[d]`, `d` the
/// size of the last dim of `x`. GPT-2 uses `eps = 1e-5`.
///
/// Every input receives a gradient (candle-nn's `ops::layer_norm` has no backward).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    if weight.dims() != [d] || bias.dims() != [d] {
        bail!(
            "layer_norm: weight {:?} and bias {:?} must both have shape [{d}] (the last dim of x {:?})",
            weight.dims(),
            bias.dims(),
            x.dims()
        );
    }
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let rstd = (var + eps)?.sqrt()?.recip()?;
    xc.broadcast_mul(&rstd)?
        .broadcast_mul(weight)?
        .broadcast_add(bias)
}
