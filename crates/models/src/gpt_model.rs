//! [`GptConfig`] as a [`Model`]: what the trainer knows of the GPT besides running it
//! (its layers and their costs, its footprint for the memory estimate, the tied table,
//! its parameters' shapes, and nanoGPT and Hugging Face state dicts in and out). The
//! model itself, one pipeline stage at a time, is `gpt.rs`.

use std::collections::HashMap;

use candle_core::{Result, Tensor};
use switchyard_shard::{ParamStore, TpGroup};

use crate::gpt::GptStage;
use crate::{
    gpt_layer_costs, Footprint, GptConfig, LayerCosts, Model, ModelError, StagePlan, Tied,
};

/// The token table, which a tied LM head shares.
pub(crate) const WTE: &str = "transformer.wte.weight";
/// The untied LM head, and a tied one's alias in nanoGPT's state dict.
pub(crate) const LM_HEAD: &str = "lm_head.weight";

/// Buffers of nanoGPT state dicts that are not parameters (causal masks), ignored on
/// import.
pub(crate) fn is_buffer(name: &str) -> bool {
    name.ends_with(".attn.bias") || name.ends_with(".attn.masked_bias")
}

impl Model for GptConfig {
    const NAME: &'static str = "gpt";
    type Stage = GptStage;

    fn layers(&self) -> usize {
        self.n_layer
    }

    fn stage(&self, plan: &StagePlan, store: &ParamStore, tp: TpGroup) -> Result<GptStage> {
        GptStage::new(self, plan, store, tp)
    }

    fn validate(&self) -> std::result::Result<(), ModelError> {
        GptConfig::validate(self)
    }

    /// Whole heads on every tensor-parallel rank; sequences no longer than the position
    /// table.
    fn check_layout(&self, tp: usize, seq_len: usize) -> std::result::Result<(), ModelError> {
        if tp == 0 || !self.n_head.is_multiple_of(tp) {
            return Err(ModelError::Layout(format!(
                "--tp {tp} does not divide the {} attention heads: each rank needs whole heads; \
                 use a --tp that divides {} or change --heads",
                self.n_head, self.n_head
            )));
        }
        let hidden = self.moe.hidden(self.d_model);
        if !self.moe.is_dense() && !hidden.is_multiple_of(tp) {
            return Err(ModelError::Layout(format!(
                "--tp {tp} does not divide the experts' hidden width {hidden}: each rank holds \
                 1/tp of every expert; use an --expert-hidden that --tp divides"
            )));
        }
        if seq_len == 0 || seq_len > self.block_size {
            return Err(ModelError::Layout(format!(
                "--seq-len {seq_len} must be between 1 and the model's block size {}",
                self.block_size
            )));
        }
        Ok(())
    }

    /// Its LayerNorms and residual stream split over the tensor-parallel group; not
    /// with mixtures of experts, which route whole sequences (capacity is per sequence).
    fn sequence_parallel(&self) -> bool {
        self.moe.is_dense()
    }

    fn experts(&self) -> usize {
        self.moe.experts
    }

    fn expert_params(&self) -> usize {
        let (d, h) = (self.d_model, self.moe.hidden(self.d_model));
        self.moe.moe_layers(self.n_layer) * self.moe.experts * (2 * h * d + h + d)
    }

    fn expert_exchange(&self) -> Vec<usize> {
        (0..self.n_layer)
            .map(|i| match self.moe.is_moe_layer(i) {
                true => self.moe.top_k * self.d_model,
                false => 0,
            })
            .collect()
    }

    /// `aux 0.0210 dropped 0.0%`: the balancing loss's part of the objective and the
    /// share of the choices over capacity.
    fn summarize_metrics(&self, sums: &std::collections::BTreeMap<String, f64>) -> Option<String> {
        let aux = sums.get("moe/aux_loss")?;
        let dropped = sums.get("moe/dropped")?;
        let choices = sums.get("moe/choices")?.max(1.0);
        let z = match self.moe.z_loss_coef > 0.0 {
            true => format!(" z {:.4}", sums.get("moe/z_loss")?),
            false => String::new(),
        };
        Some(format!(
            "aux {aux:.4}{z} dropped {:.1}%",
            100.0 * dropped / choices
        ))
    }

