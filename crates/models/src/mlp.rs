//! A small residual MLP: `x ← x + W₂·gelu(W₁·x + b₁) + b₂` per layer, regression loss.
//!
//! The simplest model worth pipelining: every layer has the same shape, so any split
//! works, and each layer is one column-then-row tensor-parallel pair.

use candle_core::{Module, Result, Tensor, Var};
use serde::{Deserialize, Serialize};
use switchyard_shard::{Init, LayerInit, ParallelMlp, ParamStore, TpGroup};

use crate::StagePlan;

/// The MLP's shape.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MlpConfig {
    pub d_model: usize,
    pub hidden: usize,
    pub n_layer: usize,
}

/// The layers of an [`MlpConfig`] that one stage runs. Input and output `[N, d]`.
pub struct MlpStage {
    layers: Vec<ParallelMlp>,
    params: Vec<Var>,
}

impl MlpStage {
    /// Creates layers `plan.blocks` (named `layers.{i}.mlp.c_fc.weight`, …) in `store`.
    pub fn new(
        cfg: &MlpConfig,
        plan: &StagePlan,
        store: &ParamStore,
        tp: TpGroup,
    ) -> Result<MlpStage> {
        let first = store.len();
        let init = LayerInit {
            weight: Init::Normal { std: 0.2 },
            proj_weight: Init::Normal { std: 0.2 },
            bias: Init::Normal { std: 0.1 },
        };
        let layers = plan
            .blocks
            .clone()
            .map(|i| {
                let vb = store.builder().pp(format!("layers.{i}"));
                ParallelMlp::new(&vb, tp.clone(), cfg.d_model, cfg.hidden, init)
            })
            .collect::<Result<Vec<_>>>()?;
        let params = store.vars()[first..].to_vec();
        Ok(MlpStage { layers, params })
    }

    pub fn params(&self) -> &[Var] {
        &self.params
    }

    /// Mean squared error against `target`.
    pub fn loss(&self, out: &Tensor, target: &Tensor) -> Result<Tensor> {
        (out - target)?.sqr()?.mean_all()
    }
}

impl Module for MlpStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for l in &self.layers {
            x = (&x + l.forward(&x)?)?;
        }
        Ok(x)
    }
}
