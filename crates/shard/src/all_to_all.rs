//! The all-to-all of rows, with its backward: how a mixture of experts sends tokens to
//! the ranks that hold their experts (expert parallelism) and brings them back.
//!
//! `x` `[Σ_r send_r, d]` holds the rows for rank 0, then those for rank 1, …; the
//! result holds the rows every rank sent to this one, in rank order. The counts differ
//! from rank to rank and step to step: the communicator's all-to-all carries each
//! part's shape. The backward is the same exchange the other way (what rank `s` sent
//! here, its gradient goes back to `s`), so the pair is its own conjugate.

use std::sync::{Arc, Mutex};

use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Result, Shape, Storage, Tensor,
};
use switchyard_comm::Communicator;

use crate::collectives::{copy_device, copy_out};
use crate::error::invalid;

/// Sends `x`'s rows `[Σ send, d]` (`send[r]` of them to rank `r`, in order) and
/// returns the rows received (in rank order) and how many came from each rank.
/// Differentiable: the gradient goes back the way the rows came.
pub fn all_to_all_rows(
    x: &Tensor,
    comm: &Arc<dyn Communicator>,
    send: &[usize],
) -> Result<(Tensor, Vec<usize>)> {
    let n = comm.world_size();
    if send.len() != n || send.iter().sum::<usize>() != x.dim(0)? {
        return Err(invalid(format!(
            "all_to_all_rows: {} rows cannot be sent as {send:?} to {n} ranks",
            x.dim(0)?
        )));
    }
    let (y, recv) = exchange(comm, &x.detach(), send)?;
    if !x.track_op() {
        return Ok((y, recv));
    }
    let op = AllToAllRows {
        comm: comm.clone(),
        send: send.to_vec(),
        recv: recv.clone(),
        result: Mutex::new(Some(y)),
    };
    Ok((x.apply_op1(op)?, recv))
}

/// The exchange itself: `x` cut by `send`, the parts swapped, the received ones
/// joined.
fn exchange(
    comm: &Arc<dyn Communicator>,
    x: &Tensor,
    send: &[usize],
) -> Result<(Tensor, Vec<usize>)> {
    let mut parts = Vec::with_capacity(send.len());
    let mut off = 0;
    for &k in send {
        parts.push(x.narrow(0, off, k)?.contiguous()?);
        off += k;
    }
    let got = comm.all_to_all(parts)?;
    let recv: Vec<usize> = got.iter().map(|t| t.dim(0)).collect::<Result<_>>()?;
    let y = match recv.iter().sum::<usize>() {
        0 => x.narrow(0, 0, 0)?.contiguous()?,
        _ => Tensor::cat(&got, 0)?,
    };
    Ok((y, recv))
}

struct AllToAllRows {
    comm: Arc<dyn Communicator>,
    send: Vec<usize>,
    recv: Vec<usize>,
    /// The received rows, computed before the op; taken by the forward.
    result: Mutex<Option<Tensor>>,
}

impl AllToAllRows {
    fn forward<B>(
        &self,
        copy: fn(&B, &Layout) -> Result<B>,
        pick: fn(&Storage) -> Option<&B>,
    ) -> Result<(B, Shape)> {
        let Some(r) = self.result.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            bail!("all_to_all_rows: forward ran twice");
        };
        let (storage, layout) = r.storage_and_layout();
        match pick(&storage) {
            Some(c) => Ok((copy(c, layout)?, layout.shape().clone())),
            None => bail!("all_to_all_rows: the communicator returned a tensor on another device"),
        }
    }
}

impl CustomOp1 for AllToAllRows {
    fn name(&self) -> &'static str {
        "all_to_all_rows"
    }

    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(copy_out, |s| match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        })
    }

    fn cuda_fwd(&self, _: &CudaStorage, _: &Layout) -> Result<(CudaStorage, Shape)> {
        self.forward(copy_device, |s| match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        })
    }

    fn metal_fwd(&self, _: &MetalStorage, _: &Layout) -> Result<(MetalStorage, Shape)> {
        self.forward(copy_device, |s| match s {
            Storage::Metal(c) => Some(c),
            _ => None,
        })
    }

    /// The rows' gradients go back to the ranks they came from.
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let (g, back) = exchange(&self.comm, grad, &self.recv)?;
        if back != self.send {
            bail!(
                "all_to_all_rows backward: got {back:?} rows back, sent {:?}",
                self.send
            );
        }
        Ok(Some(g))
    }
}
