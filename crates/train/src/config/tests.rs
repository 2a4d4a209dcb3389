use super::*;

/// The trainer's checks, on the GPT.
pub(super) type TrainConfig = super::TrainConfig<switchyard_models::GptConfig>;

pub(super) fn sched(text: &str) -> ScheduleChoice {
    text.parse().unwrap()
}

pub(super) fn err(f: impl FnOnce(&mut TrainConfig)) -> String {
    let mut c = TrainConfig::default();
    f(&mut c);
    c.validate().unwrap_err().to_string()
}

#[test]
fn the_default_run_is_valid() {
    TrainConfig::default().validate().unwrap();
}

#[test]
fn bad_layouts_say_what_to_change() {
    assert!(err(|c| c.tp = 3).contains("does not divide the 4 attention heads"));
    assert!(err(|c| c.pp = 8).contains("8 stages but the model has only 4 layers"));
    assert!(err(|c| c.batch = 10).contains("does not split into --dp 1 × --microbatches 4"));
    assert!(err(|c| {
        c.schedule = sched("interleaved");
        c.virtual_stages = 2;
        c.microbatches = 3;
        c.batch = 12;
    })
    .contains("multiple of 2"));
    assert!(err(|c| c.virtual_stages = 2).contains("only applies to the interleaved"));
    assert!(err(|c| c.schedule = sched("interleaved")).contains("needs --virtual-stages 2"));
    assert!(err(|c| c.seq_len = 65).contains("block size 64"));
    assert!(err(|c| c.split = SplitSpec::Counts(vec![3, 3])).contains("asks for 6 layers"));
    // An unknown name is refused where the text is read (flag, file or manifest).
    let e = "pipedream"
        .parse::<ScheduleChoice>()
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown schedule \"pipedream\""), "{e}");
    let e = serde_json::from_str::<TrainConfig>(r#"{"schedule": "pipedream"}"#)
        .unwrap_err()
        .to_string();
    assert!(e.to_string().contains("unknown schedule"), "{e}");
}

#[test]
fn layout_products_that_overflow_are_errors() {
    let e = err(|c| c.dp = 9223372036854775809);
    assert!(
        e.contains("--dp 9223372036854775809 × --pp 2 × --tp 2 overflows"),
        "{e}"
    );
    let e = err(|c| {
        c.dp = 4294967296;
        c.microbatches = 4294967296;
    });
    assert!(
        e.contains("--dp 4294967296 × --microbatches 4294967296 overflows"),
        "{e}"
    );
    let e = err(|c| {
        c.schedule = sched("interleaved");
        c.virtual_stages = usize::MAX;
    });
    assert!(
        e.contains("--pp 2 × --virtual-stages 18446744073709551615 overflows"),
        "{e}"
    );
    let c = TrainConfig {
        dp: usize::MAX,
        ..TrainConfig::default()
    };
    assert_eq!(c.world_size(), usize::MAX);
}

#[test]
fn more_stages_than_layers_is_refused_before_any_schedule_is_built() {
    // Generating and validating a million-rank schedule takes minutes; the layer
    // count refuses it at once.
    let e = err(|c| c.pp = 1_000_000);
    assert!(
        e.contains("1000000 stages but the model has only 4 layers"),
        "{e}"
    );
}

#[test]
fn a_schedule_too_large_to_build_is_refused() {
    let e = err(|c| {
        c.microbatches = MAX_SCHEDULE_PAIRS;
        c.batch = MAX_SCHEDULE_PAIRS;
    });
    assert!(e.contains("a schedule too large to build"), "{e}");
}

#[test]
fn every_float_setting_is_checked_and_named() {
    type Set = fn(&mut TrainConfig, f64);
    let cases: [(&str, Set); 10] = [
        ("--lr", |c, v| c.lr = v),
        ("--min-lr", |c, v| c.min_lr = v),
        ("--weight-decay", |c, v| c.weight_decay = v),
        ("--grad-clip", |c, v| c.grad_clip = v),
        ("--beta1", |c, v| c.beta1 = v),
        ("--beta2", |c, v| c.beta2 = v),
        ("--eps", |c, v| c.eps = v),
        ("bucket_mib (a --config key)", |c, v| c.bucket_mib = v),
        ("--comm-timeout", |c, v| c.comm_timeout_secs = v),
        ("--val-fraction", |c, v| c.val_fraction = v),
    ];
    for (name, set) in cases {
        for v in [f64::NAN, f64::INFINITY, -1.0] {
            let e = err(|c| set(c, v));
            assert!(e.starts_with(&format!("{name} must be")), "{name} {v}: {e}");
            assert!(e.ends_with(&format!("got {v}")), "{name} {v}: {e}");
        }
    }
    assert!(err(|c| c.beta1 = 1.0).contains("--beta1 must be at least 0 and below 1, got 1"));
    assert!(err(|c| c.beta2 = 1.5).contains("--beta2 must be at least 0 and below 1, got 1.5"));
    assert!(err(|c| c.eps = 0.0).contains("--eps must be a positive number, got 0"));
    assert!(err(|c| c.eps = -1e-8).contains("--eps must be a positive number, got -0.00000001"));
    assert!(
        err(|c| c.min_lr = 1.0).contains("--min-lr must be a number from 0 to --lr (0.003), got 1")
    );
    assert!(err(|c| c.lr = 0.0).contains("--lr must be a positive number, got 0"));
    assert!(err(|c| c.comm_timeout_secs = 1e300).contains("--comm-timeout"));
    assert!(err(|c| c.val_fraction = 1.0).contains("--val-fraction must be at least 0 and below 1"));
    assert!(err(|c| c.eval_batches = 0).contains("--eval-batches must be at least 1"));
    // Zero is allowed where it means "off".
    let c = TrainConfig {
        weight_decay: 0.0,
        grad_clip: 0.0,
        min_lr: 0.0,
        beta1: 0.0,
        beta2: 0.0,
        ..TrainConfig::default()
    };
    c.validate().unwrap();
    // The smallest positive ε, and betas just below 1, are accepted.
    let c = TrainConfig {
        eps: f64::MIN_POSITIVE,
        beta1: 0.999_999,
        beta2: 1.0 - f64::EPSILON,
        ..TrainConfig::default()
    };
    c.validate().unwrap();
}

