//! The vocabulary-parallel token embedding.
//!
//! The table `E` (`[V, d]`) is split by rows: rank `i` holds `E_i`, the rows of the
//! token ids in `[i·V/p, (i+1)·V/p)`. Each rank looks up the ids of its range, writes
//! zeros for the others, and `g` (all-reduce forward, identity backward) sums the `p`
//! partial results: every id is owned by exactly one rank, so the sum is the full lookup.
//! In the backward pass each rank's gradient reaches only the rows it owns.

use std::ops::Range;
use std::sync::Arc;

use candle_core::{DType, Device, Module, Result, Tensor, Var};
use switchyard_comm::Communicator;

use crate::collectives::reduce_from_region;
use crate::error::{invalid, ShardError};
use crate::linear::{check_group, ColumnParallelLinear};
use crate::param::{Builder, Init};
use crate::spec::ShardSpec;

/// A token embedding whose table is split over the vocabulary.
///
/// Parameter under the builder's prefix: `weight` (full `[V, d]`, `Split { dim: 0 }`,
/// local `[V/p, d]`). Collectives: 1 all-reduce forward, 0 backward.
pub struct VocabParallelEmbedding {
    name: String,
    weight: Var,
    comm: Arc<dyn Communicator>,
    vocab_size: usize,
    dim: usize,
    range: Range<usize>,
}

impl VocabParallelEmbedding {
    /// Creates `weight` through `vb` (e.g. `vb.pp("transformer.wte")`). The vocabulary
    /// must divide by the group size (pad it, as Megatron does).
    pub fn new(
        vb: &Builder,
        comm: Arc<dyn Communicator>,
        vocab_size: usize,
        dim: usize,
        init: Init,
    ) -> Result<Self> {
        let name = vb.prefix().to_string();
        check_group(&name, vb, comm.as_ref())?;
        let n = comm.world_size();
        if !vocab_size.is_multiple_of(n) {
            return Err(ShardError::NotDivisible {
                layer: name,
                what: "vocabulary size",
                count: vocab_size,
                by: n,
                why: format!(
                    "the tensor-parallel group size; pad the vocabulary to a multiple of {n}"
                ),
            }
            .into());
        }
        let weight = vb.param("weight", &[vocab_size, dim], ShardSpec::split(0), init)?;
        let per = vocab_size / n;
        let start = comm.rank() * per;
        Ok(VocabParallelEmbedding {
            name,
            weight,
            comm,
            vocab_size,
            dim,
            range: start..start + per,
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
        let dev = Device::Cpu;
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

    /// This rank's table shard `[V/p, d]`: tie an LM head to it with
    /// [`VocabParallelEmbedding::tied_lm_head`] or [`ColumnParallelLinear::from_weight`].
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The token ids this rank owns.
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

    /// An LM head sharing this table: `logits_local = f(h) · E_iᵀ`, `[.., V/p]`, no bias,
    /// no gather; feed it to [`crate::vocab_parallel_cross_entropy`]. Its name is
    /// `lm_head (tied to <name>.weight)`.
    pub fn tied_lm_head(&self) -> Result<ColumnParallelLinear> {
        ColumnParallelLinear::from_weight(
            format!("lm_head (tied to {}.weight)", self.name),
            self.weight.clone(),
            self.comm.clone(),
            false,
        )
    }
}

impl Module for VocabParallelEmbedding {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        VocabParallelEmbedding::forward(self, xs)
    }
}
