//! [`Precision`]: what the products of the fused ops multiply in.

use std::fmt;
use std::str::FromStr;

/// The precision of the matrix products inside the fused ops ([`crate::linear_with`],
/// [`crate::mlp_with`], [`crate::attention_block_with`]). Passed explicitly with a
/// model's configuration, beside [`crate::OpsBackend`]; there is no global switch.
///
/// * [`Precision::F32`]: f32 products of f32 tensors.
/// * [`Precision::Bf16`]: mixed precision. Every weight product (the linear maps, the
///   MLP's two, the attention's qkv and output projections; forward, `dX` and `dW`)
///   rounds its two operands to bf16 and sums the exact products in f32 (AMX, AVX-512
///   BF16, or emulated: [`crate::Bf16Kernel`]). The attention's own products
///   (`q·kᵀ`, `P·v`), the tensors between the ops, the master weights and their
///   gradients, LayerNorm, softmax, GELU and the loss stay f32; what an op keeps for
///   its backward (the MLP's pre-activation and GELU output, the attention's
///   `q | k | v` and output) is stored in bf16. The middle function of a pair runs on
///   its pre-activation rounded to bf16, the value its backward reads back; the
///   attention's backward reads its output as kept, in bf16.
///
/// A CPU without bf16 instructions computes the same numbers, emulated (the f32 kernels
/// on the rounded operands).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Precision {
    /// f32 products.
    #[default]
    F32,
    /// bf16 products with f32 sums; bf16 saved activations.
    Bf16,
}

impl Precision {
    /// Every precision, in the order of the command line's help.
    pub const ALL: [Precision; 2] = [Precision::F32, Precision::Bf16];

    /// The name on the command line and in configuration files: `f32` or `bf16`.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
        }
    }

    /// Bytes of one element of what the ops save for their backward.
    pub fn saved_bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::Bf16 => 2,
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The error of parsing a [`Precision`]: the text, and what it may be.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParsePrecisionError(pub String);

impl fmt::Display for ParsePrecisionError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown precision {:?}: expected \"f32\" or \"bf16\"",
            self.0
        )
    }
}

impl std::error::Error for ParsePrecisionError {}

impl FromStr for Precision {
    type Err = ParsePrecisionError;

    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| ParsePrecisionError(s.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_bad_names_say_what_is_allowed() {
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>(), Ok(p));
        }
        let e = "fp16".parse::<Precision>().unwrap_err().to_string();
        assert!(e.contains("fp16") && e.contains("bf16"), "{e}");
    }
}
