//! The training configuration, and every check that must pass before a worker starts.

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use switchyard_comm::MeshShape;
use switchyard_models::{plan_stages, Model, SplitSpec};
use switchyard_schedule::{ScheduleChoice, ScheduleKind};

use crate::device::DeviceSpec;
use crate::error::{err, TrainError};
use crate::optim::{AdamWConfig, Decay};

mod machine;
mod savers;
mod schedule;

use machine::{human_bytes, THREAD_LIMIT_WHY};
pub use machine::{memory_info, thread_limit, Bytes, MemoryInfo, BYTES_PER_PARAM};
pub use savers::Recompute;

/// Everything a run needs, for a model whose config is `M` (a [`Model`]).
/// `switchyard train` builds it from flags and `--config`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(
    deny_unknown_fields,
    default,
    bound(
        serialize = "M: Serialize",
        deserialize = "M: DeserializeOwned + Default"
    )
)]
pub struct TrainConfig<M> {
    pub model: M,
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    /// A built-in schedule (`gpipe`, `1f1b`, `interleaved`, `zb-h1`) or the path of a CSV
    /// schedule (one row per pipeline rank, e.g. `0,0F0,0F1,0B0,0B1`); written as that
    /// text in a configuration file or a manifest (see [`ScheduleChoice`]).
    pub schedule: ScheduleChoice,
    /// Microbatches per step on each data-parallel replica.
    pub microbatches: usize,
    /// Model chunks per pipeline rank (interleaved only).
    pub virtual_stages: usize,
    /// How layers divide into stages: `even`, `balanced` or counts such as `3,2`.
    pub split: SplitSpec,
    pub steps: usize,
    /// Sequences per step, over all data-parallel replicas.
    pub batch: usize,
    pub seq_len: usize,
    pub lr: f64,
    pub min_lr: f64,
    pub warmup: usize,
    pub weight_decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    /// AdamW's ε, added to √v̂.
    pub eps: f64,
    /// Which parameters `weight_decay` applies to: `matrices` (nanoGPT) or `all`
    /// (`torch.optim.AdamW`'s default).
    pub decay: Decay,
    /// Clip the global gradient norm to this (0 = no clipping).
    pub grad_clip: f64,
    /// Initial weights (with no `--init`) and, when `shuffle`, the data order.
    pub seed: u64,
    /// Data-parallel gradient all-reduce bucket size, in MiB, for what is all-reduced
    /// after the backward (everything without `overlap_grad_reduce`), ZeRO 1's
    /// reduce-scatters and ZeRO 2 and 3's of the resident parameters.
    pub bucket_mib: f64,
    /// ZeRO stage over the data-parallel replicas ([`crate::zero`]): 0 (off: every
    /// replica all-reduces the gradients and keeps all of AdamW's moments), 1 (each
    /// replica keeps the moments of `1/dp` of every bucket: gradients are
    /// reduce-scattered, the own shard updated, the parameters all-gathered), 2 (also
    /// each segment's full gradients dropped once scattered) or 3 (also the parameters
    /// sharded, each segment's gathered just before it runs). Absent in configurations
    /// and manifests written before it existed (0).
    pub zero: u8,
    /// ZeRO 3: gather the next segment's parameters on a communication thread while the
    /// current one computes (`true`, the default), or each just before it runs
    /// ([`crate::zero::Prefetcher`]). Costs one segment's parameters (and this
    /// replica's shard of them) of communication buffer.
    pub zero_prefetch: bool,
    /// Without ZeRO and with `dp > 1`: all-reduce each segment's gradients (one bucket
    /// per transformer block) on a communication thread as soon as the last
    /// microbatch's backward has made them final, while the backward of the segments
    /// before it still runs (`true`, the default; PyTorch DDP's and Megatron's
    /// `overlap_grad_reduce`), or all of them after the pipeline, `bucket_mib` at a time
    /// (`false`). The sums are the same either way. With ZeRO 2 and 3, each segment's
    /// reduce-scatter runs on a communication thread while the backward goes on
    /// ([`crate::zero::Scatterer`]), or on the rank's own thread (`false`). Absent in
    /// configurations and manifests written before it existed (`true`).
    pub overlap_grad_reduce: bool,
    /// Bound on any single blocking communication, in seconds.
    pub comm_timeout_secs: f64,
    /// Compute threads per worker (0 = share the cores out).
    pub threads_per_worker: usize,
    /// Draw each step's windows at seeded random offsets (`false`: consecutive windows
    /// from offset 0, in order; see [`crate::data`]).
    pub shuffle: bool,
    /// The fraction at the end of the data held out for validation (0: none; a `val.bin`
    /// beside a `train.bin` is the validation split instead).
    pub val_fraction: f64,
    /// Report the validation loss every this many steps (0: only at the end), when the
    /// data has a validation split.
    pub eval_every: usize,
    /// Batches of the validation split each validation loss averages over.
    pub eval_batches: usize,
    /// The candle device the run computes on (`cpu`, `cuda:N`, `metal`); left out of a
    /// manifest at its default. See [`DeviceSpec`].
    #[serde(skip_serializing_if = "DeviceSpec::is_cpu")]
    pub device: DeviceSpec,
    /// Refuse to start when the estimated peak of any worker
    /// ([`crate::estimate::memory`]) exceeds this; `None`: refuse only beyond the
    /// machine's available memory.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_memory_per_worker: Option<Bytes>,
    /// Activation recomputation ([`Recompute`]).
    pub recompute: Recompute,
    /// Sequence parallelism (Megatron's `--sequence-parallel`; with `tp > 1`, models
    /// that support it): the LayerNorms and the residual stream run on `seq_len / tp`
    /// positions per tensor-parallel rank, each block's all-reduces become an
    /// all-gather before its column-parallel products and a reduce-scatter after its
    /// row-parallel ones ([`switchyard_shard::SequenceSplit`]). Same parameters, same
    /// checkpoints, the gradients equal to rounding. Absent in configurations and
    /// manifests written before it existed (`false`).
    pub sequence_parallel: bool,
    /// Expert parallelism: the experts of each mixture of experts are spread over groups
    /// of `ep` data-parallel replicas (consecutive ones), which send each other their
    /// tokens with an all-to-all so that a replica computes `E / ep` experts for the
    /// tokens of the whole group. Must divide `dp` and the model's experts; 1 (the
    /// default, and in manifests written before it existed): every replica computes
    /// every expert for its own tokens.
    pub ep: usize,
}

