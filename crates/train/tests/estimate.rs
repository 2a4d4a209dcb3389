//! The memory estimator against measurement (issue 15 §2): for data, pipeline and tensor
//! parallelism up to 4 and their combinations (up to 2 × 2 × 2 and 1 × 4 × 4), under every
//! schedule, the predicted peak of every rank is within 10 % of what `switchyard-mem`
//! measures. Memory is deterministic,
//! so this is exact enough to hold in a test (time is not, and is checked in the bench).

use std::str::FromStr;

use switchyard_mem::Category;
use switchyard_models::{GptConfig, Precision};
use switchyard_schedule::ScheduleChoice;
use switchyard_train::data::Corpus;
use switchyard_train::estimate::memory::estimate_memory;
use switchyard_train::testing::{schedules, LAYOUTS};
use switchyard_train::{train, Recompute, TrainConfig, TrainOptions};

fn cfg(
    (dp, pp, tp): (usize, usize, usize),
    schedule: &str,
    model: GptConfig,
) -> TrainConfig<GptConfig> {
    TrainConfig {
        model,
        seq_len: 32,
        dp,
        pp,
        tp,
        schedule: ScheduleChoice::from_str(schedule).unwrap(),
        microbatches: 4,
        virtual_stages: if schedule == "interleaved" { 2 } else { 1 },
        batch: 16,
        steps: 2,
        threads_per_worker: 1,
        ..TrainConfig::default()
    }
}

fn gpt(d: usize, layers: usize) -> GptConfig {
    GptConfig {
        n_layer: layers,
        d_model: d,
        n_head: 4,
        block_size: 32,
        ..GptConfig::default()
    }
}

/// Trains `c` two steps; returns the worst relative error of the predicted peak over
/// the ranks, after printing every rank's prediction next to its measurement.
fn worst_error(c: &TrainConfig<GptConfig>) -> f64 {
    worst_errors(c, Category::Optimizer).0
}

/// [`worst_error`], and the worst relative error of category `cat` at the peak.
fn worst_errors(c: &TrainConfig<GptConfig>, cat: Category) -> (f64, f64) {
    let predicted = estimate_memory(c).unwrap();
    let report = train(c, &Corpus::bundled(), &TrainOptions::default()).unwrap();
    assert_eq!(report.memory.len(), c.world_size());
    let (mut worst, mut worst_cat): (f64, f64) = (0.0, 0.0);
    for m in &report.memory {
        let p = &predicted[m.coords.pp];
        assert_eq!(
            m.predicted_peak_bytes,
            Some(p.peak_bytes),
            "the report's estimate"
        );
        let err = (p.peak_bytes as f64 - m.peak_bytes as f64) / m.peak_bytes as f64;
        let split: Vec<String> = Category::ALL
            .iter()
            .zip(p.at_peak)
            .map(|(cat, b)| {
                let got = m.bytes_by_category[cat.name()];
                format!("{} {}/{}", &cat.name()[..3], b / 1024, got / 1024)
            })
            .collect();
        eprintln!(
            "dp {} pp {} tp {} {:>11} rank {}: predicted {} KiB, measured {} KiB ({:+.1} %) [{}]",
            c.dp,
            c.pp,
            c.tp,
            c.schedule.to_string(),
            m.rank,
            p.peak_bytes / 1024,
            m.peak_bytes / 1024,
            100.0 * err,
            split.join(" ")
        );
        worst = worst.max(err.abs());
        let measured = m.bytes_by_category[cat.name()] as f64;
        worst_cat = worst_cat.max((p.at_peak[cat as usize] as f64 - measured).abs() / measured);
    }
    (worst, worst_cat)
}

