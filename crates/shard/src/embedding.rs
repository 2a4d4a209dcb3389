//! The vocabulary-parallel token embedding.
//!
//! The table `E` (`[V, d]`) is split by rows. The group size `p` need not divide `V`: as
//! in Megatron-LM the vocabulary is padded to
//!
//! ```text
//! V_p = ⌈V/p⌉·p,   c = V_p/p rows per rank,
//! ```
//!
//! and rank `i` holds rows `[i·c, (i+1)·c)` of the padded table `E_p = [E; 0]`: the real
//! rows `[i·c, min((i+1)·c, V))` followed by zero rows up to `c` (only the last rank or
//! ranks hold padding; a rank may hold padding only, as `V = 5, p = 4`: `c = 2`, rank 3
//! holds rows 6 and 7). This is [`ShardSpec::Padded`]: outside the rank — the parameter's
//! full shape, its initial values, checkpoints, gathers — the table is `[V, d]` and the
//! padding does not exist.
//!
//! Each rank looks up the ids of its range, writes zeros for the others, and `g`
//! (all-reduce forward, identity backward) sums the `p` partial results: every id is
//! owned by exactly one rank, so the sum is the full lookup. In the backward pass each
//! rank's gradient reaches only the rows it owns.
//!
//! **Why the padding is inert.** No id `≥ V` exists (the lookup refuses it), so no padding
//! row is ever looked up; the LM head's logits of padding rows are left out of the
//! softmax (they count as `−∞` in [`crate::vocab_parallel_cross_entropy`]), so their
//! gradient is exactly 0. A zero row with a zero gradient stays zero under AdamW (the
//! decay `p ← p − lr·wd·p` and the update `m̂/(√v̂ + ε)` are both 0), so the padding
//! rows are zero forever and never change the loss.
//!
//! *Why padding rather than uneven shards* (rank `i` holding `min(c, V − i·c)` rows): every
//! rank's shard keeps the same shape, so the all-gathers and reduce-scatters of the
//! collectives (which require equal shapes on every rank) and the column-parallel LM head
//! work unchanged, and no rank ever holds an empty tensor. The price is at most `p − 1`
//! zero rows.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Module, Result, Tensor, Var};
use switchyard_comm::Communicator;

use crate::collectives::reduce_from_region;
use crate::error::invalid;
use crate::linear::{check_group, ColumnParallelLinear};
use crate::param::{Builder, Init};
use crate::sequence::SequenceSplit;
use crate::spec::ShardSpec;

/// A token embedding whose table is split over the (padded) vocabulary.
///
/// Parameter under the builder's prefix: `weight` (full `[V, d]`,
/// [`ShardSpec::Padded`]` { dim: 0, size: V }`, local `[⌈V/p⌉, d]`). Collectives: 1
/// all-reduce forward, 0 backward.
pub struct VocabParallelEmbedding {
    name: String,
    weight: Var,
    comm: Arc<dyn Communicator>,
    vocab_size: usize,
    dim: usize,
    range: Range<usize>,
    /// The builder's sequence split, for a tied LM head
    /// ([`VocabParallelEmbedding::tied_lm_head`]).
    seq: SequenceSplit,
}

impl VocabParallelEmbedding {
    /// Creates `weight` through `vb` (e.g. `vb.pp("transformer.wte")`). Any vocabulary
    /// size works with any group size: the table is padded to a multiple of the group
    /// size (see the module docs).
    pub fn new(
        vb: &Builder,
        comm: Arc<dyn Communicator>,
        vocab_size: usize,
        dim: usize,
        init: Init,
    ) -> Result<Self> {
        let name = vb.prefix().to_string();
        check_group(&name, vb, comm.as_ref())?;
        if vocab_size == 0 {
            return Err(invalid(format!("{name}: a vocabulary of 0 tokens")));
        }
        let spec = ShardSpec::padded(0, vocab_size);
        let weight = vb.param("weight", &[vocab_size, dim], spec, init)?;
        let (per, real) = spec
            .padded_rows(comm.rank(), comm.world_size())
            .expect("a padded spec");
        let start = comm.rank() * per;
        let seq = SequenceSplit::new(vb, comm.clone());
        Ok(VocabParallelEmbedding {
            name,
            weight,
            comm,
            vocab_size,
            dim,
            range: start..start + real,
            seq,
        })
    }

    /// Looks up `ids` (u32, any shape `S`, the same on every rank) and returns `S × [d]`,
    /// replicated. An id out of `0..V` is an error.
    pub fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        if ids.dtype() != DType::U32 {
            return Err(invalid(format!(
                "{}: token ids must be u32, got {:?}",
                self.name,
                ids.dtype()
            )));
        }
        let flat = ids.flatten_all()?.to_vec1::<u32>()?;
        if let Some(bad) = flat.iter().find(|&&i| i as usize >= self.vocab_size) {
            return Err(invalid(format!(
                "{}: token id {bad} out of range for a vocabulary of {}",
                self.name, self.vocab_size
            )));
        }
        let mut out_shape = ids.dims().to_vec();
        out_shape.push(self.dim);
        let w = self.weight.as_tensor();
        let dev = w.device().clone();
        if self.comm.world_size() == 1 {
            let idx = Tensor::from_vec(flat, ids.elem_count(), &dev)?;
            return w.index_select(&idx, 0)?.reshape(out_shape);
        }
        let (lo, hi) = (self.range.start as u32, self.range.end as u32);
        let local: Vec<u32> = flat
            .iter()
            .map(|&i| if (lo..hi).contains(&i) { i - lo } else { 0 })
            .collect();
        let mask: Vec<f32> = flat
            .iter()
            .map(|i| f32::from(u8::from((lo..hi).contains(i))))
            .collect();
        let n = flat.len();
        let idx = Tensor::from_vec(local, n, &dev)?;
        let mask = Tensor::from_vec(mask, (n, 1), &dev)?.to_dtype(w.dtype())?;
        let partial = w.index_select(&idx, 0)?.broadcast_mul(&mask)?;
        reduce_from_region(&partial, &self.comm)?.reshape(out_shape)
    }

    /// This rank's table shard `[⌈V/p⌉, d]` (its last rows may be padding): tie an LM
    /// head to it with
    /// [`VocabParallelEmbedding::tied_lm_head`] or [`ColumnParallelLinear::from_weight`].
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The token ids this rank owns (the real rows of its shard; empty on a rank that
    /// holds padding only).
    pub fn vocab_range(&self) -> Range<usize> {
        self.range.clone()
    }

    /// The full vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The embedding width.
    pub fn embedding_dim(&self) -> usize {
        self.dim
    }

    /// The layer's name (its builder prefix).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// An LM head sharing this table: `logits_local = f(h) · E_iᵀ`, `[.., ⌈V/p⌉]` (the
    /// columns of padding rows are 0), no bias, no gather; feed it to
    /// [`crate::vocab_parallel_cross_entropy`] with the vocabulary size, which leaves the
    /// padding out. Its name is `lm_head (tied to <name>.weight)`.
    pub fn tied_lm_head(&self) -> Result<ColumnParallelLinear> {
        ColumnParallelLinear::from_weight(
            format!("lm_head (tied to {}.weight)", self.name),
            self.weight.clone(),
            self.comm.clone(),
            false,
        )
        .map(|h| h.with_sequence_split(self.seq.clone()))
    }
}

impl Module for VocabParallelEmbedding {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        VocabParallelEmbedding::forward(self, xs)
    }
}