impl<M: Default> Default for TrainConfig<M> {
    /// The README's run, with the model's default config: pipeline and tensor
    /// parallelism on 2 cores.
    fn default() -> Self {
        TrainConfig::with_model(M::default())
    }
}

impl<M> TrainConfig<M> {
    /// The README's run's settings for `model` (see [`Default`]).
    pub fn with_model(model: M) -> Self {
        TrainConfig {
            model,
            dp: 1,
            pp: 2,
            tp: 2,
            schedule: ScheduleChoice::Named(ScheduleKind::OneFOneB),
            microbatches: 4,
            virtual_stages: 1,
            split: SplitSpec::Even,
            steps: 1000,
            batch: 16,
            seq_len: 64,
            lr: 3e-3,
            min_lr: 3e-4,
            warmup: 20,
            weight_decay: 0.1,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            decay: Decay::Matrices,
            grad_clip: 1.0,
            seed: 1337,
            bucket_mib: 25.0,
            zero: 0,
            zero_prefetch: true,
            overlap_grad_reduce: true,
            comm_timeout_secs: 300.0,
            threads_per_worker: 0,
            shuffle: true,
            val_fraction: 0.0,
            eval_every: 0,
            eval_batches: 8,
            device: DeviceSpec::Cpu,
            max_memory_per_worker: None,
            recompute: Recompute::None,
            sequence_parallel: false,
            ep: 1,
        }
    }
}

