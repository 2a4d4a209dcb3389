//! [`OpsBackend`]: which implementation of the ops a model uses.

use std::fmt;
use std::str::FromStr;

use candle_core::{DType, Result, Tensor};

use crate::Reduce;

/// Which implementation of the ops runs: the fused CPU kernels or their composed twins
/// ([`crate::composed`]: compositions of candle's own differentiable operations, which run
/// on every candle device). Passed explicitly with a model's configuration; there is no
/// global switch.
///
/// The fused kernels are an optimisation of the CPU path: [`OpsBackend::Fused`] uses them
/// for `f32` and `f64` tensors on the CPU and the composed twins for everything else (a
/// CUDA or Metal tensor, another dtype), so any op runs on any device.
/// [`OpsBackend::Composed`] uses the composed twins everywhere, also on the CPU (to test
/// them there, or to compare the two).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum OpsBackend {
    /// The fused kernels where they exist (f32/f64 on the CPU), the composed twins elsewhere.
    #[default]
    Fused,
    /// The composed twins everywhere.
    Composed,
}

impl OpsBackend {
    /// Every backend, in the order of the command line's help.
    pub const ALL: [OpsBackend; 2] = [OpsBackend::Fused, OpsBackend::Composed];

    /// The name on the command line and in configuration files: `fused` or `composed`.
    pub fn name(self) -> &'static str {
        match self {
            OpsBackend::Fused => "fused",
            OpsBackend::Composed => "composed",
        }
    }

    /// Whether an op on `x` runs the fused kernel: `Fused`, an f32/f64 tensor, on the CPU.
    pub fn fuses(self, x: &Tensor) -> bool {
        self == OpsBackend::Fused
            && x.device().is_cpu()
            && matches!(x.dtype(), DType::F32 | DType::F64)
    }

    /// Whether an op that reads bf16 activations (at [`crate::Precision::Bf16`]: the
    /// LayerNorm, the linear ops and pairs, the cross-entropy) runs the fused kernel on
    /// `x`: as [`OpsBackend::fuses`], or a bf16 tensor on the CPU.
    pub fn fuses_bf16(self, x: &Tensor) -> bool {
        self.fuses(x)
            || (self == OpsBackend::Fused && x.device().is_cpu() && x.dtype() == DType::BF16)
    }

    /// [`crate::layer_norm`] on this backend.
    pub fn layer_norm(
        self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        eps: f64,
    ) -> Result<Tensor> {
        crate::norm::layer_norm_on(self, x, weight, bias, eps)
    }

    /// [`crate::gelu`] on this backend.
    pub fn gelu(self, x: &Tensor) -> Result<Tensor> {
        crate::gelu::gelu_on(self, x)
    }

    /// [`crate::causal_self_attention`] on this backend.
    pub fn causal_self_attention(self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        crate::attention::causal_self_attention_on(self, q, k, v)
    }

    /// [`crate::causal_attention_packed`] on this backend.
    pub fn causal_attention_packed(self, qkv: &Tensor, n_head: usize) -> Result<Tensor> {
        crate::attention::causal_attention_packed_on(self, qkv, n_head)
    }

    /// [`crate::cross_entropy`] on this backend.
    pub fn cross_entropy(self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        crate::loss::cross_entropy_on(self, logits, targets)
    }

    /// [`crate::cross_entropy_parallel`] on this backend.
    pub fn cross_entropy_parallel(
        self,
        local_logits: &Tensor,
        targets: &Tensor,
        vocab_start: usize,
        vocab_size: usize,
        reduce_max: Reduce,
        reduce_sum: Reduce,
    ) -> Result<Tensor> {
        crate::loss::cross_entropy_parallel_on(
            self,
            local_logits,
            targets,
            vocab_start,
            vocab_size,
            reduce_max,
            reduce_sum,
        )
    }
}

impl fmt::Display for OpsBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The error of parsing an [`OpsBackend`]: the text, and what it may be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParseOpsBackendError(pub String);

impl fmt::Display for ParseOpsBackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown ops backend {:?}: expected \"fused\" or \"composed\"",
            self.0
        )
    }
}

impl std::error::Error for ParseOpsBackendError {}

impl FromStr for OpsBackend {
    type Err = ParseOpsBackendError;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        OpsBackend::ALL
            .into_iter()
            .find(|b| b.name() == s)
            .ok_or_else(|| ParseOpsBackendError(s.to_string()))
    }
}
