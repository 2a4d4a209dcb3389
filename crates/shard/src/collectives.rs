//! Collectives that autograd understands: Megatron's paired operators as candle ops.
//!
//! Candle's own tensor-parallel all-reduce has no backward, so gradients stop at it.
//! Each function here is a [`CustomOp1`] whose backward runs the *dual* collective:
//!
//! | function | forward | backward | Megatron name |
//! |---|---|---|---|
//! | [`copy_to_region`] | identity | all-reduce (sum) | f |
//! | [`reduce_from_region`] | all-reduce (sum) | identity | g |
//! | [`gather_from_region`] | all-gather along `dim` | keep own slice along `dim` | |
//! | [`scatter_to_region`] | keep own slice along `dim` | all-gather along `dim` | |
//! | [`gather_seq`] | all-gather along `dim` | reduce-scatter (sum) along `dim` | ḡ (sequence parallel) |
//! | [`reduce_scatter_seq`] | reduce-scatter (sum) along `dim` | all-gather along `dim` | f̄ (sequence parallel) |
//!
//! Why the duals: if `y = x` is used by every rank's partial computation, the gradient of
//! the (replicated) loss with respect to `x` is the *sum* of the per-rank partial
//! gradients (f); if `y = Σ_r x_r`, then `∂y/∂x_r = 1` and every rank keeps the
//! incoming gradient (g). All-gather and reduce-scatter are each other's adjoints, and so
//! are all-gather and taking one's own slice when the downstream computation is replicated.
//!
//! With a group of one rank every function is the identity and communicates nothing.
//! When the input does not track gradients, the result is the plain collective.
//!
//! **Ordering.** Backward collectives run in the order candle's `backward` visits the
//! graph, which depends only on the graph's structure; every rank must therefore build
//! the same graph, as Megatron requires.
//!
//! **Implementation.** Collectives whose forward communicates run on the detached input
//! first; the op's `cpu_fwd` then hands candle a copy of that result (a custom op must
//! return fresh storage). The precomputed result is dropped as soon as it is copied.

use std::sync::{Arc, Mutex};

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::cpu_backend::CpuDevice;
use candle_core::{
    bail, CpuStorage, CudaStorage, CustomOp1, Layout, MetalStorage, Result, Shape, Storage, Tensor,
};
use switchyard_comm::{Communicator, ReduceOp};

use crate::error::invalid;

#[derive(Debug, Clone, Copy)]
enum Kind {
    Copy,
    Reduce,
    Gather(usize),
    Scatter(usize),
    GatherSeq(usize),
    ReduceScatterSeq(usize),
}

struct Collective {
    kind: Kind,
    comm: Arc<dyn Communicator>,
    /// The forward result when the forward communicates; taken by `cpu_fwd`.
    result: Mutex<Option<Tensor>>,
}

impl Collective {
    fn rank_slice(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let n = self.comm.world_size();
        let piece = t.dim(dim)? / n;
        t.narrow(dim, self.comm.rank() * piece, piece)
    }
}

/// Copies `src` viewed through `layout` into fresh contiguous CPU storage.
pub(crate) fn copy_out(src: &CpuStorage, layout: &Layout) -> Result<CpuStorage> {
    // SAFETY: `copy_strided_src` writes every element of the freshly allocated storage.
    let mut dst = unsafe { CpuDevice.alloc_uninit(layout.shape(), src.dtype())? };
    src.copy_strided_src(&mut dst, 0, layout)?;
    Ok(dst)
}

/// Copies `src` viewed through `layout` into fresh contiguous storage on its device.
pub(crate) fn copy_device<B>(src: &B, layout: &Layout) -> Result<B>
where
    B: BackendStorage,
    B::Device: BackendDevice<Storage = B>,
{
    let mut dst = src.device().zeros_impl(layout.shape(), src.dtype())?;
    src.copy_strided_src(&mut dst, 0, layout)?;
    Ok(dst)
}

impl Collective {
    /// The forward on any device: `copy` copies a strided view into fresh storage,
    /// `pick` finds this device's storage in the precomputed result.
    fn forward<B>(
        &self,
        s: &B,
        l: &Layout,
        copy: fn(&B, &Layout) -> Result<B>,
        pick: fn(&Storage) -> Option<&B>,
    ) -> Result<(B, Shape)> {
        match self.kind {
            Kind::Copy => Ok((copy(s, l)?, l.shape().clone())),
            Kind::Scatter(dim) => {
                let n = self.comm.world_size();
                let piece = l.dims()[dim] / n;
                let local = l.narrow(dim, self.comm.rank() * piece, piece)?;
                Ok((copy(s, &local)?, local.shape().clone()))
            }
            _ => {
                let Some(r) = self.result.lock().unwrap_or_else(|e| e.into_inner()).take() else {
                    bail!("{}: forward ran twice", CustomOp1::name(self));
                };
                let (storage, layout) = r.storage_and_layout();
                match pick(&storage) {
                    Some(c) => Ok((copy(c, layout)?, layout.shape().clone())),
                    None => bail!(
                        "{}: the communicator returned a tensor on another device",
                        CustomOp1::name(self)
                    ),
                }
            }
        }
    }
}