#[test]
fn the_optimizer_and_data_order_follow_the_config() {
    let c = TrainConfig {
        beta1: 0.8,
        beta2: 0.99,
        eps: 1e-6,
        weight_decay: 0.01,
        decay: Decay::All,
        shuffle: false,
        batch: 12,
        ..TrainConfig::default()
    };
    let a = c.adamw();
    assert_eq!(
        (a.beta1, a.beta2, a.eps, a.weight_decay),
        (0.8, 0.99, 1e-6, 0.01)
    );
    assert_eq!(a.decay, Decay::All);
    let s = crate::data::Sampler::of(&c);
    assert_eq!((s.shuffle, s.batch), (false, 12));
    let d = TrainConfig::default();
    assert_eq!(d.adamw(), AdamWConfig::default());
    let s = crate::data::Sampler::of(&d);
    assert_eq!((s.shuffle, s.seed), (true, 1337));
    // A config names the rule as a string; anything else is refused.
    let t: TrainConfig =
        serde_json::from_str(r#"{"decay": "all", "shuffle": false, "eps": 1e-6}"#).unwrap();
    assert_eq!((t.decay, t.shuffle, t.eps), (Decay::All, false, 1e-6));
    let e = serde_json::from_str::<TrainConfig>(r#"{"decay": "biases"}"#)
        .unwrap_err()
        .to_string();
    assert!(
        e.to_string().contains("expected `matrices` or `all`"),
        "{e}"
    );
}

#[test]
fn interleaving_advice_is_accepted_as_given() {
    let base = |c: &mut TrainConfig| {
        c.schedule = sched("interleaved");
        c.virtual_stages = 2;
        c.microbatches = 3;
        c.batch = 12;
        c.pp = 2;
    };
    let e = err(base);
    assert!(
        e.contains("use --microbatches 4, or --schedule 1f1b (without --virtual-stages)"),
        "{e}"
    );
    let mut c = TrainConfig::default();
    base(&mut c);
    c.microbatches = 4;
    c.validate().unwrap();
    let mut c = TrainConfig::default();
    base(&mut c);
    c.schedule = sched("1f1b");
    c.virtual_stages = 1;
    c.validate().unwrap();
    // When the batch does not split into the suggested count, the advice says so.
    let e = err(|c| {
        base(c);
        c.batch = 6;
    });
    assert!(e.contains("use --microbatches 4 --batch 8,"), "{e}");
    let mut c = TrainConfig::default();
    base(&mut c);
    (c.microbatches, c.batch) = (4, 8);
    c.validate().unwrap();
}

/// ZB-H1's receive of a gradient goes after the forward it does not feed: lowered with
/// `I = W` it tied with that forward's start and went first, and the rank waited for it
/// before computing the forward (the trainer's `LOWERING_COSTS`). Checked on rank 0 for
/// every pipeline depth from 2 to 8 (it fails with `I = W`).
#[test]
fn zb_h1_receives_a_gradient_after_the_forwards_that_do_not_need_it() {
    use switchyard_schedule::{Action, Op};
    let pos = |list: &[Action], op: Op, mb: u32| {
        list.iter().position(|a| a.op == op && a.microbatch == mb)
    };
    for pp in 2..=8usize {
        let mut c = TrainConfig::default();
        (c.pp, c.tp, c.microbatches, c.batch) = (pp, 1, 2 * pp, 2 * pp);
        c.model.n_layer = pp;
        c.schedule = "zb-h1".parse().unwrap();
        let program = c.program().unwrap();
        // Rank 0's steady state: the receive of microbatch k's gradient follows the
        // forward of microbatch k + pp − 1, which precedes k's `I` in ZB-H1's order.
        let rank0 = &program.ranks[0];
        for k in 0..(c.microbatches - pp + 1) as u32 {
            let next = k + pp as u32 - 1;
            let (rb, f) = (pos(rank0, Op::RecvB, k), pos(rank0, Op::F, next));
            assert!(
                rb > f,
                "pp {pp}: 0RB{k} at {rb:?} before 0F{next} at {f:?}: {program}"
            );
        }
    }
}
