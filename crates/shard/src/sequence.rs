//! Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
//! Transformer Models", 2022; Megatron-LM's `--sequence-parallel`).
//!
//! Outside its parallel regions a tensor-parallel transformer block is replicated: every
//! rank runs the same LayerNorms and residual sums over the whole sequence and keeps the
//! same activations for the backward. With sequence parallelism those parts run on this
//! rank's `T/p` positions (the sequence dim, dim 1 of `[B, T, d]`; rank `r` holds
//! positions `[r·T/p, (r+1)·T/p)`), and the collectives around each region change:
//!
//! | where | without | with |
//! |---|---|---|
//! | entering (before the column-parallel product) | f: identity, all-reduce backward | ḡ: all-gather, reduce-scatter backward |
//! | leaving (after the row-parallel product) | g: all-reduce, identity backward | f̄: reduce-scatter, all-gather backward |
//!
//! An all-reduce moves what a reduce-scatter and an all-gather move together, so a
//! block's forward communicates the same bytes (its backward, with the fused CPU ops,
//! also gathers the two freed inputs again and sums the replicated parameters'
//! gradients); what it gains is that the replicated parts' work and their kept
//! activations are divided by `p`.
//!
//! Two things follow. A replicated parameter that split activations read (a LayerNorm's
//! weight and bias, the row-parallel bias) gets, on each rank, the gradient of its own
//! positions only: [`SequenceSplit::param`] puts `f` on the parameter, so its gradient
//! is summed over the group in the backward and is complete and identical on every rank,
//! as without sequence parallelism (one all-reduce of `d` values each). And the input of
//! a column-parallel product is the gathered `[B, T, d]`: where the fused CPU op runs,
//! [`SequenceSplit::around_pair`] frees it after the forward and gathers it again in the
//! backward, so that a block keeps only the `[B, T/p, d]` slice (the composed twin, the
//! path of other devices, keeps the gathered input).

use std::sync::{Arc, Mutex};

use candle_core::{DType, Result, Tensor, Var};
use switchyard_ops::{PairOptions, PairWeights};

use crate::collectives::{copy_to_region, gather_seq, reduce_scatter_seq, scatter_to_region};
use crate::param::Builder;
use crate::TpGroup;

/// The sequence dim of the activations `[B, T, d]` that sequence parallelism splits.
pub const SEQUENCE_DIM: usize = 1;

/// Whether, and over which group, a model's replicated parts split the sequence.
///
/// Off (every method the identity) unless the builder says so
/// ([`Builder::sequence_parallel`]), which it never does over a group of one rank.
#[derive(Clone)]
pub struct SequenceSplit {
    comm: Option<TpGroup>,
    /// Tensors to free once every rank of the group is done reading them: the store's
    /// one list for all of this rank's layers.
    pending: Pending,
}

/// Tensors a rank frees in place after its next completed collective over the group
/// ([`SequenceSplit::around_pair`]).
pub(crate) type Pending = Arc<Mutex<Vec<Tensor>>>;

impl SequenceSplit {
    /// The split the builder's store asks for, over `comm`.
    pub fn new(vb: &Builder, comm: TpGroup) -> Self {
        SequenceSplit {
            comm: (vb.sequence_parallel() && comm.world_size() > 1).then_some(comm),
            pending: vb.store().sequence_pending(),
        }
    }

    /// No split: every method is the identity.
    pub fn off() -> Self {
        SequenceSplit {
            comm: None,
            pending: Pending::default(),
        }
    }

    /// Lets go of what waits to be freed, without freeing it in place (no collective
    /// may have completed since): for the end of a step, so that the last pair's
    /// partial output lives no longer than the graphs that hold it.
    pub fn end_step(&self) {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
    }

    /// Frees what earlier calls left to free. Called after a collective over the group
    /// has completed on this rank, which means every rank has entered it and so has
    /// returned from the collectives before it: none reads those tensors any more (the
    /// in-process backend reads its peers' inputs where they are).
    fn free_pending(&self) -> Result<()> {
        let pending = std::mem::take(&mut *self.pending.lock().unwrap_or_else(|e| e.into_inner()));
        for t in &pending {
            crate::storage::free_in_place(t)?;
        }
        Ok(())
    }

