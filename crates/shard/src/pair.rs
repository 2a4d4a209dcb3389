//! A column-parallel layer followed by a row-parallel one (attention, MLP), run as one
//! fused op of `switchyard-ops` ([`switchyard_ops::PairWeights`]): how the two are
//! built ([`column_row_pair`]), their collectives ([`pair_options`]: the `f` and the
//! `g`), and their weights fused once per step ([`StepCache`]).

use std::sync::Arc;

use candle_core::{Result, Tensor, Var};
use switchyard_comm::Communicator;
use switchyard_ops::{DeferredWeights, PairOptions, PairWeights};

use crate::linear::{
    all_reduce_hook, ColumnConfig, ColumnParallelLinear, RowConfig, RowParallelLinear,
};
use crate::param::Builder;
use crate::sequence::SequenceSplit;

/// The weights of a column-then-row pair fused with their biases
/// ([`switchyard_ops::PairWeights`]) for the duration of one step (see
/// `ParallelMlp::begin_step`): empty outside a step, so nothing derived from the
/// parameters survives their update.
///
/// Under sequence parallelism the row-parallel bias is left out of the fused weights: it
/// is added after the reduce-scatter ([`crate::SequenceSplit`]).
pub(crate) struct StepCache {
    cache: std::sync::Mutex<Option<PairWeights>>,
    /// Whether the row-parallel layer's bias is fused with its weight.
    row_bias: bool,
}

impl StepCache {
    /// A cache fusing the row-parallel bias unless `seq` splits the sequence.
    pub(crate) fn new(seq: &SequenceSplit) -> Self {
        StepCache {
            cache: Default::default(),
            row_bias: !seq.is_on(),
        }
    }
    fn lock(&self) -> std::sync::MutexGuard<'_, Option<PairWeights>> {
        self.cache.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn row_bias<'a>(&self, row: &'a RowParallelLinear) -> Option<&'a Var> {
        row.bias().filter(|_| self.row_bias)
    }
    /// Fuses `col`'s and `row`'s weights for every call of [`StepCache::weights`] until
    /// [`StepCache::end`].
    ///
    /// Called again within a step (after [`StepCache::release`]), it writes the weights
    /// fused now into the tensors fused before, in place: the graphs of earlier
    /// microbatches saved those.
    pub(crate) fn begin(&self, col: &ColumnParallelLinear, row: &RowParallelLinear) -> Result<()> {
        let mut cached = self.lock();
        match &*cached {
            Some(old) => {
                // Where nothing is fused the tensors are the weights themselves.
                let parts = [
                    (col.weight().as_tensor(), col.bias().map(|b| b.as_tensor())),
                    (
                        row.weight().as_tensor(),
                        self.row_bias(row).map(|b| b.as_tensor()),
                    ),
                ];
                for ((o, (w, b)), copied) in old.fused().iter().zip(parts).zip(old.copied()) {
                    if copied {
                        refill_fused(o, w, b)?;
                    }
                }
            }
            None => *cached = Some(pair_weights(col, row, self.row_bias(row))?),
        }
        Ok(())
    }
    /// Frees the fused weights' values in place, keeping the tensors until
    /// [`StepCache::begin`] fills them again or [`StepCache::end`] drops them.
    pub(crate) fn release(&self) -> Result<()> {
        if let Some(w) = &*self.lock() {
            for (t, copied) in w.fused().iter().zip(w.copied()) {
                if copied {
                    crate::storage::free_in_place(t)?;
                }
            }
        }
        Ok(())
    }
    pub(crate) fn end(&self) {
        *self.lock() = None;
    }
    /// The weights fused at [`StepCache::begin`], or fused now outside a step.
    pub(crate) fn weights(
        &self,
        col: &ColumnParallelLinear,
        row: &RowParallelLinear,
    ) -> Result<PairWeights> {
        let cached = self.lock().clone();
        match cached {
            Some(w) => Ok(w),
            None => pair_weights(col, row, self.row_bias(row)),
        }
    }
}

