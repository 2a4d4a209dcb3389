//! The GPT's mixture-of-experts settings: which blocks' MLPs are a mixture of experts
//! and how it routes (the layer is `switchyard_shard::ParallelMoe`; the reference's own
//! routing is in `reference.rs`).

use serde::{Deserialize, Serialize};
use switchyard_shard::MoeOptions;

use crate::ModelError;

/// A mixture of experts in place of some blocks' MLPs (`experts = 0`: none, a dense GPT).
///
/// Block `i` has one when `(i + 1) % every == 0` (with `every = 2`: blocks 1, 3, …, as
/// GShard and Switch Transformer put them on every other layer, the first block dense).
/// Its experts are MLPs of hidden width `ffn_hidden` (the dense MLP's `4·d` unless set);
/// a token goes to `top_k` of them (1: Switch Transformer; 2 and more: GShard's
/// renormalised gates).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MoeConfig {
    /// `E`, experts per mixture (0: a dense model).
    pub experts: usize,
    /// `k`, the experts each token goes to.
    pub top_k: usize,
    /// Every `every`-th block has a mixture of experts.
    pub every: usize,
    /// `C`: an expert takes at most `⌈C · k · T / E⌉` tokens of a sequence of `T`; the
    /// rest pass through the residual. 0: no limit.
    pub capacity_factor: f64,
    /// `α` of the load-balancing loss `α · E · Σ_e f_e · P_e` (0: none).
    pub aux_loss_coef: f64,
    /// `β` of the router z-loss `β · mean over tokens of (log Σ_e exp z_e)²` (ST-MoE;
    /// 0: none, the default; ST-MoE uses 0.001).
    pub z_loss_coef: f64,
    /// The hidden width of each expert's MLP; 0: the dense MLP's, `4·d` (Megatron's
    /// `--moe-ffn-hidden-size`). With top 2, `2·d` costs a token what the dense MLP does.
    pub ffn_hidden: usize,
}

impl Default for MoeConfig {
    /// Dense (no experts); once `experts` is set: top 2, every block, no capacity limit,
    /// α = 0.01 (Switch Transformer's).
    fn default() -> Self {
        MoeConfig {
            experts: 0,
            top_k: 2,
            every: 1,
            capacity_factor: 0.0,
            aux_loss_coef: 0.01,
            z_loss_coef: 0.0,
            ffn_hidden: 0,
        }
    }
}

impl MoeConfig {
    /// No experts anywhere.
    pub fn is_dense(&self) -> bool {
        self.experts == 0
    }

    /// Whether block `i` has a mixture of experts.
    pub fn is_moe_layer(&self, i: usize) -> bool {
        !self.is_dense() && self.every > 0 && (i + 1).is_multiple_of(self.every)
    }

    /// Each expert's hidden width for a model of width `d`.
    pub fn hidden(&self, d: usize) -> usize {
        match self.ffn_hidden {
            0 => 4 * d,
            h => h,
        }
    }

    /// How many of `n_layer` blocks have one.
    pub fn moe_layers(&self, n_layer: usize) -> usize {
        match self.is_dense() || self.every == 0 {
            true => 0,
            false => n_layer / self.every,
        }
    }

    /// What the layer needs.
    pub fn options(&self) -> MoeOptions {
        MoeOptions {
            experts: self.experts,
            top_k: self.top_k,
            capacity_factor: self.capacity_factor,
            aux_loss_coef: self.aux_loss_coef,
            z_loss_coef: self.z_loss_coef,
        }
    }

    /// Refuses settings that cannot route.
    pub fn validate(&self, n_layer: usize) -> Result<(), ModelError> {
        let bad = |m: String| Err(ModelError::Config(m));
        if self.is_dense() {
            // A routing setting without experts would be silently ignored.
            let d = MoeConfig::default();
            let set = [
                (self.top_k != d.top_k, "--top-k"),
                (self.every != d.every, "--moe-every"),
                (
                    self.capacity_factor != d.capacity_factor,
                    "--capacity-factor",
                ),
                (self.aux_loss_coef != d.aux_loss_coef, "--aux-loss-coef"),
                (self.z_loss_coef != d.z_loss_coef, "--z-loss-coef"),
                (self.ffn_hidden != d.ffn_hidden, "--expert-hidden"),
            ];
            if let Some((_, flag)) = set.iter().find(|s| s.0) {
                return bad(format!(
                    "{flag} sets up mixtures of experts, but the model has none: add \
                     --experts E (or leave {flag} out)"
                ));
            }
            return Ok(());
        }
        if self.top_k == 0 || self.top_k > self.experts {
            return bad(format!(
                "--top-k {} must be between 1 and the {} experts",
                self.top_k, self.experts
            ));
        }
        if self.every == 0 || self.every > n_layer {
            return bad(format!(
                "--moe-every {} must be between 1 and the {n_layer} layers (every N-th block's \
                 MLP is a mixture of experts)",
                self.every
            ));
        }
        if !(self.capacity_factor.is_finite() && self.capacity_factor >= 0.0) {
            return bad(format!(
                "--capacity-factor {} must be 0 (no limit) or positive",
                self.capacity_factor
            ));
        }
        if !(self.aux_loss_coef.is_finite() && self.aux_loss_coef >= 0.0) {
            return bad(format!(
                "--aux-loss-coef {} must be 0 or positive",
                self.aux_loss_coef
            ));
        }
        if !(self.z_loss_coef.is_finite() && self.z_loss_coef >= 0.0) {
            return bad(format!(
                "--z-loss-coef {} must be 0 or positive",
                self.z_loss_coef
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_n_th_block_counting_from_one() {
        let m = MoeConfig {
            experts: 8,
            every: 2,
            ..MoeConfig::default()
        };
        let moe: Vec<usize> = (0..6).filter(|&i| m.is_moe_layer(i)).collect();
        assert_eq!(moe, vec![1, 3, 5]);
        assert_eq!(m.moe_layers(6), 3);
        assert_eq!(MoeConfig::default().moe_layers(6), 0);
    }

    #[test]
    fn settings_that_cannot_route_are_refused() {
        let m = |f: fn(&mut MoeConfig)| {
            let mut c = MoeConfig {
                experts: 4,
                ..MoeConfig::default()
            };
            f(&mut c);
            c.validate(4).err().map(|e| e.to_string())
        };
        assert!(m(|_| {}).is_none());
        assert!(m(|c| c.top_k = 5).unwrap().contains("--top-k 5"));
        assert!(m(|c| c.every = 0).unwrap().contains("--moe-every 0"));
        assert!(m(|c| c.capacity_factor = -1.0)
            .unwrap()
            .contains("--capacity-factor"));
        assert!(m(|c| c.aux_loss_coef = f64::NAN)
            .unwrap()
            .contains("--aux-loss-coef"));
        // Routing without experts.
        assert!(m(|c| (c.experts, c.top_k) = (0, 1))
            .unwrap()
            .contains("--top-k sets up mixtures of experts"));
        assert!(m(|c| c.z_loss_coef = -0.1)
            .unwrap()
            .contains("--z-loss-coef -0.1 must be 0 or positive"));
        assert!(m(|c| (c.experts, c.z_loss_coef) = (0, 0.001))
            .unwrap()
            .contains("--z-loss-coef sets up mixtures of experts"));
    }
}