    /// Whether the sequence is split.
    pub fn is_on(&self) -> bool {
        self.comm.is_some()
    }

    /// The position, in the whole sequence, of the first of a tensor's `local`
    /// positions: `r · local` on rank `r` of the split, 0 when off.
    pub fn first_position(&self, local: usize) -> usize {
        match &self.comm {
            Some(c) => c.rank() * local,
            None => 0,
        }
    }

    /// Enters the split: a replicated `[B, T, d]` to this rank's `[B, T/p, d]` (no
    /// communication); the backward all-gathers the gradient. `T` must divide by `p`.
    pub fn split(&self, x: &Tensor) -> Result<Tensor> {
        match &self.comm {
            Some(c) => scatter_to_region(x, SEQUENCE_DIM, c),
            None => Ok(x.clone()),
        }
    }

    /// Leaves the split: this rank's `[B, T/p, d]` to the whole `[B, T, d]` (an
    /// all-gather); the backward reduce-scatters the gradient, which sums the ranks'
    /// partial input gradients of the column-parallel product that reads it (`f`'s work).
    pub fn gather(&self, x: &Tensor) -> Result<Tensor> {
        match &self.comm {
            Some(c) => gather_seq(x, SEQUENCE_DIM, c),
            None => Ok(x.clone()),
        }
    }

    /// A replicated parameter as split activations read it: `f` on it (identity forward,
    /// all-reduce of its gradient backward), so that its gradient sums every rank's
    /// positions.
    pub fn param(&self, w: &Tensor) -> Result<Tensor> {
        match &self.comm {
            Some(c) => copy_to_region(w, c),
            None => Ok(w.clone()),
        }
    }

    /// Runs a column-then-row pair `run` (a fused op with no collectives of its own and
    /// without the row-parallel `bias`, [`crate::pair::pair_options`]) on split
    /// activations: gathers `x`, runs the pair, reduce-scatters its partial output and
    /// adds the bias (through [`SequenceSplit::param`]). When the fused op runs, it gets
    /// its input in the backward by gathering `x` again (`PairOptions::input_again`),
    /// and the gathered input is freed after the forward: what stays is `x`, this rank's
    /// positions. Off, `run(x, opts)` (whose op then has `f`, `g` and the bias).
    pub(crate) fn around_pair(
        &self,
        x: &Tensor,
        bias: Option<&Var>,
        (w, mut opts): (&PairWeights, PairOptions),
        run: impl FnOnce(&Tensor, &PairWeights, &PairOptions) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let Some(c) = &self.comm else {
            return run(x, w, &opts);
        };
        let full = self.gather(x)?;
        self.free_pending()?;
        // Only a tracked input has a backward to gather it again for; an untracked one's
        // `full` may be the in-process all-gather's output, which every rank shares.
        // bf16 activations are kept as they are (half the bytes already).
        let regathers = x.track_op()
            && matches!(full.dtype(), DType::F32 | DType::F64)
            && w.runs_fused(&full, &opts);
        if regathers {
            let (slice, c) = (x.detach(), c.clone());
            opts.input_again = Some(Arc::new(move || Ok(c.all_gather(&slice, SEQUENCE_DIM)?)));
        }
        let partial = run(&full, w, &opts)?;
        let free = |t: &Tensor| match regathers {
            true => crate::storage::free_in_place(t),
            false => Ok(()),
        };
        free(&full)?;
        // The graph holds the tensors below, but no backward reads their values (the
        // reduce-scatter's all-gathers the gradient, the bias's sums it). The peers may
        // still read `partial` after this rank's reduce-scatter returns: it is freed
        // after the next gather.
        let y = reduce_scatter_seq(&partial, SEQUENCE_DIM, c)?;
        if regathers {
            self.pending
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(partial);
        }
        let Some(b) = bias else {
            return Ok(y);
        };
        let out = switchyard_ops::add_bias(&y, &self.param(b.as_tensor())?, opts.backend)?;
        free(&y)?;
        Ok(out)
    }
}
