//! The affine map `x · wᵀ + b` with PyTorch's `[out, in]` weight layout.

use candle_core::{bail, Result, Tensor, D};

/// `y = x · wᵀ + b` for `x` of shape `[.., in]` (rank 2 or 3, e.g. `[N, in]` or
/// `[B, T, in]`), `w` of shape `[out, in]` (PyTorch layout) and an optional bias `[out]`.
/// Returns `[.., out]`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let (out_f, in_f) = match w.dims() {
        &[o, i] => (o, i),
        d => bail!("linear: the weight must have shape [out, in], got {d:?}"),
    };
    if !(2..=3).contains(&x.rank()) || x.dim(D::Minus1)? != in_f {
        bail!(
            "linear: the input must have shape [N, {in_f}] or [B, T, {in_f}] for a weight [{out_f}, {in_f}], got {:?}",
            x.dims()
        );
    }
    if let Some(b) = b {
        if b.dims() != [out_f] {
            bail!(
                "linear: the bias must have shape [{out_f}], got {:?}",
                b.dims()
            );
        }
    }
    let y = match *x.dims() {
        [_, _] => x.matmul(&w.t()?)?,
        [bs, t, _] => x
            .reshape((bs * t, in_f))?
            .matmul(&w.t()?)?
            .reshape((bs, t, out_f))?,
        _ => unreachable!("rank checked above"),
    };
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}
