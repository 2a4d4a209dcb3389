//! The rows of `switchyard bench` and the training configuration each runs.

use switchyard_models::{GptConfig, OpsBackend, Precision, SplitSpec};
use switchyard_schedule::{ScheduleChoice, ScheduleKind};
use switchyard_train::{Recompute, TrainConfig};

use super::{Case, Preset};

/// The rows of `switchyard bench`, baseline first.
pub fn cases(p: &Preset) -> Vec<Case> {
    let case = |name: &str, dp, pp, tp, threads, schedule: ScheduleKind, microbatches| Case {
        name: name.into(),
        dp,
        pp,
        tp,
        threads_per_worker: threads,
        schedule: ScheduleChoice::Named(schedule),
        microbatches,
        ops: OpsBackend::Fused,
        recompute: Recompute::None,
        precision: Precision::F32,
        overlap_grad_reduce: true,
        sequence_parallel: false,
        hidden_dropout: 0.0,
    };
    let m = p.microbatches;
    // Interleaved 1F1B needs two model chunks per pipeline rank: 4 layers at pp 2.
    let interleaved = (p.model.n_layer >= 4).then(|| {
        let v2 = ScheduleKind::Interleaved { virtual_stages: 2 };
        case("pp 2 interleaved", 1, 2, 1, 1, v2, m)
    });
    let mut rows = vec![
        case("1 worker", 1, 1, 1, 1, ScheduleKind::OneFOneB, 1),
        case("1 worker, 2 threads", 1, 1, 1, 2, ScheduleKind::OneFOneB, 1),
        // The composed twins of the fused ops (what a GPU runs today), on the CPU: their
        // cost against the first row.
        Case {
            ops: OpsBackend::Composed,
            ..case(
                "1 worker, composed ops",
                1,
                1,
                1,
                1,
                ScheduleKind::OneFOneB,
                1,
            )
        },
        case("pp 2 gpipe", 1, 2, 1, 1, ScheduleKind::GPipe, m),
        case("pp 2 1f1b", 1, 2, 1, 1, ScheduleKind::OneFOneB, m),
        // The schedules that promise smaller bubbles, against the row above (issue 17):
        // their measured bubbles side by side with 1F1B's.
        case("pp 2 zb-h1", 1, 2, 1, 1, ScheduleKind::ZbH1, m),
        // ZB-H2: the bubble ZB-H1 leaves, bought with activations (2p − 1 microbatches).
        case("pp 2 zb-h2", 1, 2, 1, 1, ScheduleKind::ZbH2, m),
        // Activation recomputation, against the row above (issue 16: `full` at most
        // 1.4 ×, `selective` at most 1.1 × its time).
        Case {
            recompute: Recompute::Selective,
            ..case(
                "pp 2 1f1b, recompute selective",
                1,
                2,
                1,
                1,
                ScheduleKind::OneFOneB,
                m,
            )
        },
        Case {
            recompute: Recompute::Full,
            ..case(
                "pp 2 1f1b, recompute full",
                1,
                2,
                1,
                1,
                ScheduleKind::OneFOneB,
                m,
            )
        },
        case("tp 2", 1, 1, 2, 1, ScheduleKind::OneFOneB, 1),
        // Sequence parallelism, against the row above (issue 17 §4).
        Case {
            sequence_parallel: true,
            ..case(
                "tp 2, sequence parallel",
                1,
                1,
                2,
                1,
                ScheduleKind::OneFOneB,
                1,
            )
        },
        // With GPT-2's dropout, which sequence parallelism splits too: one worker, plain
        // tp 2 and tp 2 with the split (issue 17 §4's speed-ups over one worker).
        Case {
            hidden_dropout: 0.1,
            ..case(
                "1 worker, dropout 0.1",
                1,
                1,
                1,
                1,
                ScheduleKind::OneFOneB,
                1,
            )
        },
        Case {
            hidden_dropout: 0.1,
            ..case("tp 2, dropout 0.1", 1, 1, 2, 1, ScheduleKind::OneFOneB, 1)
        },
        Case {
            hidden_dropout: 0.1,
            sequence_parallel: true,
            ..case(
                "tp 2, sequence parallel, dropout 0.1",
                1,
                1,
                2,
                1,
                ScheduleKind::OneFOneB,
                1,
            )
        },
        case("dp 2", 2, 1, 1, 1, ScheduleKind::OneFOneB, 1),
        // The gradient all-reduce after the whole backward, against the row above
        // (issue 17 §3: overlapped, under half of it exposed).
        Case {
            overlap_grad_reduce: false,
            ..case(
                "dp 2, all-reduce after the backward",
                2,
                1,
                1,
                1,
                ScheduleKind::OneFOneB,
                1,
            )
        },
        // Mixed precision (issue 18): bf16 products against the first row and against
        // the pipeline row without it.
        Case {
            precision: Precision::Bf16,
            ..case("1 worker, bf16", 1, 1, 1, 1, ScheduleKind::OneFOneB, 1)
        },
        Case {
            precision: Precision::Bf16,
            ..case("pp 2 1f1b, bf16", 1, 2, 1, 1, ScheduleKind::OneFOneB, m)
        },
    ];
    if let Some(row) = interleaved {
        let at = rows
            .iter()
            .position(|r| r.name == "pp 2 zb-h1")
            .map_or(rows.len(), |i| i + 1);
        rows.insert(at, row);
    }
    rows
}

/// The training configuration of one case.
pub fn config(p: &Preset, c: &Case) -> TrainConfig<GptConfig> {
    TrainConfig {
        model: GptConfig {
            ops: c.ops,
            precision: c.precision,
            hidden_dropout: c.hidden_dropout,
            ..p.model.clone()
        },
        dp: c.dp,
        pp: c.pp,
        tp: c.tp,
        schedule: c.schedule.clone(),
        microbatches: c.microbatches,
        virtual_stages: match &c.schedule {
            ScheduleChoice::Named(ScheduleKind::Interleaved { virtual_stages }) => *virtual_stages,
            _ => 1,
        },
        split: SplitSpec::Even,
        steps: p.warmup + p.steps,
        batch: p.batch,
        seq_len: p.seq_len,
        lr: 1e-3,
        min_lr: 1e-4,
        warmup: 0,
        threads_per_worker: c.threads_per_worker,
        recompute: c.recompute,
        overlap_grad_reduce: c.overlap_grad_reduce,
        sequence_parallel: c.sequence_parallel,
        ..TrainConfig::default()
    }
}
