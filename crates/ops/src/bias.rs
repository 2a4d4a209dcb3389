//! `y = x + b` over the rows of `x` (`[.., n]` plus `[n]`) as one op with a hand-written
//! backward: `dx = G`, `db = Σ_rows G`.
//!
//! Candle's `broadcast_add` takes a strided path for the broadcast operand and its
//! backward sums the gradient over the broadcast dims with general reductions; for a
//! sequence-parallel block's row-parallel bias (added after the reduce-scatter, twice
//! per block and microbatch) that cost more than the rows it adds. Here the forward is
//! one pass over the rows and the backward one column sum (split over the pool's
//! threads, [`crate::linear`]'s `column_sums`).

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use std::mem::MaybeUninit;

use crate::kernel::{self, simd, slice, view, Float, Uninit};
use crate::linear::column_sums;
use crate::OpsBackend;

/// `x + b` for `x` `[.., n]` and `b` `[n]`: the fused op on CPU f32 and f64 tensors
/// ([`OpsBackend::Fused`]), candle's `broadcast_add` otherwise. Gradients flow to both.
pub fn add_bias(x: &Tensor, b: &Tensor, backend: OpsBackend) -> Result<Tensor> {
    let n = x.dim(D::Minus1)?;
    if b.dims() != [n] {
        bail!(
            "add_bias: the bias must be [{n}] for x {:?}, got {:?}",
            x.dims(),
            b.dims()
        );
    }
    let fused = backend == OpsBackend::Fused
        && x.device().is_cpu()
        && b.device().is_cpu()
        && x.dtype() == b.dtype()
        && matches!(x.dtype(), DType::F32 | DType::F64);
    if !fused {
        // bf16 activations take an f32 bias rounded to their dtype.
        return x.broadcast_add(&b.to_dtype(x.dtype())?);
    }
    x.contiguous()?.apply_op2(&b.contiguous()?, AddBias)
}

struct AddBias;

simd! {
    /// `y = x + b` over the `b.len()`-wide rows of `x`, writing every element of `y`
    /// (as long as `x`) in one pass.
    fn rows_plus<T>(x: &[T], b: &[T], y: &mut [MaybeUninit<T>]) {
        for (xr, yr) in x.chunks_exact(b.len()).zip(y.chunks_exact_mut(b.len())) {
            for ((o, &v), &c) in yr.iter_mut().zip(xr).zip(b) {
                o.write(v + c);
            }
        }
    }
}

/// `x + b` row by row, one pass over `x` split over the pool's threads.
fn forward<T: Float>(x: &[T], b: &[T]) -> Result<Vec<T>> {
    let n = b.len();
    if !x.len().is_multiple_of(n) {
        bail!("add_bias: {} elements are not rows of {n}", x.len());
    }
    let mut y = Uninit::<T>::new(x.len())?;
    let per = (kernel::rows_per_task(x.len() / n.max(1)) * n).max(1);
    y.as_mut()
        .par_chunks_mut(per)
        .zip(x.par_chunks(per))
        .for_each(|(y, x)| rows_plus(x, b, y));
    // SAFETY: `x` is whole rows of `n` (checked above), so each task's chunk of `x` is
    // whole rows and `rows_plus` wrote every element of its chunk of `y`, of the same
    // length: together all `x.len()` elements.
    Ok(unsafe { y.assume_init() })
}

impl CustomOp2 for AddBias {
    fn name(&self) -> &'static str {
        "switchyard-add-bias"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = self.name();
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(forward::<f32>(slice(s1, l1, n)?, slice(s2, l2, n)?)?),
            DType::F64 => CpuStorage::F64(forward::<f64>(slice(s1, l1, n)?, slice(s2, l2, n)?)?),
            d => bail!("{n}: unsupported dtype {d:?}"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let width = b.elem_count();
        let db = {
            let gv = view(&g, self.name())?;
            match g.dtype() {
                DType::F32 => kernel::tensor(column_sums(gv.get::<f32>()?, width), width)?,
                DType::F64 => kernel::tensor(column_sums(gv.get::<f64>()?, width), width)?,
                d => bail!("{}: unsupported dtype {d:?}", self.name()),
            }
        };
        Ok((Some(g), Some(db)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The forward's one pass on slices (also under Miri, on two threads so that the
    /// tasks write their chunks at once): every row, the last chunk's short tail too.
    #[test]
    fn the_forward_adds_the_bias_to_every_row() {
        let (rows, n) = (13, 5);
        let x = kernel::test_data(rows * n, 3, 2.0);
        let b = kernel::test_data(n, 4, 1.0);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let y = pool.install(|| forward::<f64>(&x, &b)).unwrap();
        assert_eq!(y.len(), rows * n);
        for (i, (&got, &v)) in y.iter().zip(&x).enumerate() {
            assert_eq!(got, v + b[i % n], "element {i}");
        }
        assert!(forward::<f64>(&x[..7], &b).is_err());
        assert!(forward::<f64>(&[], &[]).unwrap().is_empty());
    }

    #[test]
    #[cfg_attr(miri, ignore = "candle's tensors read /sys")]
    fn matches_broadcast_add_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (3, 5, 4), &dev)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f32, 1.0, 4, &dev)?)?;
        let w = Tensor::randn(0f32, 1.0, (3, 5, 4), &dev)?;
        let run = |backend| -> Result<Vec<Vec<f32>>> {
            let y = add_bias(x.as_tensor(), b.as_tensor(), backend)?;
            let g = (&y * &w)?.sum_all()?.backward()?;
            Ok(vec![
                y.flatten_all()?.to_vec1()?,
                g.get(x.as_tensor()).unwrap().flatten_all()?.to_vec1()?,
                g.get(b.as_tensor()).unwrap().to_vec1()?,
            ])
        };
        let (fused, composed) = (run(OpsBackend::Fused)?, run(OpsBackend::Composed)?);
        for (f, c) in fused.iter().zip(&composed) {
            for (a, b) in f.iter().zip(c) {
                assert!((a - b).abs() <= 1e-5 * b.abs().max(1.0), "{a} vs {b}");
            }
        }
        assert!(add_bias(
            x.as_tensor(),
            &Tensor::zeros(3, DType::F32, &dev)?,
            OpsBackend::Fused
        )
        .is_err());
        Ok(())
    }
}