/// Writes `[w | b]` (the bias as a last column; `w` alone without one) into `fused`, in
/// place, without an intermediate copy.
fn refill_fused(fused: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<()> {
    if fused.dtype() != candle_core::DType::F32 {
        let fresh = match b {
            Some(b) => Tensor::cat(&[w, &b.unsqueeze(1)?], 1)?,
            None => w.contiguous()?,
        };
        return crate::storage::fill_in_place(fused, &fresh);
    }
    let (rows, cols) = w.dims2()?;
    let ld = cols + usize::from(b.is_some());
    use crate::storage::with_f32_values;
    crate::storage::fill_f32_with(fused, |dst| {
        with_f32_values(w, |w| {
            for (d, s) in dst.chunks_mut(ld).zip(w.chunks(cols)) {
                d[..cols].copy_from_slice(s);
            }
            Result::Ok(())
        })?;
        if let Some(b) = b {
            with_f32_values(b, |b| {
                for (r, &x) in b.iter().enumerate().take(rows) {
                    dst[r * ld + cols] = x;
                }
                Result::Ok(())
            })?;
        }
        Ok(())
    })
}

fn pair_weights(
    col: &ColumnParallelLinear,
    row: &RowParallelLinear,
    row_bias: Option<&Var>,
) -> Result<PairWeights> {
    PairWeights::new(
        col.weight().as_tensor(),
        col.bias().map(|b| b.as_tensor()),
        row.weight().as_tensor(),
        row_bias.map(|b| b.as_tensor()),
    )
}

/// The collectives of a column-then-row pair fused into one op: `f` (all-reduce of the
/// input gradient) and `g` (all-reduce of the output); none on a group of one, and none
/// under sequence parallelism, whose collectives are outside the op
/// ([`SequenceSplit::around_pair`]). The backend and precision are the first
/// (column-parallel) layer's.
pub(crate) fn pair_options(first: &ColumnParallelLinear, seq: &SequenceSplit) -> PairOptions {
    let comm = first.comm();
    let hook = (comm.world_size() > 1 && !seq.is_on()).then(|| all_reduce_hook(comm));
    PairOptions {
        reduce_output: hook.clone(),
        reduce_input_grad: hook,
        backend: first.ops(),
        recompute_gelu: false,
        precision: first.precision(),
        defer: None,
        input_again: None,
    }
}

/// Megatron's pairing inside a transformer sub-layer: a column-parallel `first`
/// (`d → col_out`, with bias, `blocks` fused sub-blocks, output left split) feeding a
/// row-parallel `c_proj` (`row_in → d`, input already split, bias added after the sum).
/// `vb` is the sub-layer's builder (`….attn` or `….mlp`).
pub(crate) fn column_row_pair(
    vb: &Builder,
    comm: Arc<dyn Communicator>,
    first: &str,
    d: usize,
    (col_out, blocks, row_in): (usize, usize, usize),
    init: crate::LayerInit,
) -> Result<(ColumnParallelLinear, RowParallelLinear)> {
    let column = ColumnParallelLinear::new(
        &vb.pp(first),
        comm.clone(),
        d,
        col_out,
        ColumnConfig {
            bias: true,
            gather_output: false,
            blocks,
            weight_init: init.weight,
            bias_init: init.bias,
        },
    )?;
    let row = RowParallelLinear::new(
        &vb.pp("c_proj"),
        comm,
        row_in,
        d,
        RowConfig {
            bias: true,
            input_is_parallel: true,
            weight_init: init.proj_weight,
            bias_init: init.bias,
        },
    )?;
    Ok((column, row))
}

/// The weights' gradients of a pair from its oldest deferred weight products (a split
/// backward's `W`, [`switchyard_ops::DeferredWeights`]): `d[w1 | b1]` and `d[w2 | b2]`
/// split into each parameter's, as the fused tensors' own backward would; none when
/// nothing is deferred.
pub(crate) fn pair_backward_weights(
    split: &DeferredWeights,
    col: &ColumnParallelLinear,
    row: &RowParallelLinear,
) -> Result<Vec<(Var, Tensor)>> {
    let Some(grads) = split.run_oldest()? else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(4);
    for (g, (w, b)) in grads
        .into_iter()
        .zip([(col.weight(), col.bias()), (row.weight(), row.bias())])
    {
        let cols = w.as_tensor().dim(1)?;
        match b {
            Some(b) if g.dim(1)? == cols + 1 => {
                out.push((w.clone(), g.narrow(1, 0, cols)?.contiguous()?));
                out.push((b.clone(), g.narrow(1, cols, 1)?.squeeze(1)?.contiguous()?));
            }
            _ => out.push((w.clone(), g)),
        }
    }
    Ok(out)
}
