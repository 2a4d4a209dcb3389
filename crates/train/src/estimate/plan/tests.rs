//! The planner's unit tests: the layout text form, the layouts tried, and their ranking.

use switchyard_models::GptConfig;

use super::*;

fn base() -> TrainConfig<GptConfig> {
    TrainConfig {
        model: GptConfig::tiny(4),
        seq_len: 16,
        batch: 16,
        threads_per_worker: 1,
        ..TrainConfig::default()
    }
}

#[test]
fn a_layout_reads_and_prints_its_text_form() {
    for text in [
        "dp2 pp2 tp1 1f1b m8",
        "dp1 pp4 tp2 interleaved v2 m8",
        "dp4 pp1 tp1 1f1b m1",
        "dp1 pp2 tp2 zb-h1 m8 recompute-full",
        "dp2 pp1 tp1 1f1b m2 zero1 recompute-selective",
        "dp4 pp1 tp1 1f1b m2 ep2 zero1",
        "dp1 pp2 tp2 zb-h1 m4 sp recompute-selective",
    ] {
        let l: Layout = text.parse().unwrap();
        assert_eq!(l.to_string(), text);
    }
    let l: Layout = "pp2 gpipe".parse().unwrap();
    assert_eq!((l.dp, l.pp, l.tp, l.microbatches), (1, 2, 1, 2));
    for bad in [
        "dp2 dp2",
        "pp2 gpipe 1f1b",
        "dp0",
        "fast",
        "pp2 1f1b v2",
        "recompute-some",
        "recompute-full recompute-none",
        "dp2 zero1 zero2",
        "dp2 ep0",
        "tp2 sp sp",
        "dp2 sp",
    ] {
        assert!(bad.parse::<Layout>().is_err(), "{bad}");
    }
    let c = l.apply(&base());
    assert_eq!(Layout::of(&c), Some(l));
}

#[test]
fn every_layout_multiplies_to_the_workers_and_is_ranked() {
    let b = base();
    let all = layouts(&b, 4);
    assert!(all.iter().all(|l| l.workers() == 4));
    for want in [
        "dp4 pp1 tp1 1f1b m1",
        "dp1 pp2 tp2 zb-h1 m4",
        "dp1 pp4 tp1 gpipe m16",
    ] {
        assert!(all.iter().any(|l| l.to_string() == want), "{want}");
    }
    for never in ["dp1 pp4 tp1 gpipe m2", "dp4 pp1 tp1 1f1b m3"] {
        assert!(!all.iter().any(|l| l.to_string() == never), "{never}");
    }
    assert!(all.iter().any(|l| l.to_string() == "dp1 pp2 tp2 1f1b m2"));
    // More virtual stages while each gets a layer (4 layers: pp 2 × v 2, not v 4).
    assert!(all
        .iter()
        .any(|l| l.to_string() == "dp1 pp2 tp2 interleaved v2 m4"));
    assert!(!all.iter().any(|l| l.to_string().contains("v4")));
    let deep = TrainConfig {
        model: GptConfig::tiny(8),
        ..base()
    };
    let deep = layouts(&deep, 4);
    assert!(deep
        .iter()
        .any(|l| l.to_string() == "dp1 pp2 tp2 interleaved v4 m4"));
    assert!(!deep.iter().any(|l| l.to_string().contains("v8")));
    // Without a budget or times: valid ones by memory, invalid last (interleaved
    // pp 4 needs 8 layers, the tiny GPT has 4).
    let ranked = plan(&b, 4, None, &|_| None);
    let first_invalid = ranked
        .iter()
        .position(|c| matches!(c.verdict, Verdict::Invalid(_)))
        .unwrap();
    assert!(ranked[first_invalid..]
        .iter()
        .all(|c| matches!(c.verdict, Verdict::Invalid(_))));
    assert!(ranked[..first_invalid]
        .windows(2)
        .all(|w| w[0].peak_bytes() <= w[1].peak_bytes()));
    // A budget splits them; times order the fitting ones.
    let budget = ranked[first_invalid / 2].peak_bytes();
    let timed = plan(&b, 4, Some(budget), &|c| Some(c.microbatches as f64));
    assert!(timed
        .iter()
        .take_while(|c| c.verdict == Verdict::Fits)
        .all(|c| c.peak_bytes() <= budget));
    let fits: Vec<f64> = timed
        .iter()
        .filter(|c| c.verdict == Verdict::Fits)
        .map(|c| c.step_s.unwrap())
        .collect();
    assert!(fits.windows(2).all(|w| w[0] <= w[1]));
    assert!(timed
        .iter()
        .any(|c| matches!(c.verdict, Verdict::TooBig { peak } if peak > budget)));
}

