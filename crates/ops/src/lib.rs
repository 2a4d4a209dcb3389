//! # switchyard-ops: differentiable building blocks for training on candle
//!
//! A handful of functions that every transformer needs, each of which **has a correct
//! backward pass**. Several look-alikes in `candle-nn` (`ops::softmax_last_dim`,
//! `ops::layer_norm`, `ops::rms_norm`, `LayerNorm::forward`) are inference kernels without
//! a backward: gradients silently stop at them. This crate depends on `candle-core` only
//! and never calls into `candle-nn`.
//!
//! | function | math |
//! |---|---|
//! | [`layer_norm`] | `(x − mean) / sqrt(var + eps) · weight + bias` over the last dim (biased variance) |
//! | [`gelu`] | `0.5 · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))` (the tanh approximation of GPT-2) |
//! | [`linear`] | `x · wᵀ + b`, with `w` stored `[out, in]` as in PyTorch |
//! | [`causal_self_attention`] | `softmax(q · kᵀ / √hd + M) · v`, `M` = 0 on and below the diagonal, −∞ above |
//! | [`cross_entropy`] | `mean_i (logsumexp(z_i) − z_i[t_i])` |
//!
//! ## Design
//!
//! * **Small and stable API.** Plain functions on [`Tensor`]s, no modules and no state, so
//!   the internals can be swapped for fused kernels (custom ops with a hand-written
//!   backward) without touching a caller. The tests check values and gradients against
//!   independent reference math (plain Rust loops and finite differences), never against
//!   the implementation.
//! * **Composite where candle's primitives are exact.** [`layer_norm`], [`linear`],
//!   [`causal_self_attention`] and [`cross_entropy`] are built from candle primitives
//!   that all have a backward. Softmax and log-sum-exp subtract a *detached* row maximum:
//!   the shift cancels mathematically, so the gradient stays exact and nothing overflows.
//! * **[`gelu`] is a custom op.** `Tensor::gelu` computes the right forward, but its
//!   backward uses constants rounded to six digits (a ~1e-7 relative error in the
//!   gradient). [`gelu`] runs one fused forward pass for `f32`/`f64` and a fused,
//!   exact derivative in its backward; other dtypes fall back to a composite of
//!   primitives.
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

mod attention;
mod gelu;
mod linear;
mod loss;
mod norm;

pub use attention::causal_self_attention;
pub use gelu::gelu;
pub use linear::linear;
pub use loss::cross_entropy;
pub use norm::layer_norm;

#[cfg(doc)]
use candle_core::Tensor;
