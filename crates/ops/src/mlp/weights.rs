//! [`PairWeights`]: a pair's two weights, each fused with its bias, built once a step.

use candle_core::{bail, DType, Result, Tensor};

use super::PairOptions;
use crate::Precision;

/// The weights of a column-then-row pair, each fused with its bias as a last column
/// (`[w | b]`, or `w` alone without a bias): built once, for instance once per training
/// step, and used by any number of [`mlp_with`] or [`attention_block_with`] calls (one
/// per microbatch). Gradients flow back to the original weights and biases.
///
/// [`mlp_with`]: super::mlp_with
/// [`attention_block_with`]: super::attention_block_with
#[derive(Clone, Debug)]
pub struct PairWeights {
    /// `[w1 | b1]` and `[w2 | b2]` (f32 and f64 on the CPU), or `w1` and `w2`.
    pub(super) fused: [Tensor; 2],
    /// The originals, for the composed twin.
    pub(crate) w: [Tensor; 2],
    pub(crate) b: [Option<Tensor>; 2],
    /// Whether `fused[k]` is a copy (weight and bias side by side) rather than the
    /// weight itself.
    pub(super) copied: [bool; 2],
}

impl PairWeights {
    /// `w1` `[n1, d]`, `b1` `[n1]`, `w2` `[out, m]`, `b2` `[out]` (PyTorch layouts).
    pub fn new(w1: &Tensor, b1: Option<&Tensor>, w2: &Tensor, b2: Option<&Tensor>) -> Result<Self> {
        let (n1, _) = w1.dims2()?;
        let (out, _) = w2.dims2()?;
        for (b, n, name) in [(b1, n1, "b1"), (b2, out, "b2")] {
            if let Some(b) = b {
                if b.dims() != [n] {
                    bail!(
                        "pair weights: {name} must have shape [{n}], got {:?}",
                        b.dims()
                    );
                }
            }
        }
        let copies = |w: &Tensor, b: Option<&Tensor>| {
            b.is_some() && matches!(w.dtype(), DType::F32 | DType::F64) && w.device().is_cpu()
        };
        let fuse = |w: &Tensor, b: Option<&Tensor>| match b {
            Some(b) if copies(w, Some(b)) => Tensor::cat(&[w, &b.unsqueeze(1)?], 1),
            _ => w.contiguous(),
        };
        Ok(PairWeights {
            fused: [fuse(w1, b1)?, fuse(w2, b2)?],
            w: [w1.clone(), w2.clone()],
            b: [b1.cloned(), b2.cloned()],
            copied: [
                copies(w1, b1) || !w1.is_contiguous(),
                copies(w2, b2) || !w2.is_contiguous(),
            ],
        })
    }

    /// The two tensors the fused op reads: `[w1 | b1]` and `[w2 | b2]`, or the weights
    /// themselves (sharing their storage) where nothing is fused.
    pub fn fused(&self) -> &[Tensor; 2] {
        &self.fused
    }

    /// The same weights cut from the autograd graph (sharing their storage): what a
    /// split backward's forward passes ([`PairOptions::defer`]), so that the backward
    /// owes the weights no gradient.
    pub fn detached(&self) -> PairWeights {
        PairWeights {
            fused: self.fused.clone().map(|t| t.detach()),
            w: self.w.clone().map(|t| t.detach()),
            b: self.b.clone().map(|b| b.map(|t| t.detach())),
            copied: self.copied,
        }
    }

    /// Whether each of [`PairWeights::fused`] is a tensor of its own (a copy of the
    /// weight beside its bias) rather than the weight's own storage.
    pub fn copied(&self) -> [bool; 2] {
        self.copied
    }

    /// Whether [`mlp_with`] and [`attention_block_with`] run the fused op on `x` with
    /// these weights and `opts` (rather than the composed twin, for another backend,
    /// dtype or device).
    ///
    /// [`mlp_with`]: super::mlp_with
    /// [`attention_block_with`]: super::attention_block_with
    pub fn runs_fused(&self, x: &Tensor, opts: &PairOptions) -> bool {
        let half = x.dtype() == DType::BF16 && opts.precision == Precision::Bf16;
        let wt = self.fused[0].dtype();
        let fused = match half {
            true => opts.backend.fuses_bf16(x) && wt == DType::F32,
            false => opts.backend.fuses(x) && wt == x.dtype(),
        };
        fused && self.fused[0].device().is_cpu()
    }

    /// `(n1, d)` and `(out, m)`.
    pub(super) fn dims(&self) -> Result<[(usize, usize); 2]> {
        Ok([self.w[0].dims2()?, self.w[1].dims2()?])
    }
}
