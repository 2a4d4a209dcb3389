//! Data-parallel gradients all-reduced while the backward still runs
//! (`overlap_grad_reduce`: PyTorch DDP's bucketed overlap, Megatron's
//! `--overlap-grad-reduce`).
//!
//! - **Buckets.** One per segment (transformer block) of this rank's stages: the
//!   parameters that segment alone uses ([`Units`], ZeRO 2's cut). A parameter several
//!   segments use (a token table tied to the head), or whose copies on other pipeline
//!   ranks are summed first, is *resident*: it is all-reduced after the pipeline, as
//!   without overlap.
//! - **When.** The executor hands every segment's gradients of every microbatch to the
//!   hooks ([`SegmentHooks::grads`], at `B`, or at `W` of a split backward). The hooks add
//!   them up in microbatch order, as the executor would, and at the stage's `m`-th
//!   microbatch the bucket is final: it is flattened and handed to the communication
//!   thread, which all-reduces it over a data-parallel group of its own while the main
//!   thread goes on with the backward of the segments before it.
//! - **Exposed.** After the pipeline the step waits for the buckets still in flight, then
//!   all-reduces the resident ones. A replica that ends its pipeline early also waits for
//!   the slower ones, which is imbalance, not communication: the communication the
//!   backward did not hide ([`GradReduceStats::exposed`]) runs from the moment the last
//!   replica of the group ended its pipeline to the moment the last one's all-reduces
//!   were done (the step works it out from every rank's times, which it all-gathers
//!   anyway; under MPI the processes' clocks agree as well as the barrier that starts
//!   training aligned them, to a fraction of a millisecond). The trace shows the
//!   all-reduces on a track of the rank's own.
//! - **Same sums.** Each element is the same sum over the replicas as without overlap (a
//!   bucket's composition changes nothing element-wise), and the segmented backward runs
//!   the same kernels on the same values: the gradients are bit-identical (tested), but
//!   for a parameter two segments of one stage use (a tied table with a single stage),
//!   whose two gradients the segmented backward adds in another order than one autograd
//!   graph: equal to f32 rounding.
//! - **No hangs.** A failed all-reduce comes back as the error of the step's wait, naming
//!   the bucket and its segment. A worker that fails with a bucket in flight leaves the
//!   thread to end when that all-reduce fails ([`crate::comm_thread`]).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use candle_core::{Shape, Tensor, TensorId};
use crossbeam_channel::{unbounded, Receiver, Sender};
use switchyard_comm::{CommError, Communicator, ReduceOp};
use switchyard_mem::Category;
use switchyard_pipeline::{SegmentHooks, Stage};

use switchyard_shard::Param;

use crate::comm_thread::{CommThread, Deliver};
use crate::error::{fail, Context, IntoTrainError, Result};
use crate::zero::Units;

/// A bucket's sum over the replicas, cut back into its parameters' gradients, and when
/// the thread worked on it.
struct Done {
    k: usize,
    grads: Result<Vec<Tensor>>,
    start: Instant,
    end: Instant,
}

/// The communication thread of one rank.
pub struct GradReducer {
    thread: CommThread,
}

impl GradReducer {
    /// Splits `dp` for the thread and starts it; its allocations are charged to this
    /// thread's ledger, as communication buffers. Collective over `dp`.
    pub fn new(dp: &dyn Communicator) -> Result<GradReducer> {
        Ok(GradReducer {
            thread: CommThread::new(dp, "grad-reduce", "the gradient all-reduce thread")?,
        })
    }

