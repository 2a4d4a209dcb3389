//! A small residual MLP: `x ← x + W₂·gelu(W₁·x + b₁) + b₂` per layer, regression loss.
//!
//! The simplest model worth pipelining: every layer has the same shape, so any split
//! works, and each layer is one column-then-row tensor-parallel pair.
//!
//! As a [`Model`] it trains on token windows like the GPT does, without a vocabulary:
//! a window of `d_model` token ids is one input vector (each id `i` read as the number
//! `i/128 − 1`), and the loss is the mean squared error against the target window read
//! the same way. A float model with no embeddings and no ties, through the same trainer.

use candle_core::{DType, Module, Result, Tensor, Var};
use serde::{Deserialize, Serialize};
use switchyard_shard::{Init, LayerInit, OpsBackend, ParallelMlp, ParamStore, TpGroup};

use crate::{Model, ModelError, ModelStage, StagePlan};

/// The MLP's shape. In a config file every field is optional.
///
/// As with the GPT ([`crate::GptConfig::ops`]), two configs are equal when they describe
/// the same model: [`MlpConfig::ops`] takes no part in the comparison.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MlpConfig {
    pub d_model: usize,
    pub hidden: usize,
    pub n_layer: usize,
    /// How the ops compute: the fused CPU kernels (default) or their composed twins,
    /// which run on every candle device ([`OpsBackend`]). Not written at its default.
    #[serde(
        with = "crate::config::ops_serde",
        skip_serializing_if = "crate::config::is_fused"
    )]
    pub ops: OpsBackend,
}

impl PartialEq for MlpConfig {
    fn eq(&self, other: &Self) -> bool {
        let key = |c: &MlpConfig| (c.d_model, c.hidden, c.n_layer);
        key(self) == key(other)
    }
}

impl Eq for MlpConfig {}

impl Default for MlpConfig {
    fn default() -> Self {
        MlpConfig {
            d_model: 16,
            hidden: 32,
            n_layer: 4,
            ops: OpsBackend::Fused,
        }
    }
}

/// Token ids as values: `i/128 − 1` (bytes land in `[−1, 1)`); floats pass unchanged.
fn as_values(x: &Tensor) -> Result<Tensor> {
    match x.dtype() {
        DType::U32 => x.to_dtype(DType::F32)?.affine(1.0 / 128.0, -1.0),
        _ => Ok(x.clone()),
    }
}

impl Model for MlpConfig {
    const NAME: &'static str = "mlp";
    type Stage = MlpStage;

    fn layers(&self) -> usize {
        self.n_layer
    }

    fn stage(&self, plan: &StagePlan, store: &ParamStore, tp: TpGroup) -> Result<MlpStage> {
        MlpStage::new(self, plan, store, tp)
    }

    fn validate(&self) -> std::result::Result<(), ModelError> {
        if self.d_model == 0 || self.hidden == 0 || self.n_layer == 0 {
            return Err(ModelError::Config(format!(
                "every MLP dimension must be positive: {self:?}"
            )));
        }
        Ok(())
    }

    /// A window of `seq_len` ids is one input vector, so `seq_len` must be `d_model`;
    /// the hidden width divides among the tensor-parallel ranks.
    fn check_layout(&self, tp: usize, seq_len: usize) -> std::result::Result<(), ModelError> {
        if seq_len != self.d_model {
            return Err(ModelError::Layout(format!(
                "the MLP reads a window of --seq-len tokens as one vector of d_model {}: \
                 use --seq-len {}",
                self.d_model, self.d_model
            )));
        }
        if tp == 0 || !self.hidden.is_multiple_of(tp) {
            return Err(ModelError::Layout(format!(
                "--tp {tp} does not divide the MLP's hidden width {}",
                self.hidden
            )));
        }
        Ok(())
    }
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
                let vb = store.builder().with_ops(cfg.ops).pp(format!("layers.{i}"));
                ParallelMlp::new(&vb, tp.clone(), cfg.d_model, cfg.hidden, init)
            })
            .collect::<Result<Vec<_>>>()?;
        let params = store.vars()[first..].to_vec();
        Ok(MlpStage { layers, params })
    }

    pub fn params(&self) -> &[Var] {
        &self.params
    }

    /// Mean squared error against `target` (token ids are read as values, see the
    /// module docs).
    pub fn loss(&self, out: &Tensor, target: &Tensor) -> Result<Tensor> {
        (out - as_values(target)?)?.sqr()?.mean_all()
    }
}

impl switchyard_pipeline::Stage for MlpStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Module::forward(self, x)
    }
    fn params(&self) -> &[Var] {
        &self.params
    }
}

impl ModelStage for MlpStage {
    fn loss(&self, out: &Tensor, target: &Tensor) -> Result<Tensor> {
        MlpStage::loss(self, out, target)
    }
}

impl Module for MlpStage {
    /// Input `[N, d]` floats, or token ids `[N, d]` (u32, read as values).
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = as_values(x)?;
        for l in &self.layers {
            x = (&x + l.forward(&x)?)?;
        }
        Ok(x)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan_stages;
    use switchyard_shard::ParamSource;

    fn stage(cfg: &MlpConfig) -> MlpStage {
        let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 1 }).unwrap();
        let plans = plan_stages(&cfg.costs(cfg.d_model), 1, &Default::default()).unwrap();
        MlpStage::new(cfg, &plans[0], &store, switchyard_shard::single_device()).unwrap()
    }

    /// `ops` reaches every layer, is no part of the model's identity, and is written
    /// only when it is not the default.
    #[test]
    fn the_ops_setting_reaches_the_layers_and_is_not_part_of_the_model() {
        let composed = MlpConfig {
            ops: OpsBackend::Composed,
            ..MlpConfig::default()
        };
        for (cfg, want) in [
            (MlpConfig::default(), OpsBackend::Fused),
            (composed.clone(), OpsBackend::Composed),
        ] {
            let s = stage(&cfg);
            assert_eq!(s.layers.len(), cfg.n_layer);
            assert!(s.layers.iter().all(|l| l.c_fc().ops() == want));
        }
        assert_eq!(composed, MlpConfig::default());
        let json = serde_json::to_string(&MlpConfig::default()).unwrap();
        assert!(!json.contains("ops"), "{json}");
        let json = serde_json::to_string(&composed).unwrap();
        assert!(json.contains(r#""ops":"composed""#), "{json}");
        let back: MlpConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back.ops, OpsBackend::Composed);
    }
}
