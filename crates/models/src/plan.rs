//! The GPT's tensor-parallel plan, as data.
//!
//! Which parameter is split along which dim, following Megatron-LM: the first linear of
//! each sub-layer is column-parallel (its output features split), the second is
//! row-parallel (its input features split, outputs summed), and the vocabulary is split
//! for the embedding, the head and the loss. Everything else is replicated. The layers
//! of `switchyard-shard` create parameters with exactly these specs (a test checks it),
//! and checkpoints record them, so a checkpoint can be re-cut for any degree.

use switchyard_shard::ShardSpec;

const COLUMN: ShardSpec = ShardSpec::Split { dim: 0, blocks: 1 };
const ROW: ShardSpec = ShardSpec::Split { dim: 1, blocks: 1 };
/// The fused qkv: q | k | v, each split over the ranks, so a rank holds whole heads.
const QKV: ShardSpec = ShardSpec::Split { dim: 0, blocks: 3 };
const REPLICATED: ShardSpec = ShardSpec::Replicated;

/// `(name pattern, spec)`; `*` stands for a layer index.
pub const GPT_TP_PLAN: &[(&str, ShardSpec)] = &[
    ("transformer.wte.weight", COLUMN),
    ("transformer.wpe.weight", REPLICATED),
    ("transformer.h.*.ln_1.weight", REPLICATED),
    ("transformer.h.*.ln_1.bias", REPLICATED),
    ("transformer.h.*.attn.c_attn.weight", QKV),
    ("transformer.h.*.attn.c_attn.bias", QKV),
    ("transformer.h.*.attn.c_proj.weight", ROW),
    ("transformer.h.*.attn.c_proj.bias", REPLICATED),
    ("transformer.h.*.ln_2.weight", REPLICATED),
    ("transformer.h.*.ln_2.bias", REPLICATED),
    ("transformer.h.*.mlp.c_fc.weight", COLUMN),
    ("transformer.h.*.mlp.c_fc.bias", COLUMN),
    ("transformer.h.*.mlp.c_proj.weight", ROW),
    ("transformer.h.*.mlp.c_proj.bias", REPLICATED),
    ("transformer.ln_f.weight", REPLICATED),
    ("transformer.ln_f.bias", REPLICATED),
    ("lm_head.weight", COLUMN),
];

fn matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((pre, post)) => name
            .strip_prefix(pre)
            .and_then(|rest| rest.strip_suffix(post))
            .is_some_and(|mid| !mid.is_empty() && mid.bytes().all(|b| b.is_ascii_digit())),
    }
}

/// The spec the plan gives parameter `name`, if it is a GPT parameter.
pub fn gpt_spec(name: &str) -> Option<ShardSpec> {
    GPT_TP_PLAN
        .iter()
        .find(|(p, _)| matches(p, name))
        .map(|(_, s)| *s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_layer_indices_only() {
        assert_eq!(gpt_spec("transformer.h.12.attn.c_attn.weight"), Some(QKV));
        assert_eq!(gpt_spec("transformer.h.x.attn.c_attn.weight"), None);
        assert_eq!(gpt_spec("transformer.h..attn.c_attn.weight"), None);
        assert_eq!(gpt_spec("lm_head.weight"), Some(COLUMN));
        assert_eq!(gpt_spec("lm_head.bias"), None);
    }
}
