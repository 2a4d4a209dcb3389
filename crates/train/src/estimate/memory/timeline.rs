//! The timeline the estimate walks: what a stage's backward of one microbatch adds
//! ([`StageBytes`]), what a rank holds all step ([`Fixed`]), and the running totals whose
//! largest moment is the peak ([`Timeline`]).

use super::RankEstimate;

/// What a backward of one microbatch of a stage adds, in bytes.
pub(super) struct StageBytes {
    pub(super) grads: usize,
    /// What a split backward's `I` copies for its `W` (0: `I` runs the whole backward).
    pub(super) deferred: usize,
    pub(super) saved: usize,
    pub(super) backward: usize,
    pub(super) largest: usize,
    pub(super) input: usize,
    /// The segments a backward by segment runs, one after the other.
    pub(super) segments: usize,
}

impl StageBytes {
    /// What waits from a split backward's `I` to its `W` (the module doc).
    pub(super) fn pending(&self) -> usize {
        match self.deferred {
            0 => self.grads,
            d => d,
        }
    }

    /// What a `W` computes beside what is live: the deferred products' gradients.
    pub(super) fn computed_at_w(&self) -> usize {
        match self.deferred {
            0 => 0,
            _ => self.grads,
        }
    }
}

/// Bytes held all step long.
#[derive(Clone, Copy)]
pub(super) struct Fixed {
    pub(super) params: usize,
    pub(super) optimizer: usize,
    pub(super) other: usize,
    /// The rank thread's matrix-multiply scratch (counted with the gradients: the
    /// backward first needs it).
    pub(super) scratch: usize,
}

pub(super) struct Timeline {
    pub(super) fixed: Fixed,
    pub(super) acts: usize,
    pub(super) grads: usize,
    /// Sent gradients the receiver still holds.
    pub(super) in_flight: usize,
    /// Communication buffers (ZeRO's parameter shard and gathered bucket).
    pub(super) comm: usize,
    /// Held while a segment computes, by category (ZeRO 3's gathered segment).
    pub(super) extra: [usize; 6],
    pub(super) peak: usize,
    pub(super) at_peak: [usize; 6],
}

impl Timeline {
    pub(super) fn new(fixed: Fixed) -> Timeline {
        Timeline {
            fixed,
            acts: 0,
            grads: 0,
            in_flight: 0,
            comm: 0,
            extra: [0; 6],
            peak: 0,
            at_peak: [0; 6],
        }
    }

    /// A moment holding what is live plus `grads` more gradient bytes and `opt` more
    /// optimizer bytes.
    pub(super) fn observe(&mut self, grads: usize, opt: usize) {
        let f = self.fixed;
        let mut now = [
            f.params,
            self.grads + grads + f.scratch + self.in_flight,
            f.optimizer + opt,
            self.acts,
            self.comm,
            f.other,
        ];
        for (n, e) in now.iter_mut().zip(self.extra) {
            *n += e;
        }
        let total = now.iter().sum();
        if total > self.peak {
            self.peak = total;
            self.at_peak = now;
        }
    }

    pub(super) fn estimate(&self, pp: usize, params: usize) -> RankEstimate {
        RankEstimate {
            pp,
            peak_bytes: self.peak,
            at_peak: self.at_peak,
            params,
        }
    }
}
