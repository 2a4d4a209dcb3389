//! How one parameter is laid out over the ranks of a tensor-parallel group.

use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::error::{invalid, ShardError};

/// How a full (unsharded) tensor is divided over the `n` ranks of a tensor-parallel
/// group. Checkpoints store it next to each parameter, so a checkpoint written at one
/// tensor-parallel degree can be loaded at another.
///
/// * `Replicated`: every rank holds the whole tensor.
/// * `Split { dim, blocks }`: `dim` is made of `blocks` equal sub-blocks laid end to end,
///   and each sub-block is split in `n` equal contiguous pieces. Rank `r` holds piece `r`
///   of every sub-block, concatenated in block order. With `blocks = 1` this is a plain
///   split: rank `r` holds `full[r·s/n .. (r+1)·s/n]` along `dim`.
///
/// * `Padded { dim, size }`: `dim` has the logical size `size`, which the group's size
///   `n` need not divide. Every rank holds `c = ⌈size/n⌉` entries along `dim`: rank `r`
///   holds `full[r·c .. min((r+1)·c, size)]` followed by zeros up to `c` (the padding).
///   In other words the tensor is padded with zeros to `V_p = ⌈size/n⌉·n` along `dim` and
///   split as `Split { dim, blocks: 1 }`; [`ShardSpec::merge`] drops the padding again, so
///   the full tensor always has `size` entries. This is Megatron's padded vocabulary
///   (`V_p = ⌈V/t⌉·t`): the embedding and the LM head use it, and the padding rows stay
///   zero and inert (see [`crate::VocabParallelEmbedding`]).
///
/// `blocks > 1` describes fused parameters. GPT's `c_attn.weight` has rows `q | k | v`
/// (`blocks = 3`, each `d` rows, heads contiguous): rank `r` gets `[q_r | k_r | v_r]`,
/// that is whole heads of q, k and v.
///
/// ```
/// use candle_core::{Device, Tensor};
/// use switchyard_shard::ShardSpec;
///
/// # fn main() -> candle_core::Result<()> {
/// // rows: q0 q1 | k0 k1 | v0 v1, two ranks
/// let full = Tensor::arange(0f32, 6., &Device::Cpu)?.reshape((6, 1))?;
/// let spec = ShardSpec::fused(0, 3);
/// let r1 = spec.shard(&full, 1, 2)?;
/// assert_eq!(r1.flatten_all()?.to_vec1::<f32>()?, [1., 3., 5.]); // q1 k1 v1
/// let parts = [spec.shard(&full, 0, 2)?, r1];
/// assert_eq!(spec.merge(&parts)?.flatten_all()?.to_vec1::<f32>()?, [0., 1., 2., 3., 4., 5.]);
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ShardSpec {
    /// Every rank holds the full tensor.
    Replicated,
    /// Split along `dim`, made of `blocks` equal sub-blocks each split `n` ways.
    Split { dim: usize, blocks: usize },
    /// Split along `dim` (of logical size `size`) after padding it with zeros to a
    /// multiple of the group size.
    Padded { dim: usize, size: usize },
}

impl ShardSpec {
    /// A plain split along `dim` (`blocks = 1`).
    pub fn split(dim: usize) -> ShardSpec {
        ShardSpec::Split { dim, blocks: 1 }
    }

    /// A fused split: `dim` holds `blocks` equal sub-blocks, each split over the ranks.
    pub fn fused(dim: usize, blocks: usize) -> ShardSpec {
        ShardSpec::Split { dim, blocks }
    }

    /// A split along `dim`, whose logical size `size` is padded with zeros to a multiple
    /// of the group size ([`ShardSpec::Padded`]).
    pub fn padded(dim: usize, size: usize) -> ShardSpec {
        ShardSpec::Padded { dim, size }
    }

    /// The split dim, if the tensor is split.
    pub fn dim(&self) -> Option<usize> {
        match *self {
            ShardSpec::Replicated => None,
            ShardSpec::Split { dim, .. } | ShardSpec::Padded { dim, .. } => Some(dim),
        }
    }

    /// For [`ShardSpec::Padded`] over `n` ranks: the entries of `dim` rank `rank` holds,
    /// as `(c, real)`: it holds `c = ⌈size/n⌉` entries of which the first `real` are the
    /// logical entries `rank·c ..rank·c + real`, the rest padding. `None` for the other
    /// specs.
    pub fn padded_rows(&self, rank: usize, n: usize) -> Option<(usize, usize)> {
        match *self {
            ShardSpec::Padded { size, .. } if n > 0 => {
                let c = size.div_ceil(n);
                Some((c, size.saturating_sub(rank * c).min(c)))
            }
            _ => None,
        }
    }

    /// The shape one rank holds when the full shape is `full` and the group has `n` ranks.
    pub fn local_shape(&self, full: &[usize], n: usize) -> Result<Vec<usize>> {
        self.local_shape_of(&format!("a tensor of shape {full:?}"), full, n)
    }

