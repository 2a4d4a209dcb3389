//! The training configuration, and every check that must pass before a worker starts.

use serde::{Deserialize, Serialize};
use switchyard_comm::MeshShape;
use switchyard_models::{plan_stages, GptConfig, LayerCosts, SplitSpec};
use switchyard_schedule::{generate, lower, validate, Program, ScheduleKind};

/// Everything a run needs. `switchyard train` builds it from flags and `--config`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    pub model: GptConfig,
    pub dp: usize,
    pub pp: usize,
    pub tp: usize,
    /// `gpipe`, `1f1b`, `interleaved`, `zb-h1`, or the path of a CSV schedule
    /// (one row per pipeline rank, e.g. `0,0F0,0F1,0B0,0B1`).
    pub schedule: String,
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
    /// Clip the global gradient norm to this (0 = no clipping).
    pub grad_clip: f64,
    pub seed: u64,
    /// Data-parallel gradient all-reduce bucket size, in MiB.
    pub bucket_mib: f64,
    /// Bound on any single blocking communication, in seconds.
    pub comm_timeout_secs: f64,
    /// Compute threads per worker (0 = share the cores out).
    pub threads_per_worker: usize,
}

impl Default for TrainConfig {
    /// The README's run: a small GPT with pipeline and tensor parallelism on 2 cores.
    fn default() -> Self {
        TrainConfig {
            model: GptConfig::default(),
            dp: 1,
            pp: 2,
            tp: 2,
            schedule: "1f1b".into(),
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
            grad_clip: 1.0,
            seed: 1337,
            bucket_mib: 25.0,
            comm_timeout_secs: 300.0,
            threads_per_worker: 0,
        }
    }
}

impl TrainConfig {
    pub fn mesh(&self) -> MeshShape {
        MeshShape::new(self.dp, self.pp, self.tp)
    }

    pub fn world_size(&self) -> usize {
        self.dp * self.pp * self.tp
    }

    /// Whether the schedule is a CSV file rather than a generated kind.
    pub fn schedule_is_csv(&self) -> bool {
        self.schedule.ends_with(".csv")
    }

    /// The lowered, validated schedule program of one pipeline (all `pp` ranks).
    pub fn program(&self) -> Result<Program, String> {
        let program = if self.schedule_is_csv() {
            let p = Program::load_csv(&self.schedule).map_err(|e| e.to_string())?;
            let what = format!("the schedule {}", self.schedule);
            if p.num_ranks() != self.pp {
                return Err(format!(
                    "{what} has {} ranks but --pp is {}",
                    p.num_ranks(),
                    self.pp
                ));
            }
            if p.num_microbatches as usize != self.microbatches {
                return Err(format!(
                    "{what} has {} microbatches but --microbatches is {}",
                    p.num_microbatches, self.microbatches
                ));
            }
            if p.num_stages as usize != self.num_stages() {
                return Err(format!(
                    "{what} has {} stages on {} ranks: pass --virtual-stages {}",
                    p.num_stages,
                    self.pp,
                    p.num_stages as usize / self.pp.max(1)
                ));
            }
            p
        } else {
            generate(self.schedule_kind()?, self.pp, self.microbatches)
                .map_err(|e| e.to_string())?
        };
        let program = match program.is_lowered() || program.num_ranks() == 1 {
            true => program,
            false => lower(&program).map_err(|e| e.to_string())?,
        };
        validate(&program).map_err(|e| format!("invalid schedule: {e}"))?;
        Ok(program)
    }

    /// The schedule kind, with the virtual stages for interleaving.
    pub fn schedule_kind(&self) -> Result<ScheduleKind, String> {
        let v = (self.schedule == "interleaved").then_some(self.virtual_stages);
        if self.schedule != "interleaved" && !self.schedule_is_csv() && self.virtual_stages != 1 {
            return Err(format!(
                "--virtual-stages {} only applies to the interleaved schedule, not {}",
                self.virtual_stages, self.schedule
            ));
        }
        ScheduleKind::from_name(&self.schedule, v).map_err(|e| e.to_string())
    }

    /// Pipeline stages in all: `pp × virtual stages`.
    pub fn num_stages(&self) -> usize {
        self.pp * self.virtual_stages
    }