    /// With mixtures of experts: the balancing loss's part of the objective, the
    /// choices and those dropped, and each expert's tokens.
    fn step_metrics(&self) -> Vec<String> {
        if self.moe.is_dense() {
            return Vec::new();
        }
        let mut names: Vec<String> = ["moe/aux_loss", "moe/z_loss", "moe/choices", "moe/dropped"]
            .map(String::from)
            .to_vec();
        for i in (0..self.n_layer).filter(|&i| self.moe.is_moe_layer(i)) {
            for e in 0..self.moe.experts {
                names.push(format!("transformer.h.{i}.mlp.experts.{e}.tokens"));
            }
        }
        names
    }

    fn width(&self) -> Option<usize> {
        Some(self.d_model)
    }

    fn costs(&self, seq_len: usize) -> LayerCosts {
        gpt_layer_costs(self, seq_len)
    }

    /// Arithmetic, for any size (`gpt_footprint.rs` derives every term: per token a
    /// block saves `12·d/tp + 6·d + h/tp` with the fused ops).
    fn footprint(
        &self,
        plan: &StagePlan,
        tp: usize,
        seq_len: usize,
        sequence_parallel: bool,
    ) -> std::result::Result<Footprint, ModelError> {
        crate::gpt_footprint::footprint(self, plan, tp, seq_len, sequence_parallel)
    }

    /// The token table, on the first and the last stage, when the head is tied and they
    /// are different stages.
    fn tied(&self, num_stages: usize) -> Vec<Tied> {
        match self.tied_embeddings && num_stages > 1 {
            true => vec![Tied {
                name: WTE.into(),
                stages: vec![0, num_stages - 1],
            }],
            false => Vec::new(),
        }
    }

    fn vocab_size(&self) -> Option<usize> {
        Some(self.vocab_size)
    }

    fn param_shapes(&self) -> std::result::Result<Vec<(String, Vec<usize>)>, ModelError> {
        GptConfig::validate(self)?;
        Ok(GptConfig::param_shapes(self))
    }

    fn param_count(&self) -> usize {
        GptConfig::param_count(self)
    }

    /// A nanoGPT state dict: the shapes give every dimension but the number of heads,
    /// which comes from `self`; causal-mask buffers are dropped; a head equal to the
    /// token table (nanoGPT saves a tied table under both names) or missing means tied.
    fn import(
        &self,
        mut tensors: HashMap<String, Tensor>,
    ) -> std::result::Result<(GptConfig, HashMap<String, Tensor>), ModelError> {
        tensors.retain(|k, _| !is_buffer(k));
        let shapes = tensors
            .iter()
            .map(|(k, v)| (k.clone(), v.dims().to_vec()))
            .collect();
        let mut c = GptConfig::infer(&shapes, self.n_head)?;
        // The shapes give the experts and where they are; routing comes from `self`.
        if !c.moe.is_dense() {
            c.moe = crate::MoeConfig {
                experts: c.moe.experts,
                every: c.moe.every,
                ffn_hidden: c.moe.ffn_hidden,
                ..self.moe
            };
        }
        if let (Some(w), Some(h)) = (tensors.get(WTE), tensors.get(LM_HEAD)) {
            let same = w.dims() == h.dims()
                && (w - h)
                    .and_then(|d| d.abs()?.max_all()?.to_scalar::<f32>())
                    .map_err(|e| ModelError::Weights(e.to_string()))?
                    == 0.0;
            if same {
                c.tied_embeddings = true;
                tensors.remove(LM_HEAD);
            }
        }
        Ok((c, tensors))
    }

    /// `GPT2LMHeadModel`'s format (see [`crate::hf`]).
    fn hf_export(
        &self,
        params: &HashMap<String, Tensor>,
    ) -> std::result::Result<(serde_json::Value, Vec<(String, Tensor)>), ModelError> {
        crate::hf::to_hf(self, params)
    }

    fn hf_import(
        &self,
        config: &serde_json::Value,
        tensors: HashMap<String, Tensor>,
    ) -> std::result::Result<(GptConfig, HashMap<String, Tensor>), ModelError> {
        crate::hf::from_hf(config, tensors)
    }

    /// A tied table also under `lm_head.weight`, as PyTorch's state dict has it.
    fn export(&self, tensors: &mut Vec<(String, Tensor)>) -> std::result::Result<(), ModelError> {
        if self.tied_embeddings {
            let Some((_, w)) = tensors.iter().find(|(n, _)| n == WTE) else {
                return Err(ModelError::MissingParam {
                    model: Self::NAME,
                    name: WTE.into(),
                });
            };
            let w = w.clone();
            tensors.push((LM_HEAD.into(), w));
        }
        Ok(())
    }
}
