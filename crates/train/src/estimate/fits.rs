//! Refusing a run that will not fit, before any work: the worst rank's estimate by
//! category ([`super::memory`]) against the budget, and what would fit instead.

use switchyard_mem::Category;
use switchyard_models::Model;
use switchyard_schedule::ScheduleChoice;

use super::memory::{estimate_memory, RankEstimate};
use crate::error::{err, TrainError};
use crate::{Bytes, Recompute, TrainConfig};

/// Refuses, before any work, a run whose estimated peak exceeds the budget: the largest
/// predicted rank against `max_memory_per_worker`, and the `local_workers` this machine
/// runs against its `available` memory. The message gives the worst rank's estimate by
/// category and what would fit. A model that does not describe its activations is only
/// refused when a budget is set.
pub fn check_fits<M: Model>(
    cfg: &TrainConfig<M>,
    local_workers: usize,
    available: Option<u64>,
) -> Result<(), TrainError> {
    let ranks = match estimate_memory(cfg) {
        Ok(r) => r,
        Err(e) if cfg.max_memory_per_worker.is_some() => {
            return Err(err!(Config, "--max-memory-per-worker: {e}"))
        }
        Err(_) => return Ok(()),
    };
    let worst = worst(&ranks);
    if let Some(budget) = cfg.max_memory_per_worker {
        if worst.peak_bytes as u64 > budget.0 {
            return Err(refusal(
                cfg,
                worst,
                &format!("--max-memory-per-worker {budget}"),
                budget.0,
            ));
        }
    }
    if let Some(available) = available {
        // This machine's workers: its share of every pipeline rank's replicas.
        let per_world: u128 =
            ranks.iter().map(|r| r.peak_bytes as u128).sum::<u128>() * (cfg.dp * cfg.tp) as u128;
        let here = per_world * local_workers as u128 / cfg.world_size().max(1) as u128;
        if here > u128::from(available) {
            let per_worker = (u128::from(available) / local_workers.max(1) as u128) as u64;
            return Err(refusal(
                cfg,
                worst,
                &format!(
                    "this machine's available memory ({} for {local_workers} workers, {} each)",
                    Bytes(available),
                    Bytes(per_worker)
                ),
                per_worker,
            ));
        }
    }
    Ok(())
}

fn worst(ranks: &[RankEstimate]) -> &RankEstimate {
    ranks
        .iter()
        .max_by_key(|r| r.peak_bytes)
        .expect("a program has ranks")
}

fn refusal<M: Model>(
    cfg: &TrainConfig<M>,
    worst: &RankEstimate,
    budget_name: &str,
    budget: u64,
) -> TrainError {
    let split: Vec<String> = Category::ALL
        .iter()
        .zip(worst.at_peak)
        .filter(|(_, b)| *b > 0)
        .map(|(c, b)| format!("{} {}", c.name(), Bytes(b as u64)))
        .collect();
    let mut fits = Vec::new();
    for (what, variant) in variants(cfg) {
        if let Ok(r) = estimate_memory(&variant) {
            let peak = worst_peak(&r);
            let mark = if peak <= budget { "fits" } else { "too big" };
            fits.push(format!(
                "{what} ({} workers): {} per worker, {mark}",
                variant.world_size(),
                Bytes(peak)
            ));
        }
    }
    let fits = match fits.is_empty() {
        true => String::new(),
        false => format!("\n  estimated instead:\n    {}", fits.join("\n    ")),
    };
    err!(
        Config,
        "the model does not fit: the estimated peak of pipeline rank {} (dp {} × pp {} × tp {}, \
         {} with {} microbatches) is {}, more than {budget_name}\n  at the peak: {}{fits}\n  \
         (bf16 would shrink it further; it is not built yet)",
        worst.pp,
        cfg.dp,
        cfg.pp,
        cfg.tp,
        cfg.schedule,
        cfg.microbatches,
        Bytes(worst.peak_bytes as u64),
        split.join(", ")
    )
}

fn worst_peak(ranks: &[RankEstimate]) -> u64 {
    worst(ranks).peak_bytes as u64
}

