//! The sampler: which tokens row `i` of step `s` reads (see the module docs of
//! [`super`]), the same on every layout.

use std::ops::Range;

use candle_core::{Device, Result, Tensor};

use super::TokenSource;

/// How batches are drawn: everything but the data. See the module docs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sampler {
    pub seed: u64,
    pub seq_len: usize,
    /// Sequences per step, over all data-parallel replicas.
    pub batch: usize,
    pub shuffle: bool,
}

impl Sampler {
    /// The sampler of a run.
    pub fn of<M>(cfg: &crate::TrainConfig<M>) -> Sampler {
        Sampler {
            seed: cfg.seed,
            seq_len: cfg.seq_len,
            batch: cfg.batch,
            shuffle: cfg.shuffle,
        }
    }

    /// The validation batches of a run: sequential windows.
    pub fn validation<M>(cfg: &crate::TrainConfig<M>) -> Sampler {
        Sampler {
            shuffle: false,
            ..Sampler::of(cfg)
        }
    }

    /// The first token of row `i` of step `step` in a source of `len` tokens
    /// (`len ≥ seq_len + 1`).
    pub fn start(&self, len: usize, step: usize, i: usize) -> usize {
        let w = self.seq_len + 1;
        if self.shuffle {
            let span = (len - self.seq_len) as u64;
            let h = mix(mix(mix(self.seed) ^ step as u64) ^ i as u64);
            (h % span) as usize
        } else {
            let n = (len / w) as u128;
            let k = step as u128 * self.batch as u128 + i as u128;
            (k % n) as usize * w
        }
    }

    /// Rows `rows` of step `step` from `src`: inputs and targets, each `rows.len() ×
    /// seq_len` ids, row-major.
    pub fn rows(
        &self,
        src: &dyn TokenSource,
        step: usize,
        rows: Range<usize>,
    ) -> (Vec<u32>, Vec<u32>) {
        let (l, n) = (self.seq_len, rows.len());
        let mut x = Vec::with_capacity(n * l);
        let mut y = Vec::with_capacity(n * l);
        let mut w = vec![0u32; l + 1];
        for i in rows {
            src.read(self.start(src.len(), step, i), &mut w);
            x.extend_from_slice(&w[..l]);
            y.extend_from_slice(&w[1..]);
        }
        (x, y)
    }

    /// [`Sampler::rows`] as `[n, seq_len]` u32 tensors.
    pub fn tensors(
        &self,
        src: &dyn TokenSource,
        step: usize,
        rows: Range<usize>,
    ) -> Result<(Tensor, Tensor)> {
        let n = rows.len();
        let (x, y) = self.rows(src, step, rows);
        Ok((
            Tensor::from_vec(x, (n, self.seq_len), &Device::Cpu)?,
            Tensor::from_vec(y, (n, self.seq_len), &Device::Cpu)?,
        ))
    }
}

/// SplitMix64's mixer.
pub(super) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