impl<M> TrainConfig<M> {
    pub fn mesh(&self) -> MeshShape {
        MeshShape::new(self.dp, self.pp, self.tp)
    }

    /// Workers in all: `dp × pp × tp` (saturating; [`TrainConfig::validate`] refuses a
    /// layout whose product overflows).
    pub fn world_size(&self) -> usize {
        self.dp.saturating_mul(self.pp).saturating_mul(self.tp)
    }

    /// Whether the sequence really is split: [`TrainConfig::sequence_parallel`] with a
    /// tensor-parallel group to split it over (at `tp 1` the flag changes nothing).
    pub fn splits_sequence(&self) -> bool {
        self.sequence_parallel && self.tp > 1
    }

    /// Pipeline stages in all: `pp × virtual stages`.
    pub fn num_stages(&self) -> usize {
        self.pp.saturating_mul(self.virtual_stages)
    }

    /// Sequences per microbatch.
    pub fn microbatch_size(&self) -> usize {
        self.batch / self.dp.saturating_mul(self.microbatches).max(1)
    }

    /// Whether the data-parallel all-reduce runs during the backward: `overlap_grad_reduce`
    /// without ZeRO and with replicas. The executor then runs every stage segment by
    /// segment, for its hooks.
    pub fn overlaps_grad_reduce(&self) -> bool {
        self.overlap_grad_reduce && self.zero == 0 && self.dp > 1
    }

    /// Whether ZeRO 2 and 3's reduce-scatters run on a communication thread during the
    /// backward ([`crate::zero::Scatterer`]): `overlap_grad_reduce` with stage 2 or 3 and
    /// replicas.
    pub fn overlaps_reduce_scatter(&self) -> bool {
        self.overlap_grad_reduce && self.zero >= 2 && self.dp > 1
    }

    pub fn tokens_per_step(&self) -> usize {
        self.batch.saturating_mul(self.seq_len)
    }

    /// AdamW's settings.
    pub fn adamw(&self) -> AdamWConfig {
        AdamWConfig {
            beta1: self.beta1,
            beta2: self.beta2,
            eps: self.eps,
            weight_decay: self.weight_decay,
            decay: self.decay,
        }
    }
}

impl<M: Model> TrainConfig<M> {
    /// Every check that can be made before any worker starts, each with what to change.
    /// The cheap arithmetic comes first, so that no absurd value (a layout whose product
    /// overflows, more stages than layers, a model larger than this machine's memory)
    /// reaches the schedule generator or an allocation.
    pub fn validate(&self) -> Result<(), TrainError> {
        self.validate_with(true)
    }

    /// [`TrainConfig::validate`] without this machine: for planning a run elsewhere
    /// (`switchyard plan --cluster`), a model larger than this machine's memory passes.
    pub fn validate_layout(&self) -> Result<(), TrainError> {
        self.validate_with(false)
    }

