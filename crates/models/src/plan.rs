//! The GPT's tensor-parallel plan, as data.
//!
//! Which parameter is split along which dim, following Megatron-LM: the first linear of
//! each sub-layer is column-parallel (its output features split), the second is
//! row-parallel (its input features split, outputs summed), and the vocabulary is split
//! for the embedding, the head and the loss — padded to `V_p = ⌈V/tp⌉·tp` rows, as
//! Megatron-LM does, so that any vocabulary works at any degree
//! ([`ShardSpec::Padded`], which records `V`). Everything else is replicated. The layers
//! of `switchyard-shard` create parameters with exactly these specs (a test checks it),
//! and checkpoints record them, so a checkpoint can be re-cut for any degree.

use switchyard_shard::ShardSpec;

const COLUMN: PlanSpec = PlanSpec::Fixed(ShardSpec::Split { dim: 0, blocks: 1 });
const ROW: PlanSpec = PlanSpec::Fixed(ShardSpec::Split { dim: 1, blocks: 1 });
/// The fused qkv: q | k | v, each split over the ranks, so a rank holds whole heads.
const QKV: PlanSpec = PlanSpec::Fixed(ShardSpec::Split { dim: 0, blocks: 3 });
const REPLICATED: PlanSpec = PlanSpec::Fixed(ShardSpec::Replicated);
/// The rows of a `[V, d]` table, one per token id, padded to a multiple of tp.
const VOCAB: PlanSpec = PlanSpec::VocabRows;

/// How the plan lays out one parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlanSpec {
    /// This spec, whatever the model's size.
    Fixed(ShardSpec),
    /// Split by rows over the vocabulary, padded to a multiple of the degree:
    /// [`ShardSpec::padded`]`(0, vocab_size)`.
    VocabRows,
}

impl PlanSpec {
    /// The spec of a model whose vocabulary has `vocab_size` ids.
    pub fn spec(self, vocab_size: usize) -> ShardSpec {
        match self {
            PlanSpec::Fixed(s) => s,
            PlanSpec::VocabRows => ShardSpec::padded(0, vocab_size),
        }
    }
}

/// `(name pattern, spec)`; `*` stands for a layer index.
pub const GPT_TP_PLAN: &[(&str, PlanSpec)] = &[
    ("transformer.wte.weight", VOCAB),
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
    ("lm_head.weight", VOCAB),
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

/// The spec the plan gives parameter `name` of a model whose vocabulary has
/// `vocab_size` ids, if it is a GPT parameter.
pub fn gpt_spec(name: &str, vocab_size: usize) -> Option<ShardSpec> {
    GPT_TP_PLAN
        .iter()
        .find(|(p, _)| matches(p, name))
        .map(|(_, s)| s.spec(vocab_size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_layer_indices_only() {
        assert_eq!(
            gpt_spec("transformer.h.12.attn.c_attn.weight", 256),
            Some(QKV.spec(0))
        );
        assert_eq!(gpt_spec("transformer.h.x.attn.c_attn.weight", 256), None);
        assert_eq!(gpt_spec("transformer.h..attn.c_attn.weight", 256), None);
        assert_eq!(
            gpt_spec("lm_head.weight", 257),
            Some(ShardSpec::padded(0, 257))
        );
        assert_eq!(gpt_spec("lm_head.bias", 257), None);
    }
}