    /// Starts all-reducing bucket `k`, flattened, whose parameters have `shapes`.
    fn start(&self, k: usize, flat: Tensor, shapes: Vec<Shape>, done: Sender<Done>) -> Result<()> {
        let reduce = move |comm: &dyn Communicator| -> Deliver {
            let start = Instant::now();
            let sum = comm.all_reduce(&flat, ReduceOp::Sum);
            drop(flat);
            let end = Instant::now();
            // The rank's own gradients, right away: the in-process backend hands every
            // replica one shared sum, which must not wait on one replica's ledger.
            let grads = sum.map_err(crate::TrainError::from).and_then(|sum| {
                let _gradients = switchyard_mem::scope(Category::Gradients);
                let shapes: Vec<&Shape> = shapes.iter().collect();
                Ok(super::grads::unflatten(&sum, &shapes)?)
            });
            let d = Done {
                k,
                grads,
                start,
                end,
            };
            // The step that waited may be gone (its rank failed).
            Box::new(move || drop(done.send(d)))
        };
        match self.thread.run(Box::new(reduce)) {
            true => Ok(()),
            false => Err(ended(self.thread.rank, Some(k))),
        }
    }
}

/// The thread is gone (it panicked): the sum of bucket `k` (of a bucket, `None`) will
/// not come.
fn ended(rank: usize, k: Option<usize>) -> crate::TrainError {
    let e = CommError::Backend {
        op: "all_reduce",
        rank,
        reason: "the gradient all-reduce thread has ended".into(),
    };
    let what = match k {
        Some(k) => format!("the data-parallel gradient all-reduce of bucket {k}"),
        None => "the data-parallel gradient all-reduce".to_string(),
    };
    crate::TrainError::from(e).into_train_error(what)
}

/// One data-parallel gradient all-reduce of a step, for the trace.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReduceSpan {
    /// The communication thread's bucket ([`Units::groups`]), or `None` for the
    /// all-reduce after the pipeline (every bucket without overlap, the resident ones
    /// with it).
    pub bucket: Option<usize>,
    /// Start, in microseconds since the worker's epoch.
    pub start_us: f64,
    /// Duration, including the wait for the other replicas to arrive.
    pub dur_us: f64,
}

/// A step's data-parallel gradient all-reduce on this rank.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GradReduceStats {
    /// When this rank's pipeline ended, in microseconds since the worker's epoch.
    pub pipeline_end_us: f64,
    /// When its last all-reduce of the step was done.
    pub done_us: f64,
    /// Its all-reduces.
    pub spans: Vec<ReduceSpan>,
    /// The communication the backward did not hide, over this rank's data-parallel
    /// group: from the end of the slowest replica's pipeline to the end of the last
    /// replica's all-reduces (filled in by the step from every rank's times).
    pub exposed: Duration,
    /// How much later the slowest replica's pipeline ended than the fastest's: time a
    /// replica waits for another, which no overlap can hide.
    pub imbalance: Duration,
}

/// The buckets the hooks had reduced by the end of the pipeline.
pub(super) struct Reduced {
    /// Per parameter index, its gradient summed over the replicas.
    pub grads: Vec<(usize, Tensor)>,
    pub stats: GradReduceStats,
}

/// What the hooks accumulate during a step.
#[derive(Default)]
struct Sums {
    /// Per parameter index, the gradient summed over the microbatches so far.
    grads: HashMap<usize, Tensor>,
    /// Per segment, the microbatches whose gradients came in.
    seen: HashMap<(u32, usize), usize>,
    /// Buckets handed to the thread.
    sent: usize,
}

/// The hooks of one step of one rank with `overlap_grad_reduce`.
pub(super) struct ReduceHooks<'w> {
    reducer: &'w GradReducer,
    units: &'w Units,
    /// This rank's parameters, by index.
    params: &'w [Param],
    /// The stages of this rank, by id, with the index of each of their parameters.
    stages: HashMap<u32, Vec<usize>>,
    microbatches: usize,
    sums: Mutex<Sums>,
    done: Sender<Done>,
    results: Receiver<Done>,
}

