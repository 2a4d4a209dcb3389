//! The GPT's hyper-parameters and what follows from them (parameter count, FLOPs).

use serde::{Deserialize, Serialize};

use switchyard_shard::{OpsBackend, Precision};

use crate::{ModelError, MoeConfig};

/// A GPT-2 style model. The vocabulary is bytes (256) unless a config says otherwise.
/// In a config file every field is optional (the rest come from [`GptConfig::default`])
/// and unknown fields are refused.
///
/// Two configs are equal when they describe the same model: [`GptConfig::ops`] (how it is
/// computed, not what) takes no part in the comparison, so a checkpoint or weights file
/// loads whatever the backend.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GptConfig {
    pub vocab_size: usize,
    /// The longest sequence the position table covers.
    pub block_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub d_model: usize,
    /// Share the token embedding with the LM head.
    pub tied_embeddings: bool,
    /// How the ops compute: the fused CPU kernels (default) or their composed twins,
    /// which run on every candle device ([`OpsBackend`]). Not part of the model: left out
    /// of the comparison and, at its default, of the serialised config (manifests written
    /// before it existed still load).
    #[serde(with = "ops_serde", skip_serializing_if = "is_fused")]
    pub ops: OpsBackend,
    /// What the products multiply in: f32, or bf16 with f32 sums, f32 master weights
    /// and bf16 saved activations ([`Precision`]). Not part of the model either: a
    /// checkpoint trained at one precision resumes at the other; left out of the
    /// serialised config at its default, f32.
    #[serde(with = "precision_serde", skip_serializing_if = "is_f32")]
    pub precision: Precision,
    /// Mixtures of experts in place of some blocks' MLPs; dense by default (and then
    /// left out of the serialised config).
    #[serde(skip_serializing_if = "MoeConfig::is_dense")]
    pub moe: MoeConfig,
    /// The probability of dropping each element of the embeddings' output and of each
    /// residual branch before its sum, while training (Megatron-LM's `--hidden-dropout`;
    /// GPT-2's `resid_pdrop` and `embd_pdrop`, 0.1 there), in `[0, 1)`. The masks depend
    /// on each element's place in the step, not on the layout (`switchyard_ops::DropoutMask`).
    /// How the model trains, not what it is: left out of the comparison and, at 0 (the
    /// default), of the serialised config.
    #[serde(skip_serializing_if = "is_zero")]
    pub hidden_dropout: f64,
}

fn is_zero(p: &f64) -> bool {
    *p == 0.0
}

impl PartialEq for GptConfig {
    fn eq(&self, other: &Self) -> bool {
        let key = |c: &GptConfig| {
            (
                c.vocab_size,
                c.block_size,
                c.n_layer,
                c.n_head,
                c.d_model,
                c.tied_embeddings,
                (
                    c.moe.experts,
                    c.moe.top_k,
                    c.moe.every,
                    c.moe.hidden(c.d_model),
                ),
            )
        };
        key(self) == key(other)
    }
}

impl Eq for GptConfig {}

pub(crate) fn is_fused(ops: &OpsBackend) -> bool {
    *ops == OpsBackend::Fused
}

/// [`OpsBackend`] as its name (`"fused"`, `"composed"`) for serde's `with` attribute
/// (switchyard-ops has no serde).
pub mod ops_serde {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    use switchyard_shard::OpsBackend;

    /// Writes the name.
    pub fn serialize<S: Serializer>(ops: &OpsBackend, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(ops.name())
    }

    /// Reads a name, refusing any other.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<OpsBackend, D::Error> {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

pub(crate) fn is_f32(p: &Precision) -> bool {
    *p == Precision::F32
}

/// [`Precision`] as its name (`"f32"`, `"bf16"`) for serde's `with` attribute.
pub mod precision_serde {
    use serde::{de::Error, Deserialize, Deserializer, Serializer};
    use switchyard_shard::Precision;

    /// Writes the name.
    pub fn serialize<S: Serializer>(p: &Precision, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(p.name())
    }

