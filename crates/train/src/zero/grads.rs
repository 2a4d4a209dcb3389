//! ZeRO's gradient side: each bucket reduce-scattered over the replicas (a whole one
//! only flattened), and the squares of this replica's shards for the global norm.

use candle_core::{DType, Device, Tensor};
use switchyard_comm::{Communicator, ReduceOp};
use switchyard_mem::Category;

use super::{Bucket, Layout};
use crate::error::Result;
use crate::optim::sum_sq;

/// The ZeRO stage 1 gradient step of [`crate::Worker`] (and stage 2's for parameters
/// no segment owns): reduce-scatters each of `which` buckets of `grads` over `dp`,
/// returning this replica's summed shard of each. With `keep_full` (stage 1) the full
/// gradients stay in `grads`; without it each bucket's are dropped as soon as it is
/// scattered.
pub fn reduce_scatter(
    layout: &Layout,
    which: impl IntoIterator<Item = usize>,
    dp: &dyn Communicator,
    grads: &mut [Option<Tensor>],
    keep_full: bool,
) -> Result<Vec<(usize, Tensor)>> {
    let mut shards = Vec::new();
    for k in which {
        let b = &layout.buckets[k];
        let shard = scatter_bucket(b, dp, |i| grads[i].clone())?;
        if !keep_full {
            for &i in &b.params {
                grads[i] = None;
            }
        }
        shards.push((k, shard));
    }
    Ok(shards)
}

/// Reduce-scatters one bucket over `dp`: its parameters' gradients (`grad(i)`, zeros
/// where `None`) flattened, padded and summed; this replica's shard of the sum. A
/// [`Bucket::whole`] one is only flattened.
pub fn scatter_bucket(
    b: &Bucket,
    dp: &dyn Communicator,
    mut grad: impl FnMut(usize) -> Option<Tensor>,
) -> Result<Tensor> {
    let given: Vec<Option<Tensor>> = b.params.iter().map(|&i| grad(i)).collect();
    // The flattened bucket is a communication buffer (a peer of the in-process
    // transport may still be reading it when this replica has moved on); the shard the
    // reduce-scatter returns is gradients again.
    let comm = switchyard_mem::scope(Category::Comm);
    let device = given
        .iter()
        .flatten()
        .next()
        .map_or(Device::Cpu, |g| g.device().clone());
    let ends = b.offsets.iter().skip(1).chain([&b.len]);
    let mut flat = Vec::with_capacity(b.params.len() + 1);
    for (g, (&o, &end)) in given.into_iter().zip(b.offsets.iter().zip(ends)) {
        flat.push(match g {
            Some(g) => g.flatten_all()?,
            None => Tensor::zeros(end - o, DType::F32, &device)?,
        });
    }
    let pad = b.padded() - b.len;
    if pad > 0 {
        flat.push(Tensor::zeros(pad, DType::F32, &device)?);
    }
    let cat = Tensor::cat(&flat, 0)?;
    drop(flat);
    drop(comm);
    if b.whole() {
        let _gradients = switchyard_mem::scope(Category::Gradients);
        return Ok(cat.copy()?);
    }
    Ok(dp.reduce_scatter(&cat, 0, ReduceOp::Sum)?)
}

/// What the step's norm needs from this replica's shards: the sum of the squares of the
/// pieces of the parameters it `owned`s, and the first parameter (of any) whose piece is
/// not finite.
pub fn shard_norm(
    layout: &Layout,
    shards: &[Tensor],
    owned: &[bool],
) -> Result<(f64, Option<usize>)> {
    let (mut sq, mut bad) = (0.0, None);
    for (b, s) in layout.buckets.iter().zip(shards) {
        for p in &b.pieces {
            let x = sum_sq(&s.narrow(0, p.at, p.len)?)?;
            if !x.is_finite() && bad.is_none() {
                bad = Some(p.param);
            }
            if owned[p.param] {
                sq += x;
            }
        }
    }
    Ok((sq, bad))
}
