//! Mean cross-entropy over rows of logits.

use candle_core::{bail, DType, Result, Tensor};

/// `mean_i (logsumexp(logits_i) − logits_i[targets_i])` for `logits` of shape `[N, V]`
/// and `targets` of shape `[N]` (dtype `u32`, each in `0..V`). Returns a scalar.
///
/// Numerically stable: the detached row maximum is subtracted before `exp`. The gradient
/// with respect to the logits is `(softmax(logits) − onehot(targets)) / N`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let (n, v) = match logits.dims() {
        &[n, v] => (n, v),
        d => bail!("cross_entropy: logits must have shape [N, V], got {d:?}"),
    };
    if targets.dims() != [n] || targets.dtype() != DType::U32 {
        bail!(
            "cross_entropy: targets must be u32 of shape [{n}], got {:?} of shape {:?}",
            targets.dtype(),
            targets.dims()
        );
    }
    if n == 0 {
        bail!("cross_entropy: no rows (N = 0), the mean is undefined");
    }
    if let Some((row, t)) = targets
        .to_vec1::<u32>()?
        .into_iter()
        .enumerate()
        .find(|&(_, t)| t as usize >= v)
    {
        bail!("cross_entropy: target {t} of row {row} is out of range for {v} classes");
    }
    let max = logits.max_keepdim(1)?.detach();
    let shifted = logits.broadcast_sub(&max)?;
    let lse = shifted.exp()?.sum_keepdim(1)?.log()?;
    let picked = shifted.gather(&targets.unsqueeze(1)?.contiguous()?, 1)?;
    (lse - picked)?.mean_all()
}