    /// [`ShardSpec::local_shape`], naming the tensor `what` in the error.
    pub fn local_shape_of(&self, what: &str, full: &[usize], n: usize) -> Result<Vec<usize>> {
        if n == 0 {
            return Err(invalid(format!("{what}: a group of 0 ranks")));
        }
        match *self {
            ShardSpec::Replicated => Ok(full.to_vec()),
            ShardSpec::Split { dim, blocks } => {
                if dim >= full.len() {
                    return Err(invalid(format!(
                        "{what}: split dim {dim} out of range for rank {}",
                        full.len()
                    )));
                }
                if blocks == 0 {
                    return Err(invalid(format!("{what}: a split into 0 blocks")));
                }
                if !full[dim].is_multiple_of(blocks * n) {
                    return Err(ShardError::Indivisible {
                        what: what.to_string(),
                        dim,
                        size: full[dim],
                        blocks,
                        ranks: n,
                    }
                    .into());
                }
                let mut local = full.to_vec();
                local[dim] = full[dim] / n;
                Ok(local)
            }
            ShardSpec::Padded { dim, size } => {
                if dim >= full.len() {
                    return Err(invalid(format!(
                        "{what}: split dim {dim} out of range for rank {}",
                        full.len()
                    )));
                }
                if full[dim] != size || size == 0 {
                    return Err(invalid(format!(
                        "{what}: dim {dim} has size {}, but the padded split is for size {size}",
                        full[dim]
                    )));
                }
                let mut local = full.to_vec();
                local[dim] = size.div_ceil(n);
                Ok(local)
            }
        }
    }

    /// The piece of `full` that rank `rank` of `n` holds. Not differentiable-specific:
    /// built from `narrow` and `cat`, so gradients flow back into `full` if it tracks them.
    pub fn shard(&self, full: &Tensor, rank: usize, n: usize) -> Result<Tensor> {
        self.shard_of(
            &format!("a tensor of shape {:?}", full.dims()),
            full,
            rank,
            n,
        )
    }

    /// [`ShardSpec::shard`], naming the tensor `what` in errors.
    pub fn shard_of(&self, what: &str, full: &Tensor, rank: usize, n: usize) -> Result<Tensor> {
        self.local_shape_of(what, full.dims(), n)?;
        if rank >= n {
            return Err(invalid(format!(
                "{what}: rank {rank} out of range for {n} ranks"
            )));
        }
        match *self {
            ShardSpec::Replicated => Ok(full.clone()),
            ShardSpec::Split { dim, blocks } => {
                let block = full.dim(dim)? / blocks;
                let piece = block / n;
                if blocks == 1 {
                    return full.narrow(dim, rank * piece, piece);
                }
                let pieces = (0..blocks)
                    .map(|b| full.narrow(dim, b * block + rank * piece, piece))
                    .collect::<Result<Vec<_>>>()?;
                Tensor::cat(&pieces, dim)
            }
            ShardSpec::Padded { dim, .. } => {
                let (c, real) = self.padded_rows(rank, n).expect("a padded spec");
                let mut pad_shape = full.dims().to_vec();
                pad_shape[dim] = c - real;
                let pad = Tensor::zeros(pad_shape, full.dtype(), full.device())?;
                match real {
                    0 => Ok(pad),
                    _ if real == c => full.narrow(dim, rank * c, c),
                    _ => Tensor::cat(&[full.narrow(dim, rank * c, real)?, pad], dim),
                }
            }
        }
    }

    /// The full tensor from every rank's piece, in rank order (the inverse of
    /// [`ShardSpec::shard`]). For `Replicated` this returns `parts[0]`; for `Padded` the
    /// padding is dropped, so the result has the logical size.
    pub fn merge(&self, parts: &[Tensor]) -> Result<Tensor> {
        let Some(first) = parts.first() else {
            return Err(invalid("ShardSpec::merge: no parts"));
        };
        if let Some(p) = parts.iter().find(|p| p.dims() != first.dims()) {
            return Err(invalid(format!(
                "ShardSpec::merge: parts have different shapes {:?} and {:?}",
                first.dims(),
                p.dims()
            )));
        }
        match *self {
            ShardSpec::Replicated => Ok(first.clone()),
            ShardSpec::Padded { dim, size } => {
                let n = parts.len();
                if dim >= first.rank() || first.dim(dim)? != size.div_ceil(n) {
                    return Err(invalid(format!(
                        "ShardSpec::merge: {n} parts of shape {:?} are not {self:?} pieces",
                        first.dims()
                    )));
                }
                Tensor::cat(parts, dim)?.narrow(dim, 0, size)
            }
            ShardSpec::Split { dim, blocks } => {
                if dim >= first.rank() || blocks == 0 || first.dim(dim)? % blocks != 0 {
                    return Err(invalid(format!(
                        "ShardSpec::merge: parts of shape {:?} are not {self:?} pieces",
                        first.dims()
                    )));
                }
                if blocks == 1 {
                    return Tensor::cat(parts, dim);
                }
                let piece = first.dim(dim)? / blocks;
                let mut pieces = Vec::with_capacity(blocks * parts.len());
                for b in 0..blocks {
                    for p in parts {
                        pieces.push(p.narrow(dim, b * piece, piece)?);
                    }
                }
                Tensor::cat(&pieces, dim)
            }
        }
    }
}

/// The full tensor of which `local` is this rank's `spec` shard: one all-gather over
/// `tp` for a split tensor (without the padding of a [`ShardSpec::Padded`] one), a copy
/// for a replicated one. Every rank of `tp` must call it.
pub fn gather_full_tensor(
    tp: &dyn switchyard_comm::Communicator,
    spec: &ShardSpec,
    local: &Tensor,
) -> Result<Tensor> {
    let n = tp.world_size();
    match *spec {
        ShardSpec::Split { dim, .. } if n > 1 => {
            let all = tp.all_gather(local, dim)?;
            spec.merge(&all.chunk(n, dim)?)
        }
        // The gathered pieces are laid end to end already: drop the padding.
        ShardSpec::Padded { dim, size } if n > 1 => {
            tp.all_gather(local, dim)?.narrow(dim, 0, size)?.copy()
        }
        ShardSpec::Padded { dim, size } => local.narrow(dim, 0, size)?.copy(),
        _ => local.copy(),
    }
}