impl<'w> ReduceHooks<'w> {
    pub(super) fn new(
        reducer: &'w GradReducer,
        units: &'w Units,
        params: &'w [Param],
        stages: &[(u32, &dyn Stage)],
        index: &HashMap<TensorId, usize>,
        microbatches: usize,
    ) -> ReduceHooks<'w> {
        let stages = stages
            .iter()
            .map(|&(s, st)| (s, st.params().iter().map(|v| index[&v.id()]).collect()))
            .collect();
        let (done, results) = unbounded();
        ReduceHooks {
            reducer,
            units,
            params,
            stages,
            microbatches,
            sums: Mutex::new(Sums::default()),
            done,
            results,
        }
    }

    /// Waits for every bucket in flight; `epoch` dates the trace's spans.
    pub(super) fn finish(self, epoch: Instant) -> Result<Reduced> {
        let sums = self.sums.into_inner().unwrap_or_else(|e| e.into_inner());
        let expected = self.units.bucket_of.len();
        if sums.sent != expected {
            fail!(
                Config,
                "overlap_grad_reduce: {} of this rank's {expected} gradient buckets were \
                 final at the end of the pipeline",
                sums.sent
            );
        }
        drop(self.done);
        let since = |t: Instant| t.saturating_duration_since(epoch).as_secs_f64() * 1e6;
        let mut stats = GradReduceStats {
            pipeline_end_us: since(Instant::now()),
            ..GradReduceStats::default()
        };
        let mut grads = Vec::new();
        for _ in 0..sums.sent {
            let d = self
                .results
                .recv()
                .map_err(|_| ended(self.reducer.thread.rank, None))?;
            let sums = d.grads.with_context(|| {
                let seg = self.units.bucket_of.iter().find(|(_, &k)| k == d.k);
                let (stage, segment) = seg.map(|(s, _)| *s).unwrap_or_default();
                format!(
                    "the data-parallel gradient all-reduce of bucket {} (stage {stage}, \
                     segment {segment})",
                    d.k
                )
            })?;
            grads.extend(self.units.groups[d.k].iter().copied().zip(sums));
            stats.spans.push(ReduceSpan {
                bucket: Some(d.k),
                start_us: since(d.start),
                dur_us: (d.end - d.start).as_secs_f64() * 1e6,
            });
        }
        stats.done_us = since(Instant::now());
        Ok(Reduced { grads, stats })
    }
}

impl SegmentHooks for ReduceHooks<'_> {
    fn acquire(&self, _stage: u32, _segment: usize) -> candle_core::Result<()> {
        Ok(())
    }

    fn release(&self, _stage: u32, _segment: usize) -> candle_core::Result<()> {
        Ok(())
    }

    fn grads(
        &self,
        stage: u32,
        segment: usize,
        grads: &mut [Option<Tensor>],
    ) -> candle_core::Result<()> {
        let Some(&k) = self.units.bucket_of.get(&(stage, segment)) else {
            return Ok(());
        };
        let _gradients = switchyard_mem::scope(Category::Gradients);
        let mut sums = self.sums.lock().unwrap_or_else(|e| e.into_inner());
        let idx = &self.stages[&stage];
        for (p, g) in self.units.take_owned((stage, segment), idx, grads) {
            let sum = match sums.grads.remove(&p) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            sums.grads.insert(p, sum);
        }
        let seen = sums.seen.entry((stage, segment)).or_insert(0);
        *seen += 1;
        if *seen < self.microbatches {
            return Ok(());
        }
        // Final: a parameter no microbatch reached contributes zeros, as without overlap.
        let mut parts = Vec::new();
        for &p in &self.units.groups[k] {
            let g = match sums.grads.remove(&p) {
                Some(g) => g,
                None => self.params[p].var.zeros_like()?,
            };
            parts.push(g);
        }
        let shapes = parts.iter().map(|t| t.shape().clone()).collect();
        let flat = super::grads::flatten(&parts)?;
        drop(parts);
        sums.sent += 1;
        self.reducer
            .start(k, flat, shapes, self.done.clone())
            .map_err(|e| candle_core::Error::Msg(format!("{e:#}")))
    }
}
