//! # switchyard-ops: differentiable building blocks for training on candle
//!
//! A handful of functions that every transformer needs, each of which **has a correct
//! backward pass**, and each a fused kernel for training speed. Several look-alikes in
//! `candle-nn` (`ops::softmax_last_dim`, `ops::layer_norm`, `ops::rms_norm`,
//! `LayerNorm::forward`) are inference kernels without a backward: gradients silently stop
//! at them. This crate depends on `candle-core` (and the `gemm` crate candle itself uses
//! for its products) and never calls into `candle-nn`.
//!
//! | function | math |
//! |---|---|
//! | [`layer_norm`] | `(x − mean) / sqrt(var + eps) · weight + bias` over the last dim (biased variance) |
//! | [`gelu`] | `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))` (the tanh approximation of GPT-2) |
//! | [`linear`] | `x · wᵀ + b`, with `w` stored `[out, in]` as in PyTorch |
//! | [`linear_gelu`] | `gelu(x · wᵀ + b)` |
//! | [`linear_with`] | the above, with collectives on the output and the input gradient (tensor parallelism) |
//! | [`mlp`] | `gelu(x · w1ᵀ + b1) · w2ᵀ + b2`, a transformer's MLP in one op, with the same collectives |
//! | [`attention_block`] | `attention(x · w_qkvᵀ + b_qkv) · w_projᵀ + b_proj`, a transformer's attention in one op |
//! | [`causal_self_attention`] | `softmax(q · kᵀ / √hd + M) · v`, `M` = 0 on and below the diagonal, −∞ above |
//! | [`causal_attention_packed`] | the same on a fused `[B, T, 3·H·hd]` qkv projection, giving `[B, T, H·hd]` |
//! | [`cross_entropy`] | `mean_i (logsumexp(z_i) − z_i[t_i])` |
//! | [`cross_entropy_parallel`] | the same over a vocabulary-parallel slice of the logits |
//! | [`dropout`] | `a ⊙ m / (1 − p)`, the mask `m` a hash of each element's place in the job ([`DropoutMask`]) |
//! | [`dropout_add`] | `x + a ⊙ m / (1 − p)`: a residual sum with dropout on its branch, in one pass |
//! | [`matmul_bf16`] | `a · b` with bf16 products and f32 sums (AMX, AVX-512 BF16 or emulated; see [`Bf16Kernel`]); no backward |
//! | [`linear_bf16`] | `x · wᵀ + b` with bf16 products, f32 sums, an f32 master weight and a bf16 output; with its backward |
//!
//! ## Every device: fused kernels and composed twins
//!
//! The fused kernels are an optimisation of the CPU path. Every op has a composed twin
//! in [`composed`] (a composition of candle's own differentiable operations, which runs
//! on every candle device and in every dtype) with the same inputs, outputs and parameter
//! layout, tested against the fused op in value and gradient. [`OpsBackend`] chooses,
//! explicitly and per call (a field of [`LinearOptions`] and [`PairOptions`], a method for
//! the other ops): `Fused` runs the fused kernel on f32/f64 CPU tensors and the twin on
//! anything else (a CUDA or Metal tensor always takes the twin); `Composed` runs the twin
//! everywhere. The plain functions are `Fused`.
//!
//! ## Design
//!
//! * **Small and stable API.** Plain functions on [`Tensor`]s, no modules and no state.
//!   The tests check values and gradients against independent reference math (plain Rust
//!   loops and finite differences), never against the implementation.
//! * **Fused custom ops with a hand-written backward** for `f32` and `f64` (other dtypes
//!   fall back to candle primitives). Each function is one node of candle's graph instead
//!   of a chain of primitives: candle allocates and zero-fills a gradient for every node
//!   it backpropagates through, so fewer nodes is less memory traffic. Each op keeps what
//!   its backward needs (a pre-activation, row statistics, a log-sum-exp) and no more:
//!   attention recomputes its probabilities flash-style instead of storing `(B, H, T, T)`.
//! * **Fast kernels.** Products go through the `gemm` crate with its AVX-512 kernels,
//!   writing into uninitialised outputs (the bias placed first, the product accumulated
//!   onto it), except the attention's small ones, which register-tile kernels for
//!   AVX-512 and for AVX2 run in place; element-wise and row kernels are compiled three times, for AVX-512, for
//!   AVX2 and FMA (each chosen at run time, the same rounding) and for the baseline CPU,
//!   with a polynomial `exp` that vectorises. Work is
//!   split over the current rayon pool: a worker's own threads.
//! * **Exact where it matters.** Softmax and log-sum-exp subtract the row maximum, so
//!   nothing overflows. `f32` uses the fast `exp` and `tanh` (within a few ulp); `f64`
//!   uses the standard library's. GELU's backward is the exact derivative
//!   (`Tensor::gelu`'s backward uses constants rounded to six digits).
//!
//! ## Example
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use switchyard_ops::{cross_entropy, gelu, layer_norm, linear};
//!
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let x = Tensor::new(&[[0.5f32, -1.0, 2.0], [1.5, 0.0, -0.5]], &dev)?;
//! let ln_w = Var::ones(3, candle_core::DType::F32, &dev)?;
//! let ln_b = Var::zeros(3, candle_core::DType::F32, &dev)?;
//! let w = Var::new(&[[0.1f32, 0.2, 0.3], [-0.3, 0.1, 0.0]], &dev)?; // [out = 2, in = 3]
//!
//! let h = layer_norm(&x, &ln_w, &ln_b, 1e-5)?;
//! let logits = linear(&gelu(&h)?, &w, None)?; // [2, 2]
//! let targets = Tensor::new(&[1u32, 0], &dev)?;
//! let loss = cross_entropy(&logits, &targets)?;
//! let grads = loss.backward()?;
//! assert!(grads.get(&w).is_some() && grads.get(&ln_w).is_some() && grads.get(&ln_b).is_some());
//! # Ok(())
//! # }
//! ```
//!
//! ## Tutorial
//!
//! [Chapter 5, "Bring your own model"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/05-bring-your-own-model.md) builds
//! a model from these functions and the layers of `switchyard-shard` (example
//! `own_model`).

mod attention;
mod aux_loss;
mod avx2;
mod avx512;
mod backend;
mod bf16;
mod bias;
pub mod composed;
mod deferred;
mod dropout;
mod gelu;
mod kernel;
mod linear;
mod loss;
mod mlp;
mod norm;
mod precision;
mod sgemm;
#[cfg(test)]
mod twins;

pub use attention::{causal_attention_packed, causal_self_attention};
pub use aux_loss::attach_loss;
pub use backend::{OpsBackend, ParseOpsBackendError};
pub use bf16::{linear_bf16, linear_bf16_on, matmul_bf16, matmul_bf16_with, Bf16Kernel};
pub use bias::add_bias;
pub use deferred::{DeferredWeights, WeightGradJob};
pub use dropout::{dropout, dropout_add, DropoutMask};
pub use gelu::gelu;
pub use kernel::product_path;
pub use linear::{linear, linear_gelu, linear_with, LinearOptions, Reduce, Regather};
pub use loss::{cross_entropy, cross_entropy_parallel};
pub use mlp::{attention_block, attention_block_with, mlp, mlp_with, PairOptions, PairWeights};
pub use norm::layer_norm;
pub use precision::{ParsePrecisionError, Precision};

#[cfg(doc)]
use candle_core::Tensor;
