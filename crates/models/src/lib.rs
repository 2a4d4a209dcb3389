//! # switchyard-models: models as single-device code, plus how to parallelise them
//!
//! * [`GptStage`]: a GPT-2 / nanoGPT model, built one pipeline stage at a time from the
//!   layers of `switchyard-shard`. The code reads as single-device code; the size of the
//!   tensor-parallel group the layers are given decides whether they are sharded.
//! * [`plan`]: the GPT's tensor-parallel plan as data (which parameter is column-, row-
//!   or vocabulary-parallel), and [`split`]: how its layers divide into pipeline stages
//!   (even, explicit and uneven, or balanced by cost; never dropping or duplicating a
//!   layer).
//! * [`ReferenceGpt`]: a plain single-device GPT that shares no code with the above,
//!   the yardstick of every parity test.
//! * [`MlpStage`]: a small residual MLP, the simplest model to pipeline.
//! * [`Model`] and [`ModelStage`]: what a trainer needs from a model, implemented by
//!   [`GptConfig`] and [`MlpConfig`] (and by any model of your own): stages built for a
//!   layout, the loss, per-layer costs, tied parameters, names and shapes.
//!
//! Architecture invariant: this crate never depends on `switchyard-comm`; every
//! collective happens inside a `switchyard-shard` layer.
//!
//! ## Example: a two-layer GPT on one device
//!
//! ```
//! use candle_core::{DType, Device, Module, Tensor};
//! use switchyard_models::{plan_stages, GptConfig, GptStage, LayerCosts, SplitSpec};
//! use switchyard_shard::{single_device, ParamSource, ParamStore};
//!
//! let cfg = GptConfig::tiny(2);
//! let costs = LayerCosts::uniform(cfg.n_layer, 0.0, 1.0, 0.0);
//! let plans = plan_stages(&costs, 1, &SplitSpec::Even).unwrap();
//! let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 7 }).unwrap();
//! let gpt = GptStage::new(&cfg, &plans[0], &store, single_device()).unwrap();
//! let ids = Tensor::new(&[[1u32, 2, 3]], &Device::Cpu).unwrap();
//! let logits = gpt.forward(&ids).unwrap();
//! assert_eq!(logits.dims(), &[3, 256]);
//! let loss = gpt.loss(&logits, &Tensor::new(&[[2u32, 3, 4]], &Device::Cpu).unwrap()).unwrap();
//! assert!(loss.to_scalar::<f32>().unwrap() > 5.0); // about ln 256 at initialisation
//! ```
//!
//! ## Tutorials
//!
//! * [Chapter 4, "Putting it together: dp × pp × tp"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/04-3d-parallelism.md):
//!   the GPT on a `dp × pp × tp` mesh, and choosing a layout.
//! * [Chapter 5, "Bring your own model"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/05-bring-your-own-model.md): a
//!   model of your own that implements [`Model`], trained on any layout and checked
//!   against one device (example `own_model`).

mod block;
mod config;
mod dropout;
mod error;
mod gpt;
mod gpt_footprint;
mod gpt_model;
pub mod hf;
mod mlp;
mod model;
mod moe;
pub mod plan;
mod reference;
pub mod sample;
pub mod split;

pub use config::{ops_serde, precision_serde, GptConfig};
pub use dropout::DropoutStep;
pub use error::ModelError;
pub use gpt::{GptStage, INIT_STD, LN_EPS};
pub use mlp::{MlpConfig, MlpStage};
pub use model::{Activations, Footprint, Model, ModelStage, Tied};
pub use moe::MoeConfig;
pub use reference::ReferenceGpt;
pub use split::{plan_stages, LayerCosts, SplitSpec, StagePlan};
pub use switchyard_shard::{OpsBackend, Precision};

/// The per-token costs of the GPT's parts, for [`SplitSpec::Balanced`]: training FLOPs
/// of each block, of the embeddings (a lookup, nearly free) and of the head and loss. A
/// block with a mixture of experts runs `k` expert MLPs a token and its router instead
/// of one MLP ([`GptConfig::moe_extra_weights`]).
pub fn gpt_layer_costs(cfg: &GptConfig, seq_len: usize) -> LayerCosts {
    let d = cfg.d_model as f64;
    let mut costs = LayerCosts::uniform(
        cfg.n_layer,
        6.0 * d,
        6.0 * 12.0 * d * d + 12.0 * seq_len as f64 * d,
        6.0 * cfg.vocab_size as f64 * d + 10.0 * cfg.vocab_size as f64,
    );
    let extra = 6.0 * cfg.moe_extra_weights();
    for (i, c) in costs.blocks.iter_mut().enumerate() {
        if cfg.moe.is_moe_layer(i) {
            *c += extra;
        }
    }
    costs
}
