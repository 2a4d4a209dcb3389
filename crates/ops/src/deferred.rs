//! A split backward's deferred weight gradients (the zero-bubble schedules' `I` and `W`,
//! Qi et al. 2023).
//!
//! A fused op given a [`DeferredWeights`] that is split ([`DeferredWeights::set_split`])
//! computes only its input gradient in its backward (the `I` of a split backward) and
//! returns no gradient for its weights: it keeps owned copies of what the weight
//! products read (the output gradient, the op's input and middle activations) in a job
//! that [`DeferredWeights::run_oldest`] runs later (the `W`), giving the weights'
//! gradients. Not split, the op computes everything at once, as without one.
//!
//! The weights' gradients are bit for bit those of a whole backward as long as the job
//! runs on a rayon pool of the `I`'s size: the products and the biases' sums split their
//! rows by the current pool's threads, and the sums' order follows the split. (The
//! pipeline executor runs `I` and `W` on the rank's own pool.)

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use candle_core::{Result, Tensor};
use half::bf16;

use crate::bf16::Held;

/// One op's deferred weight products: the gradients of its weight inputs, in order.
pub type WeightGradJob = Box<dyn FnOnce() -> Result<Vec<Tensor>> + Send>;

/// Where fused ops defer their weight gradients to (see the module doc). Clones share
/// one queue.
#[derive(Clone, Default)]
pub struct DeferredWeights(Arc<Mutex<State>>);

#[derive(Default)]
struct State {
    split: bool,
    jobs: VecDeque<WeightGradJob>,
}

impl DeferredWeights {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the backwards that run from now on defer their weight products (an `I`)
    /// or compute them at once (a `B`).
    pub fn set_split(&self, on: bool) {
        self.lock().split = on;
    }

    pub fn is_split(&self) -> bool {
        self.lock().split
    }

    pub(crate) fn defer(&self, job: WeightGradJob) {
        self.lock().jobs.push_back(job);
    }

    /// Runs the job deferred first (the oldest backward's weight products) and returns
    /// its weight gradients; `None` when nothing is deferred.
    pub fn run_oldest(&self) -> Result<Option<Vec<Tensor>>> {
        // Taken out of the lock first: the products run without holding it.
        let job = self.lock().jobs.pop_front();
        job.map(|j| j()).transpose()
    }

    /// How many backwards' weight products wait.
    pub fn pending(&self) -> usize {
        self.lock().jobs.len()
    }

    /// Drops every deferred job (a step that failed, or ended with some never run).
    pub fn clear(&self) {
        self.lock().jobs.clear();
    }
}

impl std::fmt::Debug for DeferredWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.lock();
        f.debug_struct("DeferredWeights")
            .field("split", &s.split)
            .field("pending", &s.jobs.len())
            .finish()
    }
}

/// Rows that a deferred weight product reads, owned (copied out of the backward, or
/// moved when the backward made them).
pub(crate) enum Owned<T> {
    Full(Vec<T>),
    Half(Vec<bf16>),
}

impl<T: Copy> Owned<T> {
    pub(crate) fn of(h: Held<T>) -> Self {
        match h {
            Held::Full(x) => Owned::Full(x.to_vec()),
            Held::Half(x) => Owned::Half(x.to_vec()),
        }
    }

    /// `half` when there is one, else `full`: [`Held::of`], moved.
    pub(crate) fn moved(full: Vec<T>, half: Option<Vec<bf16>>) -> Self {
        match half {
            Some(h) => Owned::Half(h),
            None => Owned::Full(full),
        }
    }

    pub(crate) fn held(&self) -> Held<'_, T> {
        match self {
            Owned::Full(x) => Held::Full(x),
            Owned::Half(x) => Held::Half(x),
        }
    }
}