#[test]
fn a_model_with_experts_is_planned_at_every_expert_parallel_degree() {
    let dense = layouts(&base(), 4);
    assert!(dense.iter().all(|l| l.ep == 1));
    let mut b = base();
    b.model.moe.experts = 2;
    let all = layouts(&b, 4);
    // dp 4: ep 1 and 2 (2 experts: not 4); dp 2: ep 1 and 2; dp 1: ep 1.
    for want in [
        "dp4 pp1 tp1 1f1b m1 ep2",
        "dp2 pp1 tp2 1f1b m2 ep2",
        "dp4 pp1 tp1 1f1b m1",
    ] {
        assert!(all.iter().any(|l| l.to_string() == want), "{want}");
    }
    assert!(!all.iter().any(|l| l.ep == 4));
    // (Mixtures route whole sequences: no sequence parallelism.)
    assert!(all.iter().all(|l| !l.sequence_parallel));
    let dense: Vec<&Layout> = dense.iter().filter(|l| !l.sequence_parallel).collect();
    assert_eq!(
        all.len(),
        dense.len() + dense.iter().filter(|l| l.dp > 1).count()
    );
    // Spreading the experts takes memory off every replica.
    let peak = |text: &str| {
        let l: Layout = text.parse().unwrap();
        memory_only(&b, &l, None).peak_bytes()
    };
    assert!(peak("dp4 pp1 tp1 1f1b m1 ep2") < peak("dp4 pp1 tp1 1f1b m1"));
}

#[test]
fn tensor_parallel_layouts_are_planned_with_and_without_sequence_parallelism() {
    let b = base();
    let all = layouts(&b, 4);
    // Every layout with tp > 1 twice, once with `sp`; none without tensor parallelism.
    let with_tp = all.iter().filter(|l| l.tp > 1 && !l.sequence_parallel);
    let split = all.iter().filter(|l| l.sequence_parallel).count();
    assert_eq!(with_tp.count(), split);
    assert!(split > 0);
    assert!(all.iter().all(|l| !l.sequence_parallel || l.tp > 1));
    for want in ["dp1 pp1 tp4 1f1b m1 sp", "dp2 pp1 tp2 1f1b m1 sp"] {
        assert!(all.iter().any(|l| l.to_string() == want), "{want}");
    }
    // The split takes activation memory off every tensor-parallel rank.
    let peak = |text: &str| {
        let l: Layout = text.parse().unwrap();
        memory_only(&b, &l, None).peak_bytes()
    };
    assert!(peak("dp1 pp1 tp4 1f1b m1 sp") < peak("dp1 pp1 tp4 1f1b m1"));
    // The layout carries it into the trainer's configuration and back.
    let l: Layout = "dp1 pp1 tp4 1f1b m1 sp".parse().unwrap();
    let cfg = l.apply(&b);
    assert!(cfg.sequence_parallel);
    assert_eq!(Layout::of(&cfg), Some(l));
    // A sequence that the ranks cannot split evenly is not tried.
    let odd = TrainConfig {
        seq_len: 15,
        ..base()
    };
    assert!(layouts(&odd, 4).iter().all(|l| !l.sequence_parallel));
}