    /// Reads a name, refusing any other.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Precision, D::Error> {
        String::deserialize(d)?.parse().map_err(D::Error::custom)
    }
}

impl Default for GptConfig {
    /// The model `switchyard train` trains by default: 4 layers, d 192, 4 heads, bytes.
    fn default() -> Self {
        GptConfig {
            vocab_size: 256,
            block_size: 64,
            n_layer: 4,
            n_head: 4,
            d_model: 192,
            tied_embeddings: false,
            ops: OpsBackend::Fused,
            precision: Precision::F32,
            moe: MoeConfig::default(),
            hidden_dropout: 0.0,
        }
    }
}

impl GptConfig {
    /// A tiny model for tests and tutorials: d = 32, 4 heads, `n_layer` layers.
    pub fn tiny(n_layer: usize) -> GptConfig {
        GptConfig {
            vocab_size: 256,
            block_size: 64,
            n_layer,
            n_head: 4,
            d_model: 32,
            tied_embeddings: false,
            ops: OpsBackend::Fused,
            precision: Precision::F32,
            moe: MoeConfig::default(),
            hidden_dropout: 0.0,
        }
    }

    /// Refuses a config that cannot build a model.
    pub fn validate(&self) -> Result<(), ModelError> {
        let GptConfig {
            vocab_size,
            block_size,
            n_layer,
            n_head,
            d_model,
            ..
        } = *self;
        if vocab_size == 0 || block_size == 0 || n_layer == 0 || n_head == 0 || d_model == 0 {
            return Err(ModelError::Config(format!(
                "every model dimension must be positive: {self:?}"
            )));
        }
        if self.checked_param_count().is_none() {
            return Err(ModelError::Config(format!(
                "the model is too large: its parameter count (d_model {d_model}, {n_layer} layers, \
                 vocabulary {vocab_size}, block size {block_size}) overflows a {}-bit count",
                usize::BITS
            )));
        }
        self.moe.validate(n_layer)?;
        if !(0.0..1.0).contains(&self.hidden_dropout) {
            return Err(ModelError::Config(format!(
                "hidden_dropout (--hidden-dropout) must be at least 0 and below 1, got {}",
                self.hidden_dropout
            )));
        }
        if d_model % n_head != 0 {
            return Err(ModelError::Config(format!(
                "d_model {d_model} does not divide into {n_head} heads; choose d_model a multiple of the heads"
            )));
        }
        Ok(())
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head
    }

    /// Parameters of one dense transformer block: two LayerNorms, qkv, attention
    /// output and the MLP (4× hidden), all with biases. Saturates at `usize::MAX` for an
    /// absurd width ([`GptConfig::validate`] refuses such a model).
    pub fn block_params(&self) -> usize {
        self.checked_block_params().unwrap_or(usize::MAX)
    }

    /// A block with a mixture of experts: the dense block without its MLP
    /// (`8d² + 5d`), `E` experts of hidden width `h` (`2hd + h + d` each) and the router
    /// (`E · d`).
    fn checked_moe_block_params(&self) -> Option<usize> {
        let (d, e) = (self.d_model, self.moe.experts);
        let h = self.moe.hidden(d);
        let mlp = d
            .checked_mul(d)?
            .checked_mul(8)?
            .checked_add(d.checked_mul(5)?)?;
        let expert = h
            .checked_mul(d)?
            .checked_mul(2)?
            .checked_add(h)?
            .checked_add(d)?;
        self.checked_block_params()?
            .checked_sub(mlp)?
            .checked_add(expert.checked_mul(e)?)?
            .checked_add(e.checked_mul(d)?)
    }

    fn checked_block_params(&self) -> Option<usize> {
        let d = self.d_model;
        // 12 d² weights and 13 d biases and norms: 4d + (3d² + 3d) + (d² + d) + (4d² + 4d) + (4d² + d).
        d.checked_mul(d)?
            .checked_mul(12)?
            .checked_add(d.checked_mul(13)?)
    }

    /// All parameters (counting a tied table once). Saturates at `usize::MAX` for a
    /// model too large to count ([`GptConfig::validate`] refuses it).
    pub fn param_count(&self) -> usize {
        self.checked_param_count().unwrap_or(usize::MAX)
    }

