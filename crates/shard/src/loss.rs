//! Cross-entropy over vocabulary-parallel logits, without ever gathering them.
//!
//! Rank `i` holds the logits `z_i` (`[N, V/p]`) of the ids `[i·V/p, (i+1)·V/p)`. For row
//! `n` with target `t`:
//!
//! * `m = max_i max(z_i[n])`: all-reduce (max) of the local row maxima, **detached**
//!   (the shift cancels in `log Σ exp(z − m) − (z_t − m)`, so it needs no gradient);
//! * `S = Σ_i Σ_j exp(z_i[n, j] − m)`: local sums, then `g` (all-reduce sum);
//! * `T = z_t − m`, picked on the rank that owns `t` (zero elsewhere), then `g`;
//! * `loss = mean_n (log S − T)`.
//!
//! `S` and `T` travel in one all-reduce (a `[N, 2]` tensor), so the loss costs
//! **2 all-reduces forward and none backward**. Because `g`'s backward is the identity,
//! each rank's gradient is `(softmax(z)[:, own slice] − onehot(t)[:, own slice]) / N`:
//! exactly its slice of the single-device gradient.

use std::sync::Arc;

use candle_core::{DType, Device, Result, Tensor};
use switchyard_comm::{Communicator, ReduceOp};

use crate::collectives::reduce_from_region;
use crate::error::invalid;

/// The mean cross-entropy of vocabulary-parallel logits: equal, in value and gradient, to
/// `candle_nn::loss::cross_entropy` on the full `[N, V]` logits.
///
/// `local_logits` is this rank's `[N, V/p]` slice (rank `i` holds vocabulary ids
/// `[i·V/p, (i+1)·V/p)`, as produced by a column-parallel LM head without gather);
/// `targets` are the full `[N]` u32 ids, the same on every rank. Returns the scalar loss,
/// replicated on every rank; call `backward` on it on every rank.
///
/// Normalisation: the mean over the `N` rows.
pub fn vocab_parallel_cross_entropy(
    local_logits: &Tensor,
    targets: &Tensor,
    tp: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    let (n_rows, v_local) = match local_logits.dims() {
        &[n, v] => (n, v),
        d => {
            return Err(invalid(format!(
                "vocab_parallel_cross_entropy: logits must be [N, V/p], got {d:?} (flatten batch and time first)"
            )))
        }
    };
    if targets.dims() != [n_rows] || targets.dtype() != DType::U32 {
        return Err(invalid(format!(
            "vocab_parallel_cross_entropy: targets must be u32 of shape [{n_rows}], got {:?} of shape {:?}",
            targets.dtype(),
            targets.dims()
        )));
    }
    if n_rows == 0 {
        return Err(invalid("vocab_parallel_cross_entropy: no rows (N = 0)"));
    }
    let n = tp.world_size();
    let vocab = v_local * n;
    let start = tp.rank() * v_local;
    let tg = targets.to_vec1::<u32>()?;
    if let Some((row, t)) = tg.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(invalid(format!(
            "vocab_parallel_cross_entropy: target {t} of row {row} is out of range for a vocabulary of {vocab}"
        )));
    }

    let local_max = local_logits.max_keepdim(1)?.detach();
    let max = match n {
        1 => local_max,
        _ => tp.all_reduce(&local_max, ReduceOp::Max)?,
    };
    let shifted = local_logits.broadcast_sub(&max)?;
    let sum_exp = shifted.exp()?.sum_keepdim(1)?;

    // The target logit on its owning rank, zero elsewhere.
    let owned = |t: u32| (start..start + v_local).contains(&(t as usize));
    let idx: Vec<u32> = tg
        .iter()
        .map(|&t| if owned(t) { t - start as u32 } else { 0 })
        .collect();
    let mask: Vec<f32> = tg.iter().map(|&t| f32::from(u8::from(owned(t)))).collect();
    let dev = Device::Cpu;
    let idx = Tensor::from_vec(idx, (n_rows, 1), &dev)?;
    let mask = Tensor::from_vec(mask, (n_rows, 1), &dev)?.to_dtype(local_logits.dtype())?;
    let picked = shifted.gather(&idx, 1)?.mul(&mask)?;

    let both = reduce_from_region(&Tensor::cat(&[&sum_exp, &picked], 1)?, tp)?;
    let sum_exp = both.narrow(1, 0, 1)?;
    let picked = both.narrow(1, 1, 1)?;
    (sum_exp.log()? - picked)?.mean_all()
}
