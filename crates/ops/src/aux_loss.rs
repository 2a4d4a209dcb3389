//! An auxiliary loss that a layer adds to the objective from the middle of a model.
//!
//! A mixture-of-experts layer has a load-balancing loss of its own, computed where the
//! router is, not at the end of the model (on a middle pipeline stage there is no loss at
//! all: the stage's backward starts from its output's gradient). [`attach_loss`] ties the
//! auxiliary loss to the layer's output: the value passes through unchanged, and the
//! backward gives the auxiliary loss the gradient `scale`, as if `scale · aux` had been
//! added to the objective (Megatron-Core's `MoEAuxLossAutoScaler`, with the scale passed
//! in rather than set on a class).

use candle_core::backend::{BackendDevice, BackendStorage};
use candle_core::{
    CpuStorage, CudaStorage, CustomOp2, Layout, MetalStorage, Result, Shape, Tensor,
};

use crate::composed::copy;

/// `out`, unchanged, with `scale · aux` added to the objective its gradient comes from:
/// the backward passes `out`'s gradient through and gives the scalar `aux` the gradient
/// `scale`. Runs on every candle device (the forward is a copy).
pub fn attach_loss(out: &Tensor, aux: &Tensor, scale: f64) -> Result<Tensor> {
    if aux.elem_count() != 1 {
        candle_core::bail!(
            "attach_loss: the auxiliary loss must be a scalar, got shape {:?}",
            aux.dims()
        );
    }
    out.apply_op2(aux, AttachLoss { scale })
}

struct AttachLoss {
    scale: f64,
}

fn first<B>(s: &B, l: &Layout) -> Result<(B, Shape)>
where
    B: BackendStorage,
    B::Device: BackendDevice<Storage = B>,
{
    Ok((copy(s, l)?, l.shape().clone()))
}

impl CustomOp2 for AttachLoss {
    fn name(&self) -> &'static str {
        "attach-loss"
    }

    fn cpu_fwd(
        &self,
        s: &CpuStorage,
        l: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        first(s, l)
    }

    fn cuda_fwd(
        &self,
        s: &CudaStorage,
        l: &Layout,
        _: &CudaStorage,
        _: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        first(s, l)
    }

    fn metal_fwd(
        &self,
        s: &MetalStorage,
        l: &Layout,
        _: &MetalStorage,
        _: &Layout,
    ) -> Result<(MetalStorage, Shape)> {
        first(s, l)
    }

    fn bwd(
        &self,
        _out: &Tensor,
        aux: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g_aux = aux.ones_like()?.affine(self.scale, 0.0)?;
        Ok((Some(grad.clone()), Some(g_aux)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    #[test]
    #[cfg_attr(miri, ignore = "candle's tensors read /sys")]
    fn the_value_passes_and_the_aux_loss_gets_its_scale() -> Result<()> {
        let x = Var::new(&[1f32, -2.0, 3.0], &Device::Cpu)?;
        let w = Var::new(&[0.5f32], &Device::Cpu)?;
        // aux = 3·w², so d(scale·aux)/dw = 6·w·scale.
        let aux = (w.as_tensor().sqr()? * 3.0)?.sum_all()?;
        let y = attach_loss(x.as_tensor(), &aux, 0.25)?;
        assert_eq!(y.to_vec1::<f32>()?, vec![1.0, -2.0, 3.0]);
        let loss = (y * 2.0)?.sum_all()?;
        let g = loss.backward()?;
        assert_eq!(
            g.get(x.as_tensor()).unwrap().to_vec1::<f32>()?,
            vec![2.0; 3]
        );
        let gw = g.get(w.as_tensor()).unwrap().to_vec1::<f32>()?;
        assert!((gw[0] - 6.0 * 0.5 * 0.25).abs() < 1e-7, "{gw:?}");
        Ok(())
    }

    #[test]
    #[cfg_attr(miri, ignore = "candle's tensors read /sys")]
    fn a_non_scalar_aux_loss_is_refused() -> Result<()> {
        let x = Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu)?;
        let err = attach_loss(&x, &x, 1.0).unwrap_err().to_string();
        assert!(err.contains("scalar"), "{err}");
        Ok(())
    }
}
