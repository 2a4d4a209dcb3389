//! Cross-entropy over vocabulary-parallel logits, without ever gathering them.
//!
//! The vocabulary of `V` ids is padded to `V_p = ⌈V/p⌉·p` (see
//! [`crate::VocabParallelEmbedding`]); rank `i` holds the logits `z_i` (`[N, c]`,
//! `c = V_p/p`) of the padded ids `[i·c, (i+1)·c)`. The logits of ids `≥ V` (padding)
//! are `−∞`: they are left out of the maximum and the sum below and get a zero gradient,
//! so the loss is the cross-entropy over the `V` real ids. For row `n` with target `t`:
//!
//! * `m = max_i max_{j < V} (z_i[n])`: all-reduce (max) of the local row maxima,
//!   **detached** (the shift cancels in `log Σ exp(z − m) − (z_t − m)`, so it needs no
//!   gradient);
//! * `S = Σ_i Σ_{j < V} exp(z_i[n, j] − m)`: local sums, then `g` (all-reduce sum);
//! * `T = z_t − m`, picked on the rank that owns `t` (zero elsewhere), then `g`;
//! * `loss = mean_n (log S − T)`.
//!
//! `S` and `T` travel in one all-reduce (a `[N, 2]` tensor), so the loss costs
//! **2 all-reduces forward and none backward**. Because `g`'s backward is the identity,
//! each rank's gradient is `(softmax(z)[:, own slice] − onehot(t)[:, own slice]) / N`:
//! exactly its slice of the single-device gradient (and 0 in the padding columns).

use std::sync::Arc;

use candle_core::{DType, Result, Tensor};
use switchyard_comm::{Communicator, ReduceOp};
use switchyard_ops::OpsBackend;

use crate::error::invalid;
use crate::linear::all_reduce_hook;

/// The mean cross-entropy of vocabulary-parallel logits: equal, in value and gradient, to
/// `candle_nn::loss::cross_entropy` on the full `[N, V]` logits.
///
/// `local_logits` is this rank's `[N, ⌈V/p⌉]` slice of the logits over the padded
/// vocabulary (rank `i` holds ids `[i·c, (i+1)·c)`, `c = ⌈V/p⌉`, those `≥ V` being
/// padding), as produced by a column-parallel LM head without gather over a
/// [`crate::ShardSpec::Padded`] table; `vocab_size` is `V`; `targets` are the full `[N]`
/// u32 ids in `0..V`, the same on every rank. Returns the scalar loss, replicated on
/// every rank; call `backward` on it on every rank.
///
/// Normalisation: the mean over the `N` rows.
pub fn vocab_parallel_cross_entropy(
    local_logits: &Tensor,
    targets: &Tensor,
    vocab_size: usize,
    tp: &Arc<dyn Communicator>,
) -> Result<Tensor> {
    vocab_parallel_cross_entropy_with(local_logits, targets, vocab_size, tp, OpsBackend::Fused)
}

/// [`vocab_parallel_cross_entropy`] computed with `ops`: the fused CPU kernel or its
/// composed twin, which runs on every candle device ([`OpsBackend`]).
pub fn vocab_parallel_cross_entropy_with(
    local_logits: &Tensor,
    targets: &Tensor,
    vocab_size: usize,
    tp: &Arc<dyn Communicator>,
    ops: OpsBackend,
) -> Result<Tensor> {
    let (n_rows, v_local) = match local_logits.dims() {
        &[n, v] => (n, v),
        d => {
            return Err(invalid(format!(
                "vocab_parallel_cross_entropy: logits must be [N, ⌈V/p⌉], got {d:?} (flatten batch and time first)"
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
    let vocab = vocab_size;
    if vocab == 0 || v_local != vocab.div_ceil(n) {
        return Err(invalid(format!(
            "vocab_parallel_cross_entropy: a slice of {v_local} logits per row, but a vocabulary of {vocab} over {n} ranks has {} per rank (padded to {})",
            vocab.div_ceil(n),
            vocab.div_ceil(n) * n
        )));
    }
    let start = tp.rank() * v_local;
    let tg = targets.to_vec1::<u32>()?;
    if let Some((row, t)) = tg.iter().enumerate().find(|(_, &t)| t as usize >= vocab) {
        return Err(invalid(format!(
            "vocab_parallel_cross_entropy: target {t} of row {row} is out of range for a vocabulary of {vocab}"
        )));
    }

    if n == 1 {
        return ops.cross_entropy(local_logits, targets);
    }
    let max_hook: switchyard_ops::Reduce = {
        let tp = tp.clone();
        Arc::new(move |t: &Tensor| Ok(tp.all_reduce(t, ReduceOp::Max)?))
    };
    ops.cross_entropy_parallel(
        local_logits,
        targets,
        start,
        vocab,
        max_hook,
        all_reduce_hook(tp),
    )
}