    fn validate_with(&self, this_machine: bool) -> Result<(), TrainError> {
        savers::check_zero(self.zero, &self.device)?;
        self.device.check()?;
        let m = &self.model;
        m.validate()?;
        self.mesh().validate()?;
        let world = self
            .dp
            .checked_mul(self.pp)
            .and_then(|x| x.checked_mul(self.tp))
            .ok_or_else(|| {
                err!(Config,
                    "--dp {} × --pp {} × --tp {} overflows: use a layout of at most a few thousand workers",
                    self.dp, self.pp, self.tp
                )
            })?;
        let limit = thread_limit();
        if self.threads_per_worker > limit {
            return Err(err!(
                Config,
                "--threads-per-worker {} is more than {limit} threads ({}): use at most the \
                 cores of this machine ({})",
                self.threads_per_worker,
                THREAD_LIMIT_WHY,
                switchyard_comm::threads::available_cores()
            ));
        }
        // One worker holds at least its share of one replica (pp × tp workers split it).
        let share = self.state_bytes() / (self.pp as u128 * self.tp as u128);
        if let Some(total) = memory_info().total.filter(|_| this_machine) {
            if share > u128::from(total) {
                return Err(err!(
                    Config,
                    "the model does not fit: {:.2}M parameters need {} of parameters, gradients \
                     and AdamW state per replica, {} per worker over --pp {} × --tp {}, more than \
                     this machine's {} of memory; use a smaller model",
                    m.param_count() as f64 / 1e6,
                    human_bytes(self.state_bytes()),
                    human_bytes(share),
                    self.pp,
                    self.tp,
                    human_bytes(u128::from(total))
                ));
            }
        }
        self.validate_numbers()?;
        m.check_layout(self.tp, self.seq_len)?;
        self.validate_sequence_parallel()?;
        self.validate_expert_parallel()?;
        if self.microbatches == 0 || self.batch == 0 || self.steps == 0 {
            return Err(err!(
                Config,
                "--batch, --microbatches and --steps must be at least 1"
            ));
        }
        if self.eval_batches == 0 {
            return Err(err!(Config, "--eval-batches must be at least 1"));
        }
        let split = self.dp.checked_mul(self.microbatches).ok_or_else(|| {
            err!(
                Config,
                "--dp {} × --microbatches {} overflows: use fewer microbatches",
                self.dp,
                self.microbatches
            )
        })?;
        if !self.batch.is_multiple_of(split) {
            return Err(err!(Config,
                "--batch {} does not split into --dp {} × --microbatches {}: use a batch that is a multiple of {split}",
                self.batch, self.dp, self.microbatches
            ));
        }
        if self.virtual_stages == 0 {
            return Err(err!(Config, "--virtual-stages must be at least 1"));
        }
        if self.schedule.kind().is_some() {
            // `--virtual-stages` against the kind, before any program is built.
            self.schedule_kind()?;
        }
        if self.schedule.is_interleaved() && self.virtual_stages < 2 {
            return Err(err!(Config,
                "the interleaved schedule needs --virtual-stages 2 or more (got {}); with 1 it is plain 1f1b",
                self.virtual_stages
            ));
        }
        let stages = self.pp.checked_mul(self.virtual_stages).ok_or_else(|| {
            err!(
                Config,
                "--pp {} × --virtual-stages {} overflows",
                self.pp,
                self.virtual_stages
            )
        })?;
        // Every stage needs a layer: check it before any schedule is generated.
        plan_stages(&m.costs(self.seq_len), stages, &self.split)?;
        if self.schedule.is_interleaved() && !self.microbatches.is_multiple_of(self.pp) {
            return Err(TrainError::Config(self.interleaved_advice()));
        }
        if stages.saturating_mul(self.microbatches) > MAX_SCHEDULE_PAIRS {
            return Err(err!(
                Config,
                "{stages} stages × --microbatches {} is more than {MAX_SCHEDULE_PAIRS} forwards \
                 per step, a schedule too large to build and check: use fewer microbatches",
                self.microbatches
            ));
        }
        // The schedule generator knows its own constraints; ask it now rather than
        // inside a worker.
        self.program()?;
        if self.batch.checked_mul(self.seq_len).is_none() {
            return Err(err!(
                Config,
                "--batch {} × --seq-len {} tokens per step overflows",
                self.batch,
                self.seq_len
            ));
        }
        debug_assert_eq!(world, self.world_size());
        Ok(())
    }

    /// `--ep`: a mixture of experts whose experts divide over groups of replicas that
    /// divide the data-parallel axis.
    fn validate_expert_parallel(&self) -> Result<(), TrainError> {
        let ep = self.ep;
        if ep == 1 {
            return Ok(());
        }
        if ep == 0 || !self.dp.is_multiple_of(ep) {
            return Err(err!(
                Config,
                "--ep {ep} must divide --dp {}: the experts spread over groups of ep \
                 data-parallel replicas",
                self.dp
            ));
        }
        let experts = self.model.experts();
        if experts == 0 || !experts.is_multiple_of(ep) {
            return Err(err!(
                Config,
                "--ep {ep} spreads each mixture of experts' experts over {ep} replicas, but \
                 the model has {experts} experts a mixture: use an --ep that divides --experts"
            ));
        }
        Ok(())
    }

