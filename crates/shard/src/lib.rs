//! # switchyard-shard: tensor parallelism for training on candle
//!
//! Megatron-style tensor parallelism (TP) **with a backward pass**. Candle ships
//! tensor-parallel layers for inference only: its all-reduce has no gradient. Here every
//! collective is an autograd op whose backward is the dual collective, so a tensor-parallel
//! model trains, and its forward values and gradients equal the single-device model's
//! (the tests check this to 1e-5 in f32 and 1e-10 in f64 at tp = 1, 2, 4).
//!
//! Vocabulary: an **axis** is an axis of the device mesh (tp, pp, dp); a **dim** is a
//! tensor dimension. `p` is the size of the tensor-parallel group.
//!
//! ## The pieces
//!
//! * [`ShardSpec`]: how a full tensor is laid out over the group (`Replicated`,
//!   `Split { dim, blocks }` with fused sub-blocks such as GPT's q | k | v, or
//!   `Padded { dim, size }`: a vocabulary of any size, padded with zero rows to
//!   `V_p = ⌈V/p⌉·p` inside the ranks and `[V, d]` everywhere else).
//! * [`ParamStore`] / [`Builder`]: parameters are declared by their full shape and
//!   spec; each rank creates only its shard. [`Init`] generates the *full* tensor from
//!   `(seed, name)` and slices it, so for one seed the shards at any degree are slices of
//!   the tp = 1 weights; [`ParamSource::Full`] slices tensors loaded from a checkpoint.
//! * [`collectives`]: Megatron's paired operators **f** ([`copy_to_region`]: identity
//!   forward, all-reduce backward) and **g** ([`reduce_from_region`]: all-reduce forward,
//!   identity backward), gather/scatter, and the sequence-parallel pair.
//! * Layers: [`ColumnParallelLinear`] (`Y = XA`, `A = [A_1 … A_p]`),
//!   [`RowParallelLinear`] (`Y = Σ_i X_i A_i`), [`VocabParallelEmbedding`] (and its
//!   untied LM head, [`ColumnParallelLinear::vocab_head`]),
//!   [`vocab_parallel_cross_entropy`], [`ParallelSelfAttention`] and [`ParallelMlp`].
//!
//! ## Design
//!
//! * **No global state.** The tensor-parallel communicator (`Arc<dyn Communicator>`,
//!   size 1 = no parallelism, with zero communication) is passed to each layer when it is
//!   built; a layer given a group other than its store's is an error naming the layer.
//! * **Cost.** A transformer block (attention + MLP) costs exactly 2 all-reduces forward
//!   (one `g` per row-parallel layer) and 2 backward (one `f` per column-parallel layer).
//!   The vocab-parallel loss costs 2 forward (max, and the fused sum-exp/target) and 0
//!   backward; the vocab-parallel embedding 1 forward and 0 backward. Under sequence
//!   parallelism ([`SequenceSplit`]) each all-reduce is an all-gather and a
//!   reduce-scatter instead, and the backward adds the freed inputs' all-gathers and one
//!   small all-reduce per replicated parameter.
//! * **Replicated means identical.** Outside the parallel regions activations, LayerNorm
//!   parameters and row-parallel biases are replicated and receive identical, complete
//!   gradients on every rank: no extra gradient all-reduce over tp is needed by the
//!   trainer (under sequence parallelism the activations are split, and `f` on each such
//!   parameter sums its gradient inside the backward).
//! * Errors are [`candle_core::Error`]s wrapping a [`ShardError`] whose message names the
//!   parameter or layer.
//!
//! ## Example
//!
//! Two ranks (threads) build an MLP under `transformer.h.0`, run forward and backward,
//! and get the single-device gradient, split by rows:
//!
//! ```
//! use candle_core::{DType, Device, Tensor, Var};
//! use switchyard_comm::local;
//! use switchyard_shard::{LayerInit, ParallelMlp, ParamSource, ParamStore};
//!
//! let grads = local::launch(2, |tp| -> candle_core::Result<Vec<usize>> {
//!     let store = ParamStore::for_group(tp.as_ref(), DType::F32, ParamSource::Init { seed: 1 })?;
//!     let vb = store.builder().pp("transformer.h.0");
//!     let mlp = ParallelMlp::new(&vb, tp.clone(), 8, 32, LayerInit::default())?;
//!     let x = Var::from_tensor(&Tensor::ones((2, 3, 8), DType::F32, &Device::Cpu)?)?;
//!     let loss = mlp.forward(x.as_tensor())?.sqr()?.sum_all()?; // replicated on both ranks
//!     let g = loss.backward()?;
//!     let fc = store.get("transformer.h.0.mlp.c_fc.weight").unwrap();
//!     Ok(g.get(fc.var.as_tensor()).unwrap().dims().to_vec())
//! })
//! .unwrap();
//! assert_eq!(grads, vec![vec![16, 8]; 2]); // each rank: half of c_fc's 32 rows
//! ```
//!
//! ## Tutorials
//!
//! * [Chapter 3, "Tensor parallelism"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/03-tensor-parallelism.md): the
//!   Megatron math, `f` and `g`, and a tensor-parallel MLP checked against one device
//!   (example `tensor_parallel`).
//! * [Chapter 5, "Bring your own model"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/05-bring-your-own-model.md): a
//!   model of your own from these layers, its token table tied to its head (example
//!   `own_model`).

mod all_to_all;
mod attention;
pub mod collectives;
mod embedding;
mod error;
mod init;
mod linear;
mod loss;
mod mlp;
mod moe;
mod pair;
mod param;
mod rng;
mod sequence;
mod spec;
pub mod storage;

pub use all_to_all::all_to_all_rows;
pub use attention::{LayerInit, ParallelSelfAttention};
pub use collectives::{
    copy_to_region, gather_from_region, gather_seq, reduce_from_region, reduce_scatter_seq,
    scatter_to_region,
};
pub use embedding::VocabParallelEmbedding;
pub use error::ShardError;
pub use linear::{ColumnConfig, ColumnParallelLinear, RowConfig, RowParallelLinear};
pub use loss::{vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_with};
pub use mlp::ParallelMlp;
pub use moe::{route, LossScale, MoeOptions, MoeShared, MoeStats, ParallelMoe, Routing};
pub use param::{Builder, Init, Param, ParamSource, ParamStore};
pub use sequence::{SequenceSplit, SEQUENCE_DIM};
pub use spec::{gather_full_tensor, ShardSpec};
pub use switchyard_ops::{OpsBackend, Precision};

/// The tensor-parallel group a layer computes over (size 1: no tensor parallelism).
///
/// Model code holds and passes this handle but never calls it: every collective
/// happens inside this crate's layers and operators.
pub type TpGroup = std::sync::Arc<dyn switchyard_comm::Communicator>;

/// A tensor-parallel group of one rank, for single-device use of the layers.
pub fn single_device() -> TpGroup {
    switchyard_comm::local::solo()
}