    /// Sequences per microbatch.
    pub fn microbatch_size(&self) -> usize {
        self.batch / (self.dp * self.microbatches).max(1)
    }

    pub fn tokens_per_step(&self) -> usize {
        self.batch * self.seq_len
    }

    /// Every check that can be made before any worker starts, each with what to change.
    pub fn validate(&self) -> Result<(), String> {
        let m = &self.model;
        m.validate()?;
        self.mesh().validate()?;
        if !m.n_head.is_multiple_of(self.tp) {
            return Err(format!(
                "--tp {} does not divide the {} attention heads: each rank needs whole heads; \
                 use a --tp that divides {} or change --heads",
                self.tp, m.n_head, m.n_head
            ));
        }
        if !m.vocab_size.is_multiple_of(self.tp) {
            return Err(format!(
                "--tp {} does not divide the vocabulary of {}: use a --tp that divides it",
                self.tp, m.vocab_size
            ));
        }
        if self.microbatches == 0 || self.batch == 0 || self.steps == 0 {
            return Err("--batch, --microbatches and --steps must be at least 1".into());
        }
        if !self.batch.is_multiple_of(self.dp * self.microbatches) {
            return Err(format!(
                "--batch {} does not split into --dp {} × --microbatches {}: use a batch that is a multiple of {}",
                self.batch,
                self.dp,
                self.microbatches,
                self.dp * self.microbatches
            ));
        }
        if self.virtual_stages == 0 {
            return Err("--virtual-stages must be at least 1".into());
        }
        if self.schedule == "interleaved" && self.virtual_stages < 2 {
            return Err(format!(
                "the interleaved schedule needs --virtual-stages 2 or more (got {}); with 1 it is plain 1f1b",
                self.virtual_stages
            ));
        }
        // The schedule generator knows its own constraints (interleaving needs a multiple
        // of pp microbatches); ask it now rather than inside a worker.
        self.program()?;
        let costs = LayerCosts {
            embed: 0.0,
            block: 1.0,
            head: 0.0,
        };
        plan_stages(m.n_layer, self.num_stages(), &self.split, &costs)?;
        if self.seq_len == 0 || self.seq_len > m.block_size {
            return Err(format!(
                "--seq-len {} must be between 1 and the model's block size {}",
                self.seq_len, m.block_size
            ));
        }
        let positive = |x: f64| x.is_finite() && x > 0.0;
        if !positive(self.lr) || self.min_lr < 0.0 || self.min_lr > self.lr {
            return Err(format!(
                "the learning rate must be positive and at least --min-lr (lr {}, min-lr {})",
                self.lr, self.min_lr
            ));
        }
        if self.grad_clip < 0.0 || !positive(self.bucket_mib) || !positive(self.comm_timeout_secs) {
            return Err("--grad-clip must be ≥ 0, the bucket size and the timeout > 0".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(f: impl FnOnce(&mut TrainConfig)) -> String {
        let mut c = TrainConfig::default();
        f(&mut c);
        c.validate().unwrap_err()
    }

    #[test]
    fn the_default_run_is_valid() {
        TrainConfig::default().validate().unwrap();
    }

    #[test]
    fn bad_layouts_say_what_to_change() {
        assert!(err(|c| c.tp = 3).contains("does not divide the 4 attention heads"));
        assert!(err(|c| {
            c.model.n_head = 8;
            c.model.vocab_size = 100;
            c.tp = 8;
        })
        .contains("does not divide the vocabulary of 100"));
        assert!(err(|c| c.pp = 8).contains("8 stages but the model has only 4 layers"));
        assert!(err(|c| c.batch = 10).contains("does not split into --dp 1 × --microbatches 4"));
        assert!(err(|c| {
            c.schedule = "interleaved".into();
            c.virtual_stages = 2;
            c.microbatches = 3;
            c.batch = 12;
        })
        .contains("multiple of 2"));
        assert!(err(|c| c.virtual_stages = 2).contains("only applies to the interleaved"));
        assert!(err(|c| c.schedule = "interleaved".into()).contains("needs --virtual-stages 2"));
        assert!(err(|c| c.seq_len = 65).contains("block size 64"));
        assert!(err(|c| c.split = SplitSpec::Counts(vec![3, 3])).contains("asks for 6 layers"));
        assert!(err(|c| c.schedule = "pipedream".into()).contains("pipedream"));
    }
}
