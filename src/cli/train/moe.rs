//! `switchyard train`'s mixture-of-experts flags (the `[model.moe]` table of a config
//! file), applied over the file's settings.

use clap::Args;
use switchyard_models::MoeConfig;

#[derive(Args, Default)]
pub struct MoeArgs {
    /// Experts of each mixture-of-experts MLP (0: a dense model; TOML `[model.moe] experts`)
    #[arg(long)]
    pub experts: Option<usize>,
    /// Experts each token goes to: 1 (Switch Transformer), 2 (GShard, the default) or
    /// more, up to --experts
    #[arg(long)]
    pub top_k: Option<usize>,
    /// Every N-th block's MLP is a mixture of experts (blocks N−1, 2N−1, …; default 1)
    #[arg(long, value_name = "N")]
    pub moe_every: Option<usize>,
    /// An expert takes at most ⌈C·k·T/E⌉ tokens of a sequence, the rest pass through the
    /// residual; 0 (the default): no limit
    #[arg(long, value_name = "C")]
    pub capacity_factor: Option<f64>,
    /// α of the load-balancing loss α·E·Σ f·P (default 0.01)
    #[arg(long, value_name = "ALPHA")]
    pub aux_loss_coef: Option<f64>,
    /// β of the router z-loss β·mean (log Σ exp z)² over the tokens (ST-MoE; default 0:
    /// none)
    #[arg(long, value_name = "BETA")]
    pub z_loss_coef: Option<f64>,
    /// Each expert's hidden width (default 4·d, the dense MLP's; 2·d with top 2 costs a
    /// token what the dense MLP does)
    #[arg(long, value_name = "H")]
    pub expert_hidden: Option<usize>,
}

impl MoeArgs {
    /// Writes the flags given into `moe`.
    pub fn apply(&self, moe: &mut MoeConfig) {
        let set = |v: Option<usize>, field: &mut usize| {
            if let Some(v) = v {
                *field = v;
            }
        };
        set(self.experts, &mut moe.experts);
        set(self.top_k, &mut moe.top_k);
        set(self.moe_every, &mut moe.every);
        set(self.expert_hidden, &mut moe.ffn_hidden);
        if let Some(c) = self.capacity_factor {
            moe.capacity_factor = c;
        }
        if let Some(a) = self.aux_loss_coef {
            moe.aux_loss_coef = a;
        }
        if let Some(z) = self.z_loss_coef {
            moe.z_loss_coef = z;
        }
    }
}
