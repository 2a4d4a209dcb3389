//! Argument checks every backend makes before an operation, so that misuse gives the
//! same message whatever the transport. Each returns the reason; the backend wraps it in
//! [`crate::CommError::Invalid`] with its operation and rank.

use candle_core::Tensor;

/// `peer` names a rank of a group `group` of `n` ranks.
pub(crate) fn peer_in_range(peer: usize, n: usize, group: &str) -> Result<(), String> {
    match peer < n {
        true => Ok(()),
        false => Err(format!(
            "peer {peer} is out of range for group {group} of size {n}"
        )),
    }
}

/// `dim` is a dim of `t`.
pub(crate) fn dim_exists(t: &Tensor, dim: usize) -> Result<(), String> {
    match dim < t.rank() {
        true => Ok(()),
        false => Err(format!(
            "dim {dim} does not exist in a tensor of shape {:?}",
            t.dims()
        )),
    }
}

/// `dim` of `t` splits into `n` equal parts (a reduce-scatter's input).
pub(crate) fn splits_evenly(t: &Tensor, dim: usize, n: usize) -> Result<(), String> {
    dim_exists(t, dim)?;
    match t.dims()[dim].is_multiple_of(n) {
        true => Ok(()),
        false => Err(format!(
            "dim {dim} of shape {:?} does not split into {n} equal parts",
            t.dims()
        )),
    }
}

/// An all-to-all has one part per rank.
pub(crate) fn one_part_per_rank(parts: usize, n: usize) -> Result<(), String> {
    match parts == n {
        true => Ok(()),
        false => Err(format!("{parts} parts given for a group of size {n}")),
    }
}