/// Layouts that hold less per worker than `cfg`: a longer pipeline, more tensor
/// parallelism, 1F1B instead of GPipe (fewer microbatches in flight), smaller
/// microbatches, activation recomputation. Only valid ones.
fn variants<M: Model>(cfg: &TrainConfig<M>) -> Vec<(String, TrainConfig<M>)> {
    let mut out = Vec::new();
    let mut pp = cfg.clone();
    pp.pp *= 2;
    out.push((format!("--pp {}", pp.pp), pp));
    let mut tp = cfg.clone();
    tp.tp *= 2;
    out.push((format!("--tp {}", tp.tp), tp));
    if cfg.schedule.to_string() == "gpipe" {
        let mut s = cfg.clone();
        s.schedule = ScheduleChoice::Named(switchyard_schedule::ScheduleKind::OneFOneB);
        out.push(("--schedule 1f1b".into(), s));
    }
    if cfg.dp > 1 && cfg.zero < 3 {
        for zero in (cfg.zero + 1).max(2)..=3 {
            let mut z = cfg.clone();
            z.zero = zero;
            out.push((format!("--zero {zero}"), z));
        }
    }
    let mut m = cfg.clone();
    m.microbatches *= 2;
    out.push((format!("--microbatches {}", m.microbatches), m));
    for r in [Recompute::Selective, Recompute::Full] {
        if cfg.recompute < r {
            let mut c = cfg.clone();
            c.recompute = r;
            out.push((format!("--recompute {r}"), c));
        }
    }
    let mut all = cfg.clone();
    all.pp *= 2;
    all.tp *= 2;
    all.schedule = ScheduleChoice::Named(switchyard_schedule::ScheduleKind::OneFOneB);
    all.virtual_stages = 1;
    out.push((
        format!("--pp {} --tp {} --schedule 1f1b", all.pp, all.tp),
        all,
    ));
    out.retain(|(_, c)| c.validate().is_ok());
    out
}

#[cfg(test)]
mod tests {
    use switchyard_models::{GptConfig, MlpConfig};

    use super::super::memory::OPT_PER_PARAM;
    use super::*;

    fn gpt() -> TrainConfig<GptConfig> {
        TrainConfig {
            model: GptConfig::tiny(4),
            seq_len: 16,
            batch: 8,
            threads_per_worker: 1,
            ..TrainConfig::default()
        }
    }

    #[test]
    fn a_budget_refuses_with_the_estimate_and_what_would_fit() {
        let mut c = gpt();
        let peak = worst_peak(&estimate_memory(&c).unwrap());
        c.max_memory_per_worker = Some(Bytes(peak));
        check_fits(&c, 4, None).unwrap();
        c.max_memory_per_worker = Some(Bytes(peak - 1));
        let e = check_fits(&c, 4, None).unwrap_err().to_string();
        for want in [
            "does not fit",
            "activations",
            "optimizer",
            "--pp 4",
            "per worker",
        ] {
            assert!(e.contains(want), "{want}: {e}");
        }
        // The machine's memory when no budget is given.
        c.max_memory_per_worker = None;
        check_fits(&c, 4, Some(4 * peak)).unwrap();
        let e = check_fits(&c, 4, Some(peak)).unwrap_err().to_string();
        assert!(e.contains("available memory"), "{e}");
    }

    #[test]
    fn zero_shrinks_the_optimizer_and_is_offered_when_a_replicated_run_does_not_fit() {
        let mut c = gpt();
        (c.dp, c.pp, c.tp, c.batch) = (2, 1, 1, 8);
        let full = estimate_memory(&c).unwrap();
        let opt = Category::Optimizer as usize;
        let (par, gra) = (Category::Parameters as usize, Category::Gradients as usize);
        for zero in [1, 2, 3] {
            let z = TrainConfig { zero, ..c.clone() };
            let r = estimate_memory(&z).unwrap();
            assert_eq!(r[0].at_peak[opt], OPT_PER_PARAM * r[0].params.div_ceil(2));
            assert!(r[0].at_peak[opt] * 2 < full[0].at_peak[opt]);
            // Stages 2 and 3 keep shards of the gradients, stage 3 of the parameters.
            if zero >= 2 {
                assert!(r[0].at_peak[gra] < full[0].at_peak[gra], "zero {zero}");
            }
            assert_eq!(
                zero == 3,
                r[0].at_peak[par] < full[0].at_peak[par],
                "zero {zero}"
            );
        }
        c.max_memory_per_worker = Some(Bytes(worst_peak(&full) - 1));
        let e = check_fits(&c, 2, None).unwrap_err().to_string();
        assert!(e.contains("--zero 2 (2 workers)"), "{e}");
    }

    #[test]
    fn a_model_without_activations_is_refused_only_under_a_budget() {
        let mut c = TrainConfig {
            model: MlpConfig::default(),
            seq_len: 16,
            batch: 8,
            ..TrainConfig::default()
        };
        assert!(estimate_memory(&c).is_err());
        check_fits(&c, 4, Some(1)).unwrap();
        c.max_memory_per_worker = Some(Bytes(1 << 30));
        let e = check_fits(&c, 4, None).unwrap_err().to_string();
        assert!(e.contains("does not describe its activations"), "{e}");
    }
}