    /// `--sequence-parallel`: a model that splits its sequence, and whole positions on
    /// every tensor-parallel rank.
    fn validate_sequence_parallel(&self) -> Result<(), TrainError> {
        if !self.splits_sequence() {
            return Ok(());
        }
        if !self.model.sequence_parallel() {
            return Err(err!(
                Config,
                "--sequence-parallel: the model \"{}\" does not split its sequence (its \
                 Model::sequence_parallel is false); leave the flag (or `sp` in --layout) out",
                M::NAME
            ));
        }
        if !self.seq_len.is_multiple_of(self.tp) {
            return Err(err!(
                Config,
                "--sequence-parallel (`sp` in --layout) splits the sequence over the \
                 tensor-parallel ranks, but \
                 --seq-len {} does not divide by --tp {}: use a --seq-len that is a multiple \
                 of {}",
                self.seq_len,
                self.tp,
                self.tp
            ));
        }
        Ok(())
    }

    /// The floating-point settings, each named as its flag (or its `--config` key).
    fn validate_numbers(&self) -> Result<(), TrainError> {
        let bad =
            |what: &str, v: f64, want: &str| Err(err!(Config, "{what} must be {want}, got {v}"));
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("--lr", self.lr, "a positive number");
        }
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return bad(
                "--min-lr",
                self.min_lr,
                &format!("a number from 0 to --lr ({})", self.lr),
            );
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad("--weight-decay", self.weight_decay, "a number ≥ 0");
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return bad("--grad-clip", self.grad_clip, "a number ≥ 0 (0: off)");
        }
        for (flag, v) in [("--beta1", self.beta1), ("--beta2", self.beta2)] {
            if !(v.is_finite() && (0.0..1.0).contains(&v)) {
                return bad(flag, v, "at least 0 and below 1");
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("--eps", self.eps, "a positive number");
        }
        if !(self.bucket_mib.is_finite() && self.bucket_mib > 0.0) {
            return bad(
                "bucket_mib (a --config key)",
                self.bucket_mib,
                "a positive number",
            );
        }
        if !(self.val_fraction.is_finite() && (0.0..1.0).contains(&self.val_fraction)) {
            return bad(
                "--val-fraction",
                self.val_fraction,
                "at least 0 and below 1 (0: no validation split)",
            );
        }
        if !(self.comm_timeout_secs > 0.0 && self.comm_timeout_secs <= MAX_TIMEOUT_SECS) {
            return bad(
                "--comm-timeout",
                self.comm_timeout_secs,
                &format!("a positive number of seconds, at most {MAX_TIMEOUT_SECS:e}"),
            );
        }
        Ok(())
    }

    /// The error for interleaving with a microbatch count that is not a multiple of
    /// `pp`, with changes that are accepted as they are.
    fn interleaved_advice(&self) -> String {
        let (pp, m) = (self.pp, self.microbatches);
        let up = (m / pp + 1) * pp;
        let split = self.dp * up;
        let batch = match self.batch.is_multiple_of(split) {
            true => String::new(),
            false => format!(" --batch {}", self.batch.div_ceil(split) * split),
        };
        format!(
            "the interleaved schedule on --pp {pp} needs --microbatches to be a multiple of {pp}, \
             got {m}: use --microbatches {up}{batch}, or --schedule 1f1b (without --virtual-stages)"
        )
    }
}

/// The most (stage, microbatch) pairs a step's schedule may have: generating,
/// lowering and validating a program is linear in them.
pub const MAX_SCHEDULE_PAIRS: usize = 1 << 20;

/// The longest `--comm-timeout`, in seconds (about 31 years); beyond it a timeout is
/// not a bound.
pub const MAX_TIMEOUT_SECS: f64 = 1e9;

#[cfg(test)]
mod tests;
