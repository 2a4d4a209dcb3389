//! The synthetic stage and the custom op that charges its actions' costs.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, Device, Layout, Result, Shape, Tensor, Var};
use switchyard_schedule::{Costs, Op, Program};

use crate::Stage;

use super::SyntheticClock;

/// What the custom op and the stage share.
pub(super) struct Inner {
    costs: Costs,
    /// Per microbatch: whether the program splits this stage's backward into `I` and `W`.
    split: Vec<bool>,
    clock: Arc<SyntheticClock>,
}

/// A pipeline stage that costs its actions on a [`SyntheticClock`] instead of computing
/// (see the [module documentation](crate::synthetic)). Its input and output are `[time, microbatch]`
/// `f64` tensors; [`SyntheticStage::input`] makes the first stage's inputs.
pub struct SyntheticStage {
    inner: Arc<Inner>,
    params: Vec<Var>,
}

impl SyntheticStage {
    /// Stage `stage` of `program`, costing its actions with `costs` on `clock`.
    pub fn new(
        program: &Program,
        stage: u32,
        costs: Costs,
        clock: Arc<SyntheticClock>,
    ) -> Result<SyntheticStage> {
        if stage >= program.num_stages {
            candle_core::bail!(
                "synthetic stage {stage} of a program of {} stages",
                program.num_stages
            );
        }
        let mut split = vec![false; program.num_microbatches as usize];
        for a in program.ranks.iter().flatten() {
            if a.stage == stage && a.op == Op::I {
                if let Some(s) = split.get_mut(a.microbatch as usize) {
                    *s = true;
                }
            }
        }
        // One parameter, so that autograd tracks the op (and calls its backward) even
        // on the first stage, whose input is not a variable.
        let w = Var::new(&[0f64], &Device::Cpu)?;
        Ok(SyntheticStage {
            inner: Arc::new(Inner {
                costs,
                split,
                clock,
            }),
            params: vec![w],
        })
    }

    /// The first stage's input for `microbatch`.
    pub fn input(microbatch: u32) -> Result<Tensor> {
        Tensor::new(&[0.0, f64::from(microbatch)], &Device::Cpu)
    }
}

impl Stage for SyntheticStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.apply_op2(
            self.params[0].as_tensor(),
            Timed {
                inner: self.inner.clone(),
            },
        )
    }

    fn params(&self) -> &[Var] {
        &self.params
    }

    fn backward_weights(&self, _microbatch: u32) -> Result<Vec<(Var, Tensor)>> {
        self.inner.clock.compute(self.inner.costs.w);
        Ok(Vec::new())
    }
}

/// The op `x ↦ [time, microbatch]`: its forward charges `F`, its backward `B` or `I`.
pub(super) struct Timed {
    inner: Arc<Inner>,
}

/// The microbatch index stored in a `[time, microbatch]` tensor.
pub(super) fn microbatch_of(values: &[f64]) -> Result<f64> {
    match values {
        [_, m] => Ok(*m),
        _ => candle_core::bail!(
            "a synthetic stage's tensors are [time, microbatch], got {} values",
            values.len()
        ),
    }
}

impl CustomOp2 for Timed {
    fn name(&self) -> &'static str {
        "synthetic-stage"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        _s2: &CpuStorage,
        _l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let values = match (s1, l1.contiguous_offsets()) {
            (CpuStorage::F64(v), Some((a, b))) => &v[a..b],
            _ => candle_core::bail!("a synthetic stage's input is a contiguous f64 tensor"),
        };
        let m = microbatch_of(values)?;
        let now = self.inner.clock.compute(self.inner.costs.f);
        Ok((CpuStorage::F64(vec![now, m]), Shape::from(2)))
    }

    fn bwd(
        &self,
        arg1: &Tensor,
        arg2: &Tensor,
        _res: &Tensor,
        _grad_res: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let m = microbatch_of(&arg1.to_vec1::<f64>()?)?;
        let split = self.inner.split.get(m as usize).copied().unwrap_or(false);
        let cost = match split {
            true => self.inner.costs.i,
            false => self.inner.costs.b,
        };
        let now = self.inner.clock.compute(cost);
        let grad = Tensor::new(&[now, m], arg1.device())?;
        Ok((Some(grad), Some(arg2.zeros_like()?)))
    }
}