    /// All parameters, or `None` if the count overflows.
    pub fn checked_param_count(&self) -> Option<usize> {
        let d = self.d_model;
        let tables = match self.tied_embeddings {
            true => self.vocab_size,
            false => self.vocab_size.checked_mul(2)?,
        };
        let emb = tables.checked_add(self.block_size)?.checked_mul(d)?;
        let moe = self.moe.moe_layers(self.n_layer);
        let blocks = (self.n_layer - moe)
            .checked_mul(self.checked_block_params()?)?
            .checked_add(moe.checked_mul(self.checked_moe_block_params()?)?)?;
        emb.checked_add(blocks)?.checked_add(d.checked_mul(2)?)
    }

    /// Every parameter's nanoGPT name and full shape, in the order the model creates
    /// them (a tied head has no `lm_head.weight`).
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (v, d, b) = (self.vocab_size, self.d_model, self.block_size);
        let mut out = vec![
            ("transformer.wte.weight".to_string(), vec![v, d]),
            ("transformer.wpe.weight".to_string(), vec![b, d]),
        ];
        for i in 0..self.n_layer {
            let p = |n: &str| format!("transformer.h.{i}.{n}");
            out.extend([
                (p("ln_1.weight"), vec![d]),
                (p("ln_1.bias"), vec![d]),
                (p("attn.c_attn.weight"), vec![3 * d, d]),
                (p("attn.c_attn.bias"), vec![3 * d]),
                (p("attn.c_proj.weight"), vec![d, d]),
                (p("attn.c_proj.bias"), vec![d]),
                (p("ln_2.weight"), vec![d]),
                (p("ln_2.bias"), vec![d]),
            ]);
            let mlp = |m: &str, h: usize| {
                [
                    (p(&format!("{m}.c_fc.weight")), vec![h, d]),
                    (p(&format!("{m}.c_fc.bias")), vec![h]),
                    (p(&format!("{m}.c_proj.weight")), vec![d, h]),
                    (p(&format!("{m}.c_proj.bias")), vec![d]),
                ]
            };
            match self.moe.is_moe_layer(i) {
                false => out.extend(mlp("mlp", 4 * d)),
                true => {
                    out.push((p("mlp.router.weight"), vec![self.moe.experts, d]));
                    for e in 0..self.moe.experts {
                        out.extend(mlp(&format!("mlp.experts.{e}"), self.moe.hidden(d)));
                    }
                }
            }
        }
        out.push(("transformer.ln_f.weight".to_string(), vec![d]));
        out.push(("transformer.ln_f.bias".to_string(), vec![d]));
        if !self.tied_embeddings {
            out.push(("lm_head.weight".to_string(), vec![v, d]));
        }
        out
    }

    /// The config of a nanoGPT state dict, from its tensor shapes (`name → shape`); the
    /// number of heads cannot be seen in the shapes and is given. The head is tied when
    /// the dict has no `lm_head.weight`.
    pub fn infer(
        shapes: &std::collections::HashMap<String, Vec<usize>>,
        n_head: usize,
    ) -> Result<GptConfig, ModelError> {
        let get = |n: &str| {
            shapes
                .get(n)
                .ok_or_else(|| ModelError::Weights(format!("the weights have no {n}")))
        };
        let wte = get("transformer.wte.weight")?;
        let wpe = get("transformer.wpe.weight")?;
        if wte.len() != 2 || wpe.len() != 2 {
            return Err(ModelError::Weights(format!(
                "unexpected embedding shapes {wte:?} and {wpe:?}"
            )));
        }
        let n_layer = (0..)
            .take_while(|i| shapes.contains_key(&format!("transformer.h.{i}.ln_1.weight")))
            .count();
        // A mixture of experts shows in its routers: `E` in their shape, and which
        // blocks have one gives `every`.
        let routers: Vec<(usize, usize)> = (0..n_layer)
            .filter_map(|i| {
                let r = shapes.get(&format!("transformer.h.{i}.mlp.router.weight"))?;
                Some((i, r.first().copied().unwrap_or(0)))
            })
            .collect();
        let moe = match routers.first() {
            None => MoeConfig::default(),
            Some(&(first, experts)) => {
                let h = shapes
                    .get(&format!("transformer.h.{first}.mlp.experts.0.c_fc.weight"))
                    .and_then(|s| s.first().copied())
                    .unwrap_or(0);
                MoeConfig {
                    experts,
                    every: first + 1,
                    ffn_hidden: if h == 4 * wte[1] { 0 } else { h },
                    // Not in the shapes: the caller's routing replaces it
                    // (`Model::import`).
                    top_k: MoeConfig::default().top_k.min(experts),
                    ..MoeConfig::default()
                }
            }
        };
        let found: Vec<usize> = routers.iter().map(|r| r.0).collect();
        let want: Vec<usize> = (0..n_layer).filter(|&i| moe.is_moe_layer(i)).collect();
        if found != want || routers.iter().any(|r| r.1 != moe.experts) {
            return Err(ModelError::Weights(format!(
                "the mixtures of experts are in blocks {found:?} with {:?} experts: switchyard \
                 has one in every N-th block, all with the same number of experts",
                routers.iter().map(|r| r.1).collect::<Vec<_>>()
            )));
        }
        let cfg = GptConfig {
            vocab_size: wte[0],
            block_size: wpe[0],
            n_layer,
            n_head,
            d_model: wte[1],
            tied_embeddings: !shapes.contains_key("lm_head.weight"),
            ops: OpsBackend::Fused,
            precision: Precision::F32,
            moe,
            hidden_dropout: 0.0,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// The weights a token passes in a block with a mixture of experts beyond those
    /// of a dense block: `k` experts of hidden `h` (`2·h·d` each) and the router
    /// (`E·d`), less the dense MLP (`8·d²`). Negative for small experts.
    pub fn moe_extra_weights(&self) -> f64 {
        let d = self.d_model as f64;
        let h = self.moe.hidden(self.d_model) as f64;
        self.moe.top_k as f64 * 2.0 * h * d + self.moe.experts as f64 * d - 8.0 * d * d
    }

    /// Training FLOPs per token at sequence length `t`: 6 per weight of every matrix
    /// product a token passes (forward 2, backward 4; of a mixture of experts the `k`
    /// experts it goes to and the router), plus attention's `q·kᵀ` and `a·v`
    /// (6 · 2 · n_layer · t · d, counting the full square as PaLM's appendix does).
    pub fn flops_per_token(&self, t: usize) -> f64 {
        let d = self.d_model as f64;
        // A mixture of experts: `k` expert MLPs a token and the router.
        let moe = self.moe.moe_layers(self.n_layer) as f64 * self.moe_extra_weights();
        let matmul_weights = self.n_layer as f64 * 12.0 * d * d + moe + self.vocab_size as f64 * d;
        6.0 * matmul_weights + 12.0 * self.n_layer as f64 * t as f64 * d
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_count_of_gpt2_small_is_124m() {
        let c = GptConfig {
            vocab_size: 50257,
            block_size: 1024,
            n_layer: 12,
            n_head: 12,
            d_model: 768,
            tied_embeddings: true,
            ops: OpsBackend::Fused,
            precision: Precision::F32,
            moe: MoeConfig::default(),
            hidden_dropout: 0.0,
        };
        // nanoGPT reports 124.44M with the position table.
        assert_eq!(c.param_count(), 124_439_808);
    }

    #[test]
    fn precision_is_optional_not_part_of_the_model_and_not_written_at_f32() {
        let json = serde_json::to_string(&GptConfig::tiny(2)).unwrap();
        assert!(!json.contains("precision"), "{json}");
        let bf16 = GptConfig {
            precision: Precision::Bf16,
            ..GptConfig::tiny(2)
        };
        assert_eq!(bf16, GptConfig::tiny(2));
        let json = serde_json::to_string(&bf16).unwrap();
        assert!(json.contains(r#""precision":"bf16""#), "{json}");
        let back: GptConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back.precision, Precision::Bf16);
        let bad = json.replace("bf16", "fp8");
        let e = serde_json::from_str::<GptConfig>(&bad)
            .unwrap_err()
            .to_string();
        assert!(e.contains("fp8") && e.contains("bf16"), "{e}");
    }

    #[test]
    fn ops_is_optional_not_part_of_the_model_and_not_written_at_its_default() {
        let json = serde_json::to_string(&GptConfig::tiny(2)).unwrap();
        assert!(!json.contains("ops"), "{json}");
        let old: GptConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(old.ops, OpsBackend::Fused);
        let composed = GptConfig {
            ops: OpsBackend::Composed,
            ..GptConfig::tiny(2)
        };
        assert_eq!(composed, GptConfig::tiny(2));
        let json = serde_json::to_string(&composed).unwrap();
        assert!(json.contains(r#""ops":"composed""#), "{json}");
        let back: GptConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back.ops, OpsBackend::Composed);
        let e = serde_json::from_str::<GptConfig>(r#"{"ops":"gpu"}"#).unwrap_err();
        assert!(e.to_string().contains("\"fused\" or \"composed\""), "{e}");
    }

    #[test]
    fn shapes_cover_every_parameter_and_infer_back() {
        let c = GptConfig::tiny(3);
        let shapes: std::collections::HashMap<String, Vec<usize>> =
            c.param_shapes().into_iter().collect();
        let count: usize = shapes.values().map(|s| s.iter().product::<usize>()).sum();
        assert_eq!(count, c.param_count());
        assert_eq!(GptConfig::infer(&shapes, c.n_head).unwrap(), c);
    }

    #[test]
    fn experts_have_their_names_count_and_infer_back() {
        let mut c = GptConfig::tiny(4);
        c.moe = MoeConfig {
            experts: 3,
            every: 2,
            ..MoeConfig::default()
        };
        let shapes: std::collections::HashMap<String, Vec<usize>> =
            c.param_shapes().into_iter().collect();
        let count: usize = shapes.values().map(|s| s.iter().product::<usize>()).sum();
        assert_eq!(count, c.param_count());
        assert_eq!(shapes["transformer.h.1.mlp.router.weight"], vec![3, 32]);
        assert_eq!(
            shapes["transformer.h.3.mlp.experts.2.c_fc.weight"],
            vec![128, 32]
        );
        assert!(shapes.contains_key("transformer.h.0.mlp.c_fc.weight"));
        assert!(!shapes.contains_key("transformer.h.1.mlp.c_fc.weight"));
        assert_eq!(GptConfig::infer(&shapes, c.n_head).unwrap(), c);
        // Experts where `every` cannot put them are refused.
        let mut odd = shapes.clone();
        odd.remove("transformer.h.3.mlp.router.weight");
        let e = GptConfig::infer(&odd, c.n_head).unwrap_err().to_string();
        assert!(e.contains("blocks [1]"), "{e}");
        // A width given as the default's value, and a single expert (top 1), read back.
        c.moe.ffn_hidden = 4 * c.d_model;
        (c.moe.experts, c.moe.top_k) = (1, 1);
        let shapes = c.param_shapes().into_iter().collect();
        assert_eq!(GptConfig::infer(&shapes, c.n_head).unwrap(), c);
    }

    #[test]
    fn a_parameter_count_that_overflows_is_refused() {
        let mut c = GptConfig::tiny(2);
        c.d_model = 1 << 40;
        c.n_head = 1;
        assert_eq!(c.checked_param_count(), None);
        assert_eq!(c.param_count(), usize::MAX);
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("the model is too large"));
        let mut c = GptConfig::tiny(2);
        c.n_layer = usize::MAX / 2;
        assert!(c.validate().unwrap_err().to_string().contains("overflows"));
    }

    #[test]
    fn heads_must_divide_the_width() {
        let mut c = GptConfig::tiny(2);
        c.n_head = 5;
        assert!(c
            .validate()
            .unwrap_err()
            .to_string()
            .contains("does not divide into 5 heads"));
    }
}