/// Up to 4 on each axis, 2 × 2 × 2 and 1 × 4 × 4, under every schedule.
#[test]
fn the_predicted_peak_is_within_ten_percent_up_to_four_on_each_axis() {
    let _alone = crate::one_at_a_time();
    let mut worst: f64 = 0.0;
    // The parity suites' layouts, and 4 on the data axis and 4 × 4.
    for &layout in LAYOUTS.iter().chain(&[(4, 1, 1), (1, 4, 4)]) {
        for s in schedules(layout.1) {
            let mut c = cfg(layout, s, gpt(128, 8));
            c.seq_len = 64;
            c.model.block_size = 64;
            c.microbatches = 8;
            c.batch = 32;
            worst = worst.max(worst_error(&c));
        }
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
}

/// The composed ops (candle's own differentiable operations, which keep every
/// intermediate, the attention's `T × T` scores among them): each axis alone, 2 × 2 × 2
/// and 1 × 4 × 4, under GPipe and 1F1B, and other widths, heads, lengths and depths.
/// (What a layout changes, the microbatches in flight and the shards, is the same code
/// for both backends, and the fused ops' test above runs every layout and schedule.)
#[test]
fn the_composed_ops_are_predicted_within_ten_percent() {
    let _alone = crate::one_at_a_time();
    let composed = |layout, s, d, layers| {
        let mut c = cfg(layout, s, gpt(d, layers));
        c.model.ops = switchyard_models::OpsBackend::Composed;
        c.seq_len = 64;
        c.model.block_size = 64;
        c.microbatches = 8;
        c.batch = 32;
        c
    };
    let mut worst: f64 = 0.0;
    for layout in [
        (1, 1, 1),
        (2, 1, 1),
        (1, 2, 1),
        (1, 1, 2),
        (2, 2, 2),
        (1, 4, 4),
    ] {
        for s in schedules(layout.1).iter().take(2) {
            worst = worst.max(worst_error(&composed(layout, s, 128, 8)));
        }
    }
    for (d, t, h, layers) in [
        (64, 64, 4, 2),
        (256, 64, 4, 2),
        (128, 32, 8, 4),
        (128, 64, 2, 2),
    ] {
        let mut c = composed((1, 1, 1), "gpipe", d, layers);
        c.model.n_head = h;
        (c.seq_len, c.model.block_size) = (t, t);
        (c.microbatches, c.batch) = (1, 4);
        worst = worst.max(worst_error(&c));
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
}

/// Recomputation (`selective`, `full`) is predicted within 10 % too, on layouts with each
/// axis and under every pipeline schedule; and it shrinks the measured activations: `full` keeps
/// at most a quarter of what `none` keeps at the peak, `selective` less than `none`.
#[test]
fn recomputation_is_predicted_and_shrinks_the_activations() {
    let _alone = crate::one_at_a_time();
    let mut worst: f64 = 0.0;
    let activations = |c: &TrainConfig<GptConfig>| -> usize {
        let report = train(c, &Corpus::bundled(), &TrainOptions::default()).unwrap();
        let m = report
            .memory
            .iter()
            .map(|m| m.bytes_by_category["activations"]);
        m.max().unwrap()
    };
    let cases = schedules(2).iter().map(|&s| ((1, 2, 1), s)).chain([
        ((1, 1, 2), "1f1b"),
        ((2, 2, 2), "1f1b"),
        ((1, 4, 1), "interleaved"),
    ]);
    for (layout, s) in cases {
        for r in [Recompute::Selective, Recompute::Full] {
            let mut c = cfg(layout, s, gpt(128, 8));
            (c.seq_len, c.model.block_size) = (64, 64);
            (c.microbatches, c.batch) = (8, 32);
            c.recompute = r;
            worst = worst.max(worst_error(&c));
        }
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
    let mut c = cfg((1, 2, 1), "1f1b", gpt(128, 8));
    (c.seq_len, c.model.block_size) = (64, 64);
    (c.microbatches, c.batch) = (8, 32);
    let none = activations(&c);
    c.recompute = Recompute::Selective;
    let selective = activations(&c);
    c.recompute = Recompute::Full;
    let full = activations(&c);
    eprintln!("activations at the peak: none {none}, selective {selective}, full {full}");
    assert!(4 * full <= none, "full {full} against none {none}");
    assert!(
        selective < none,
        "selective {selective} against none {none}"
    );
}

/// ZeRO stages 1 to 3 (issue 16 §2): the optimizer state of `1/dp`, the shards of the
/// gradients (after the reduce-scatter; stages 2 and 3 segment by segment during the
/// backward), stage 3's shards of the parameters and one gathered segment, with data
/// parallelism alone and with a pipeline and tensor parallelism.
#[test]
fn zero_is_predicted_within_ten_percent() {
    let _alone = crate::one_at_a_time();
    let mut worst: f64 = 0.0;
    for layout in [(2, 1, 1), (4, 1, 1), (2, 2, 1), (2, 1, 2)] {
        for zero in [1, 2, 3] {
            let mut c = cfg(layout, "1f1b", gpt(128, 8));
            c.seq_len = 64;
            c.model.block_size = 64;
            c.microbatches = 8;
            c.batch = 32;
            c.zero = zero;
            let (peak, opt) = worst_errors(&c, Category::Optimizer);
            worst = worst.max(peak);
            // The optimizer state of 1/dp, as predicted.
            assert!(
                opt <= 0.01,
                "{layout:?} zero {zero}: optimizer off by {:.1} %",
                100.0 * opt
            );
        }
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
}

/// With the overlapped data-parallel all-reduce the backward runs segment by segment, so
/// a microbatch's new gradients live one segment's at a time beside the kept sums, not
/// the whole stage's, and a split backward's `I` frees each segment's activations as it
/// copies what that segment's `W` reads. Before the estimate knew, the gradients at the
/// peak were predicted 1.6 × too high at dp 2 under 1F1B (14,490 KiB against 9,024
/// measured, the peak +8.5 %) and 1.5 × under ZB-H1 (8,938 against 5,977, +7.1 %).
#[test]
fn the_overlapped_all_reduce_is_predicted_by_category() {
    let _alone = crate::one_at_a_time();
    for (layout, schedule) in [
        ((2, 1, 1), "1f1b"),
        ((2, 2, 1), "1f1b"),
        ((2, 2, 1), "zb-h1"),
    ] {
        let mut c = cfg(layout, schedule, gpt(128, 8));
        (c.seq_len, c.model.block_size, c.microbatches, c.batch) = (64, 64, 8, 32);
        assert!(
            c.overlaps_grad_reduce(),
            "the default overlaps the all-reduce"
        );
        let (peak, grads) = worst_errors(&c, Category::Gradients);
        assert!(
            peak <= 0.05 && grads <= 0.10,
            "{layout:?} {schedule}: the peak off by {:.1} %, the gradients at it by {:.1} %",
            100.0 * peak,
            100.0 * grads
        );
    }
}

/// A tiny GPT (d 32), whose products are small enough that the fused ops compute most of
/// them without the matrix multiply's packing buffer, and split none over a pool: the
/// buffers are predicted per product (on two threads, and with the vocabulary split).
#[test]
fn tiny_models_get_the_packing_buffers_their_products_use() {
    let _alone = crate::one_at_a_time();
    let mut worst: f64 = 0.0;
    for (layout, threads) in [
        ((1, 1, 1), 1),
        ((1, 1, 1), 2),
        ((1, 1, 2), 1),
        ((2, 1, 1), 1),
    ] {
        let mut c = cfg(layout, "1f1b", gpt(32, 2));
        (c.seq_len, c.model.block_size) = (16, 16);
        (c.microbatches, c.batch) = (1, 8 * layout.0);
        c.threads_per_worker = threads;
        worst = worst.max(worst_error(&c));
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
}

/// Long sequences: the fused attention's backward holds two `T × T` score blocks per
/// thread, which outgrow everything else a narrow model holds (at T 1024 they were a
/// third of the peak, unpredicted, before the footprint counted them).
#[test]
fn long_sequences_count_the_attention_scratch() {
    let _alone = crate::one_at_a_time();
    let mut worst: f64 = 0.0;
    for (layout, s, r, threads) in [
        ((1, 1, 1), "1f1b", Recompute::None, 1),
        ((1, 1, 1), "1f1b", Recompute::None, 2),
        ((1, 2, 1), "1f1b", Recompute::Full, 1),
        ((1, 1, 2), "1f1b", Recompute::None, 1),
    ] {
        let mut c = cfg(layout, s, gpt(64, 2));
        (c.seq_len, c.model.block_size) = (1024, 1024);
        (c.microbatches, c.batch) = (2, 2);
        (c.recompute, c.threads_per_worker, c.steps) = (r, threads, 1);
        worst = worst.max(worst_error(&c));
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
}

/// bf16 (issue 18): what the fused pairs keep is bf16 (half the bytes), the attention's
/// backward widens its part back to f32, the MLP's reads it as it is, and the products
/// pack into buffers of their own (no f32 matrix multiply's scratch on a CPU with a
/// native bf16 kernel). Predicted within 10 % (3 % here) on one worker and on data,
/// pipeline and tensor-parallel layouts, with fewer activation bytes than f32's.
#[test]
fn bf16_is_predicted_within_ten_percent() {
    let _alone = crate::one_at_a_time();
    let at_layout = |layout, precision| {
        let mut c = cfg(layout, "1f1b", gpt(128, 8));
        c.model.precision = precision;
        c.seq_len = 64;
        c.model.block_size = 64;
        c.microbatches = 8;
        c.batch = 32;
        c
    };
    let at = |precision| at_layout((1, 1, 1), precision);
    let mut worst: f64 = 0.0;
    for layout in [(1, 1, 1), (1, 2, 2), (2, 2, 1), (2, 1, 2), (1, 4, 1)] {
        worst = worst.max(worst_error(&at_layout(layout, Precision::Bf16)));
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
    let activations = |c: &TrainConfig<GptConfig>| {
        estimate_memory(c).unwrap()[0].at_peak[Category::Activations as usize]
    };
    let (f32_bytes, bf16_bytes) = (
        activations(&at(Precision::F32)),
        activations(&at(Precision::Bf16)),
    );
    assert!(
        bf16_bytes < f32_bytes,
        "bf16 activations {bf16_bytes} B against f32's {f32_bytes} B"
    );
    // Measured: what one worker's step keeps at its peak is at most 0.55 × f32's (issue
    // 18's bar): the pairs keep bf16, the blocks free the rest but the residual sums.
    let measured = |c: &TrainConfig<GptConfig>| {
        let report = train(c, &Corpus::bundled(), &TrainOptions::default()).unwrap();
        report.memory[0].bytes_by_category[Category::Activations.name()] as f64
    };
    let ratio = measured(&at(Precision::Bf16)) / measured(&at(Precision::F32));
    eprintln!("measured activations, bf16 ÷ f32: {ratio:.3}");
    assert!(ratio <= 0.55, "bf16 activations {ratio:.3} × f32's");
}

/// Sequence parallelism (issue 17 §4): predicted within 10 % on layouts with each axis,
/// at f32 and bf16; and measured, what every tensor-parallel rank of a block held whole
/// (its LayerNorms and residual stream) is divided by tp. A block's part is the
/// difference between 8 and 4 blocks (the embeddings and the head cancel); with `A₁` one
/// worker's and `A_tp` tp's without sequence parallelism, `A_tp = P/tp + R` gives the
/// parallel part `P` and the replicated part `R`.
#[test]
fn sequence_parallelism_is_predicted_and_divides_the_replicated_activations() {
    let _alone = crate::one_at_a_time();
    let at = |layout, s, precision, sp, layers| {
        let mut c = cfg(layout, s, gpt(128, layers));
        c.model.precision = precision;
        c.seq_len = 64;
        c.model.block_size = 64;
        c.microbatches = 8;
        c.batch = 32;
        c.sequence_parallel = sp;
        c
    };
    let mut worst: f64 = 0.0;
    for (layout, s) in [
        ((1, 1, 2), "1f1b"),
        ((1, 2, 2), "1f1b"),
        ((1, 2, 2), "zb-h1"),
        ((1, 1, 4), "1f1b"),
    ] {
        worst = worst.max(worst_error(&at(layout, s, Precision::F32, true, 4)));
    }
    worst = worst.max(worst_error(&at(
        (1, 2, 2),
        "1f1b",
        Precision::Bf16,
        true,
        4,
    )));
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
    let measured = |c: &TrainConfig<GptConfig>| {
        let report = train(c, &Corpus::bundled(), &TrainOptions::default()).unwrap();
        report.memory[0].bytes_by_category[Category::Activations.name()] as f64
    };
    // Four blocks' activations on one rank.
    let blocks = |tp, sp| {
        let deep = measured(&at((1, 1, tp), "1f1b", Precision::F32, sp, 8));
        deep - measured(&at((1, 1, tp), "1f1b", Precision::F32, sp, 4))
    };
    let one = blocks(1, false);
    for tp in [2, 4] {
        let (plain, split) = (blocks(tp, false), blocks(tp, true));
        let a = tp as f64;
        let parallel = (one - plain) * a / (a - 1.0);
        let replicated = one - parallel;
        let split_replicated = split - parallel / a;
        let ratio = split_replicated / replicated;
        eprintln!(
            "tp {tp}: four blocks keep {:.0} KiB (one worker), {:.0} KiB, {:.0} KiB with \
             sequence parallelism; their replicated part {:.0} → {:.0} KiB ({ratio:.3} ×)",
            one / 1024.0,
            plain / 1024.0,
            split / 1024.0,
            replicated / 1024.0,
            split_replicated / 1024.0
        );
        assert!(
            ratio <= 1.0 / a * 1.1,
            "tp {tp}: the replicated activations shrink to {ratio:.3} ×, not 1/{tp}"
        );
    }
}

/// Mixtures of experts (4 experts, top 2, every other block; and top 1 in every block):
/// their parameters, packed weights and activations are predicted within ten percent.
#[test]
fn mixtures_of_experts_are_predicted_within_ten_percent() {
    let _alone = crate::one_at_a_time();
    let mut worst: f64 = 0.0;
    for (layout, s, top_k, every) in [
        ((1, 1, 1), "1f1b", 2, 2),
        ((1, 2, 1), "1f1b", 2, 2),
        ((1, 1, 2), "1f1b", 2, 2),
        ((2, 2, 1), "gpipe", 1, 1),
    ] {
        let mut c = cfg(layout, s, gpt(128, 4));
        c.seq_len = 64;
        c.model.block_size = 64;
        c.model.moe = switchyard_models::MoeConfig {
            experts: 4,
            top_k,
            every,
            ..Default::default()
        };
        worst = worst.max(worst_error(&c));
    }
    // The experts spread over the replicas (each holds its own), without ZeRO and
    // with ZeRO over the dense parameters.
    // The last with mixtures in every other block only: ZeRO 3 gathers a dense block,
    // the largest segment without the (resident) experts.
    for (layout, ep, zero, every) in [
        ((2, 1, 1), 2, 0, 1),
        ((4, 1, 1), 2, 1, 1),
        ((2, 1, 1), 2, 3, 1),
        ((2, 1, 1), 2, 3, 2),
    ] {
        let mut c = cfg(layout, "1f1b", gpt(128, 4));
        c.seq_len = 64;
        c.model.block_size = 64;
        (c.ep, c.zero) = (ep, zero);
        c.model.moe = switchyard_models::MoeConfig {
            experts: 8,
            top_k: 2,
            every,
            ..Default::default()
        };
        worst = worst.max(worst_error(&c));
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
}

/// Hidden dropout keeps nothing for its backward (the fused op draws its mask again):
/// a step's measured activations with dropout are those without it but for the ops' own
/// descriptions (a few dozen bytes each, about 1 KiB a step here), at f32, bf16 and
/// with sequence parallelism, within 16 KiB (an eighth of the smallest tensor it could
/// keep, one microbatch's `[4, 64, 128]`); so is one worker's peak (a pipeline's moves
/// with the timing of its messages); the estimate, which has no term for it, stays
/// within 10 %.
#[test]
fn hidden_dropout_keeps_nothing_more() {
    let _alone = crate::one_at_a_time();
    let at = |layout, s, precision, sp, p| {
        let mut c = cfg(layout, s, gpt(128, 4));
        c.model.precision = precision;
        c.model.hidden_dropout = p;
        c.seq_len = 64;
        c.model.block_size = 64;
        c.microbatches = 8;
        c.batch = 32;
        c.sequence_parallel = sp;
        c
    };
    let measured = |c: &TrainConfig<GptConfig>| {
        let report = train(c, &Corpus::bundled(), &TrainOptions::default()).unwrap();
        let m = &report.memory[0];
        (
            m.bytes_by_category[Category::Activations.name()],
            m.peak_bytes,
        )
    };
    let mut worst: f64 = 0.0;
    for (layout, s, precision, sp) in [
        ((1, 1, 1), "1f1b", Precision::F32, false),
        ((1, 2, 2), "zb-h1", Precision::F32, false),
        ((1, 1, 2), "1f1b", Precision::F32, true),
        ((1, 1, 1), "1f1b", Precision::Bf16, false),
    ] {
        let with = at(layout, s, precision, sp, 0.1);
        let (plain, dropped) = (
            measured(&at(layout, s, precision, sp, 0.0)),
            measured(&with),
        );
        eprintln!("{layout:?} {s} {precision:?} sp {sp}: activations and peak {plain:?} without dropout, {dropped:?} with");
        let (one_worker, slack) = (layout == (1, 1, 1), 16 << 10);
        assert!(
            dropped.0 <= plain.0 + slack && (!one_worker || dropped.1 <= plain.1 + slack),
            "{layout:?} {s} {precision:?} sp {sp}: {dropped:?} against {plain:?}"
        );
        worst = worst.max(worst_error(&with));
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
}

/// The composed ops' dropout multiplies a mask tensor in, and candle keeps the mask and
/// the masked branch for the backward: predicted within 10 % too (without that term,
/// −12.1 % at 1 × 2 × 2; what is left, −6.4 % there, is mostly the gradients candle
/// computes for the masks in the backward, which the estimate does not count).
#[test]
fn the_composed_ops_dropout_is_predicted_within_ten_percent() {
    let _alone = crate::one_at_a_time();
    let mut worst: f64 = 0.0;
    for (layout, s) in [
        ((1, 1, 1), "1f1b"),
        ((1, 2, 2), "1f1b"),
        ((2, 1, 2), "1f1b"),
    ] {
        let mut c = cfg(layout, s, gpt(128, 4));
        c.model.ops = switchyard_models::OpsBackend::Composed;
        c.model.hidden_dropout = 0.1;
        (c.seq_len, c.model.block_size) = (64, 64);
        (c.microbatches, c.batch) = (8, 32);
        worst = worst.max(worst_error(&c));
    }
    assert!(worst <= 0.10, "worst error {:.1} %", 100.0 * worst);
}
