//! Parity checks for any [`Model`]: one step of a layout, its loss and every full gradient
//! by name, compared with another layout (usually `1 × 1 × 1`) or with a hand-written
//! single-device loop.
//!
//! The trainer's own parity suites use these, and so can a model's author: chapter 5 of
//! the tutorial checks its model on every layout with [`check_step_parity`].
//!
//! ```
//! use switchyard_models::MlpConfig;
//! use switchyard_train::{data::Corpus, testing::check_step_parity, TrainConfig};
//!
//! let serial = TrainConfig::<MlpConfig> {
//!     seq_len: 16, dp: 1, pp: 1, tp: 1, microbatches: 2, batch: 4,
//!     threads_per_worker: 1,
//!     ..TrainConfig::default()
//! };
//! let parallel = TrainConfig { dp: 2, pp: 2, tp: 2, batch: 4, ..serial.clone() };
//! check_step_parity(&parallel, &serial, &Corpus::bundled(), 1e-5).unwrap();
//! ```

use std::collections::BTreeMap;

use crate::error::{err, fail, Context, Result, TrainError};

macro_rules! ensure {
    ($cond:expr, $($fmt:tt)*) => {
        // A NaN compares false, so it fails the check.
        let holds: bool = $cond;
        if !holds {
            fail!(Parity, $($fmt)*);
        }
    };
}
use candle_core::{DType, Tensor};
use switchyard_comm::local::Launcher;
use switchyard_models::{plan_stages, Model, SplitSpec};
use switchyard_shard::{single_device, ParamSource, ParamStore};

use crate::data::Dataset;
use crate::{TrainConfig, Worker};

/// The layouts `(dp, pp, tp)` the parity suites run, every one of them on at most 8
/// workers: each axis alone, each pair, and all three.
pub const LAYOUTS: [(usize, usize, usize); 10] = [
    (1, 1, 1),
    (1, 2, 1),
    (1, 4, 1),
    (1, 1, 2),
    (1, 1, 4),
    (2, 1, 1),
    (1, 2, 2),
    (2, 2, 1),
    (2, 1, 2),
    (2, 2, 2),
];

/// The schedules that apply to `pp` pipeline ranks: every generated one, or only 1F1B
/// when there is no pipeline (they are all the same there).
pub fn schedules(pp: usize) -> &'static [&'static str] {
    match pp {
        1 => &["1f1b"],
        _ => &["gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2"],
    }
}

/// One step's outcome on a whole job.
#[derive(Debug, Clone)]
pub struct StepOutcome {
    /// The job's mean loss over every microbatch of every replica.
    pub loss: f64,
    /// Every parameter's full gradient (gathered over tensor-parallel ranks), after the
    /// tied and data-parallel sums and before clipping, by name.
    pub grads: BTreeMap<String, Tensor>,
}

/// Runs step `step` of `cfg` on threads (one per rank) from the seeded initial weights,
/// and returns the job's loss and full gradients. Nothing is updated.
pub fn parallel_step<M: Model>(
    cfg: &TrainConfig<M>,
    data: &dyn Dataset,
    step: usize,
) -> Result<StepOutcome> {
    let outs = Launcher::new(cfg.world_size())
        .threads_per_worker(1)
        .run(|world| {
            let w = Worker::new(world, cfg, data, ParamSource::Init { seed: cfg.seed })?;
            let (grads, losses, _) = w.synced_grads(step)?;
            let full = w.full_grads(&grads)?;
            Ok::<_, TrainError>((w.mesh.coord, full, losses))
        })?;
    let mut grads = BTreeMap::new();
    let mut losses = Vec::new();
    for (coord, full, l) in outs {
        if coord.tp == 0 {
            losses.extend(l);
        }
        if coord.dp == 0 {
            grads.extend(full);
        }
    }
    ensure!(
        losses.len() == cfg.microbatches * cfg.dp,
        "{} losses for {} microbatches × {} replicas",
        losses.len(),
        cfg.microbatches,
        cfg.dp
    );
    let loss = losses.iter().sum::<f64>() / losses.len() as f64;
    Ok(StepOutcome { loss, grads })
}

/// The seeded initial weights of `cfg`'s model by name, as one device holds them: the
/// starting point of a hand-written single-device reference.
pub fn initial_weights<M: Model>(cfg: &TrainConfig<M>) -> Result<BTreeMap<String, Tensor>> {
    let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: cfg.seed })?;
    let plan = plan_stages(&cfg.model.costs(cfg.seq_len), 1, &SplitSpec::Even)?;
    cfg.model.stage(&plan[0], &store, single_device())?;
    store
        .params()
        .into_iter()
        .map(|p| Ok((p.name, p.var.as_tensor().copy()?)))
        .collect()
}

/// `max |a − b| / max |b|` over the tensor (0 when both are zero).
pub fn rel_err(a: &Tensor, b: &Tensor) -> Result<f64> {
    ensure!(
        a.dims() == b.dims(),
        "shapes differ: {:?} vs {:?}",
        a.dims(),
        b.dims()
    );
    let max_abs = |t: &Tensor| -> Result<f64> {
        Ok(t.to_dtype(DType::F64)?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?)
    };
    let diff = max_abs(&(a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?)?;
    Ok(diff / max_abs(b)?.max(f64::MIN_POSITIVE))
}

/// Checks that `got` matches `want`: the loss and every gradient within `tol` (relative),
/// the same parameter names. The error names the first parameter that differs.
pub fn compare_steps(got: &StepOutcome, want: &StepOutcome, tol: f64) -> Result<()> {
    let lerr = (got.loss - want.loss).abs() / want.loss.abs().max(f64::MIN_POSITIVE);
    ensure!(
        lerr <= tol,
        "loss {} vs {} (relative difference {lerr:.2e} > {tol:.0e})",
        got.loss,
        want.loss
    );
    let names = |s: &StepOutcome| s.grads.keys().cloned().collect::<Vec<_>>();
    ensure!(
        names(got) == names(want),
        "other parameters: {:?} vs {:?}",
        names(got),
        names(want)
    );
    for (name, w) in &want.grads {
        let e = rel_err(&got.grads[name], w).with_context(|| format!("gradient of {name}"))?;
        ensure!(
            e <= tol,
            "gradient of {name} differs by {e:.2e} (relative, > {tol:.0e})"
        );
    }
    Ok(())
}

/// One step of `cfg` against one step of `reference` (the same model and data on another
/// layout): the loss and every gradient within `tol`. The error names the layout.
pub fn check_step_parity<M: Model>(
    cfg: &TrainConfig<M>,
    reference: &TrainConfig<M>,
    data: &dyn Dataset,
    tol: f64,
) -> Result<()> {
    let what = |c: &TrainConfig<M>| {
        format!(
            "dp {} × pp {} × tp {} ({}, v {})",
            c.dp, c.pp, c.tp, c.schedule, c.virtual_stages
        )
    };
    let want = parallel_step(reference, data, 0).with_context(|| what(reference))?;
    let got = parallel_step(cfg, data, 0).with_context(|| what(cfg))?;
    compare_steps(&got, &want, tol)
        .map_err(|e| err!(Parity, "{} vs {}: {e}", what(cfg), what(reference)))
}
