//! Activations that are bf16 tensors.
//!
//! At `Precision::Bf16` on the fused backend the tensors *between* the ops may be bf16:
//! the residual stream, the LayerNorms' outputs, the logits, and the gradients flowing
//! back through them. An op reads such an input as bf16 rows ([`Held::Half`], which the
//! products pack by copying) or widens it a block of rows at a time, computes in f32
//! (statistics, softmax, sums), and writes its output, and its input's gradient, in its
//! input's dtype: rounded to bf16 once, at the end, after any collective (which sums in
//! f32). Weights, their gradients and the loss stay f32.

use std::borrow::Cow;

use candle_core::{bail, CpuStorage, DType, Layout, Result, Tensor};
use half::bf16;

use super::{to_bf16_vec, Held};
use crate::kernel::{self, Float};

/// The rows of a contiguous bf16 storage seen through `l`; `None` for another dtype.
pub(crate) fn half_slice<'a>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &str,
) -> Result<Option<&'a [bf16]>> {
    let CpuStorage::BF16(v) = s else {
        return Ok(None);
    };
    let Some((a, b)) = l.contiguous_offsets() else {
        bail!(
            "{op}: expected a contiguous input, got strides {:?}",
            l.stride()
        )
    };
    Ok(Some(&v[a..b]))
}

/// An op's input as its products read it: bf16 rows as they are, else its own type.
pub(crate) fn held_slice<'a, T: Float>(
    s: &'a CpuStorage,
    l: &Layout,
    op: &str,
) -> Result<Held<'a, T>> {
    Ok(match half_slice(s, l, op)? {
        Some(h) => Held::Half(h),
        None => Held::Full(kernel::slice(s, l, op)?),
    })
}

/// `x` in `T`: bf16 widened (exactly), else borrowed.
pub(crate) fn widened<'a, T: Float>(x: Held<'a, T>) -> Result<Cow<'a, [T]>> {
    Ok(match x {
        Held::Full(x) => Cow::Borrowed(x),
        Held::Half(h) => Cow::Owned(T::widen_half(h)?),
    })
}

/// `y` as the storage of an op whose input was bf16 (`half`: rounded to bf16) or not.
pub(crate) fn storage_as<T: Float>(y: Vec<T>, half: bool) -> Result<CpuStorage> {
    if !half {
        return Ok(T::to_cpu_storage_owned(y));
    }
    match kernel::as_f32(&y) {
        Some(y) => Ok(CpuStorage::BF16(to_bf16_vec(y))),
        None => bail!("bf16 activations are computed in f32, got {:?}", T::DTYPE),
    }
}

/// A gradient computed in f32 (`t`), in the dtype of the input it belongs to: rounded
/// to bf16 for a bf16 input, else as it is.
pub(crate) fn grad_as(t: Tensor, dtype: DType) -> Result<Tensor> {
    if dtype != DType::BF16 || t.dtype() != DType::F32 {
        return Ok(t);
    }
    let t = t.contiguous()?;
    let half = to_bf16_vec(kernel::view(&t, "bf16 gradient")?.get::<f32>()?);
    Tensor::from_vec(half, t.shape().clone(), &candle_core::Device::Cpu)
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Tensor, Var};

    /// LayerNorm and cross-entropy on bf16 activations, forward and backward, equal the
    /// f32 ops on the same values with their outputs and input gradients rounded (small
    /// shapes: Miri runs this for the row buffers the bf16 paths write).
    #[test]
    fn layer_norm_and_cross_entropy_on_bf16_are_the_f32_ops_rounded() {
        let (rows, d) = (5, 19);
        let vals: Vec<f32> = (0..rows * d)
            .map(|i| half::bf16::from_f32(((i * 37 % 23) as f32 - 11.0) / 7.0).to_f32())
            .collect();
        let w: Vec<f32> = (0..d).map(|i| 1.0 + i as f32 / 16.0).collect();
        let b: Vec<f32> = (0..d).map(|i| i as f32 / 32.0 - 0.25).collect();
        let targets = Tensor::new(&[1u32, 4, 0, 18, 7], &Device::Cpu).unwrap();
        let run = |dtype: DType| {
            let x = Tensor::from_vec(vals.clone(), (rows, d), &Device::Cpu).unwrap();
            let x = Var::from_tensor(&x.to_dtype(dtype).unwrap()).unwrap();
            let (wv, bv) = (
                Var::new(w.as_slice(), &Device::Cpu).unwrap(),
                Var::new(b.as_slice(), &Device::Cpu).unwrap(),
            );
            let y = crate::layer_norm(x.as_tensor(), wv.as_tensor(), bv.as_tensor(), 1e-5).unwrap();
            let loss = crate::cross_entropy(&y, &targets).unwrap();
            let g = loss.backward().unwrap();
            let f = |t: &Tensor| {
                let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
                t.to_vec1::<f32>().unwrap()
            };
            let dx = g.get(x.as_tensor()).unwrap();
            assert_eq!(dx.dtype(), dtype);
            (f(&y), f(&loss), f(dx), f(g.get(wv.as_tensor()).unwrap()))
        };
        let (yh, lh, dxh, dwh) = run(DType::BF16);
        let (yf, lf, dxf, dwf) = run(DType::F32);
        let r = |v: &[f32]| -> Vec<f32> {
            v.iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect()
        };
        assert_eq!(yh, r(&yf));
        // The loss, and the gradients from it, see the rounded LayerNorm output and the
        // rounded logits' gradient: close.
        let scale = dxf.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in dxh.iter().zip(&dxf) {
            assert!((a - b).abs() < 2e-2 * scale, "{a} vs {b}");
        }
        assert!(
            (lh[0] - lf[0]).abs() < 1e-2 * lf[0].abs(),
            "{lh:?} vs {lf:?}"
        );
        let scale = dwf.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (a, b) in dwh.iter().zip(&dwf) {
            assert!((a - b).abs() < 2e-2 * scale, "{a} vs {b}");
        }
    }
}