impl CustomOp1 for Collective {
    fn name(&self) -> &'static str {
        match self.kind {
            Kind::Copy => "copy_to_region",
            Kind::Reduce => "reduce_from_region",
            Kind::Gather(_) => "gather_from_region",
            Kind::Scatter(_) => "scatter_to_region",
            Kind::GatherSeq(_) => "gather_seq",
            Kind::ReduceScatterSeq(_) => "reduce_scatter_seq",
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        self.forward(s, l, copy_out, |s| match s {
            Storage::Cpu(c) => Some(c),
            _ => None,
        })
    }

    fn cuda_fwd(&self, s: &CudaStorage, l: &Layout) -> Result<(CudaStorage, Shape)> {
        self.forward(s, l, copy_device, |s| match s {
            Storage::Cuda(c) => Some(c),
            _ => None,
        })
    }

    fn metal_fwd(&self, s: &MetalStorage, l: &Layout) -> Result<(MetalStorage, Shape)> {
        self.forward(s, l, copy_device, |s| match s {
            Storage::Metal(c) => Some(c),
            _ => None,
        })
    }

    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let c = &self.comm;
        let g = match self.kind {
            Kind::Copy => c.all_reduce(grad, ReduceOp::Sum)?,
            Kind::Reduce => grad.clone(),
            Kind::Gather(dim) => self.rank_slice(grad, dim)?,
            Kind::Scatter(dim) | Kind::ReduceScatterSeq(dim) => c.all_gather(grad, dim)?,
            Kind::GatherSeq(dim) => c.reduce_scatter(&grad.contiguous()?, dim, ReduceOp::Sum)?,
        };
        Ok(Some(g))
    }
}

fn check_dim(op: &str, x: &Tensor, dim: usize, divide_by: Option<usize>) -> Result<()> {
    if dim >= x.rank() {
        return Err(invalid(format!(
            "{op}: dim {dim} out of range for a tensor of shape {:?}",
            x.dims()
        )));
    }
    if let Some(n) = divide_by {
        if x.dim(dim)? % n != 0 {
            return Err(invalid(format!(
                "{op}: dim {dim} of a tensor of shape {:?} (size {}) does not split over {n} ranks",
                x.dims(),
                x.dim(dim)?
            )));
        }
    }
    Ok(())
}

fn apply(
    x: &Tensor,
    comm: &Arc<dyn Communicator>,
    kind: Kind,
    result: Option<Tensor>,
) -> Result<Tensor> {
    let op = Collective {
        kind,
        comm: comm.clone(),
        result: Mutex::new(result),
    };
    x.apply_op1(op)
}

/// Megatron's **f**: identity forward, all-reduce (sum) of the gradient backward.
/// Put in front of a column-parallel layer whose input is replicated.
pub fn copy_to_region(x: &Tensor, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    if comm.world_size() == 1 || !x.track_op() {
        return Ok(x.clone());
    }
    apply(x, comm, Kind::Copy, None)
}

/// Megatron's **g**: all-reduce (sum) forward, identity backward. Sums the partial
/// results of a row-parallel layer.
pub fn reduce_from_region(x: &Tensor, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    let y = comm.all_reduce(&x.detach(), ReduceOp::Sum)?;
    if !x.track_op() {
        return Ok(y);
    }
    apply(x, comm, Kind::Reduce, Some(y))
}

/// All-gather along `dim` forward (rank order); backward keeps this rank's slice of the
/// gradient. Turns a column-parallel output into the full, replicated output.
pub fn gather_from_region(x: &Tensor, dim: usize, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    check_dim("gather_from_region", x, dim, None)?;
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    let y = comm.all_gather(&x.detach(), dim)?;
    if !x.track_op() {
        return Ok(y);
    }
    apply(x, comm, Kind::Gather(dim), Some(y))
}

/// Keeps this rank's slice along `dim` forward (no communication); all-gathers the
/// gradient backward. Splits a replicated input for a row-parallel layer.
pub fn scatter_to_region(x: &Tensor, dim: usize, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    let n = comm.world_size();
    check_dim("scatter_to_region", x, dim, Some(n))?;
    if n == 1 {
        return Ok(x.clone());
    }
    if !x.track_op() {
        let piece = x.dim(dim)? / n;
        return x.narrow(dim, comm.rank() * piece, piece)?.contiguous();
    }
    apply(x, comm, Kind::Scatter(dim), None)
}

/// Sequence parallelism, entering a tensor-parallel region: all-gather along `dim` (the
/// sequence dim) forward, reduce-scatter (sum) of the gradient backward.
pub fn gather_seq(x: &Tensor, dim: usize, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    check_dim("gather_seq", x, dim, None)?;
    if comm.world_size() == 1 {
        return Ok(x.clone());
    }
    let y = comm.all_gather(&x.detach(), dim)?;
    if !x.track_op() {
        return Ok(y);
    }
    apply(x, comm, Kind::GatherSeq(dim), Some(y))
}

/// Sequence parallelism, leaving a tensor-parallel region: reduce-scatter (sum) along
/// `dim` forward, all-gather of the gradient backward.
pub fn reduce_scatter_seq(x: &Tensor, dim: usize, comm: &Arc<dyn Communicator>) -> Result<Tensor> {
    let n = comm.world_size();
    check_dim("reduce_scatter_seq", x, dim, Some(n))?;
    if n == 1 {
        return Ok(x.clone());
    }
    let y = comm.reduce_scatter(&x.detach().contiguous()?, dim, ReduceOp::Sum)?;
    if !x.track_op() {
        return Ok(y);
    }
    apply(x, comm, Kind::ReduceScatterSeq(dim), Some(y))
}
