//! Chapter 5's model (`examples/own_model.rs`, included here) through the generic
//! trainer: its serial run against a hand-written candle loop, one step of every layout
//! and schedule against one device (the tie across pipeline ranks, padding, a CSV
//! schedule that puts the first and the last stage on one rank), whole curves, and
//! checkpoints resumed on other layouts.

#[allow(dead_code)]
#[path = "../examples/own_model.rs"]
mod own_model;

use std::collections::BTreeMap;
use std::path::PathBuf;

use candle_core::{DType, Tensor, Var, D};
use own_model::{tiny, OwnConfig};
use switchyard::models::{GptConfig, Model};
use switchyard::train::data::{Corpus, Dataset, Sampler};
use switchyard::train::optim::{AdamW, LrSchedule};
use switchyard::train::testing::{check_step_parity, initial_weights, schedules, LAYOUTS};
use switchyard::train::weights::Weights;
use switchyard::train::{train, Resume, TrainConfig, TrainOptions};

/// A smaller model than the example's, with 8 blocks so that `pp 4 × 2` virtual stages
/// each get one; the global batch is the same on every layout.
fn cfg(dp: usize, pp: usize, tp: usize, schedule: &str) -> TrainConfig<OwnConfig> {
    TrainConfig::<OwnConfig> {
        model: OwnConfig {
            vocab_size: 256,
            d_model: 16,
            hidden: 32,
            n_layer: 8,
        },
        schedule: schedule.parse().unwrap(),
        virtual_stages: if schedule == "interleaved" { 2 } else { 1 },
        seq_len: 8,
        microbatches: 4,
        lr: 1e-2,
        min_lr: 1e-3,
        threads_per_worker: 1,
        ..tiny(dp, pp, tp)
    }
}

fn serial() -> TrainConfig<OwnConfig> {
    cfg(1, 1, 1, "1f1b")
}

fn curve(cfg: &TrainConfig<OwnConfig>, opts: &TrainOptions) -> Vec<f64> {
    let report = train(cfg, &Corpus::bundled(), opts).unwrap_or_else(|e| panic!("{e:#}"));
    report.steps.iter().map(|s| s.loss).collect()
}

fn assert_close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: {got:?} vs {want:?}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= tol * w.abs(),
            "{what}: step {i}: {g} vs {w}\n{got:?}\n{want:?}"
        );
    }
}

fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("switchyard-own-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// `LayerNorm` with candle's own ops (biased variance, ε 1e-5).
fn layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> candle_core::Result<Tensor> {
    let mean = x.mean_keepdim(D::Minus1)?;
    let xc = x.broadcast_sub(&mean)?;
    let var = xc.sqr()?.mean_keepdim(D::Minus1)?;
    xc.broadcast_div(&(var + 1e-5)?.sqrt()?)?
        .broadcast_mul(w)?
        .broadcast_add(b)
}

/// The model's loss written out with candle ops, no switchyard layers: embedding lookup,
/// `x + proj(gelu(fc(ln(x))))` per block, final LayerNorm, logits against the same
/// table, cross-entropy.
fn plain_loss(w: &BTreeMap<String, Var>, x: &Tensor, y: &Tensor, n_layer: usize) -> Tensor {
    let p = |n: &str| w[n].as_tensor().clone();
    let linear = |h: &Tensor, name: &str| {
        h.matmul(&p(&format!("{name}.weight")).t()?)?
            .broadcast_add(&p(&format!("{name}.bias")))
    };
    let run = || -> candle_core::Result<Tensor> {
        let wte = p("wte.weight");
        let mut h = wte.index_select(&x.flatten_all()?, 0)?;
        for i in 0..n_layer {
            let b = format!("blocks.{i}");
            let a = layer_norm(
                &h,
                &p(&format!("{b}.ln.weight")),
                &p(&format!("{b}.ln.bias")),
            )?;
            let a = linear(&a, &format!("{b}.mlp.c_fc"))?.gelu()?;
            h = (&h + linear(&a, &format!("{b}.mlp.c_proj"))?)?;
        }
        let h = layer_norm(&h, &p("ln_f.weight"), &p("ln_f.bias"))?;
        let logits = h.matmul(&wte.t()?)?;
        let m = logits.max_keepdim(1)?.detach();
        let shifted = logits.broadcast_sub(&m)?;
        let lse = shifted.exp()?.sum_keepdim(1)?.log()?;
        let picked = shifted.gather(&y.flatten_all()?.unsqueeze(1)?, 1)?;
        (lse - picked)?.mean_all()
    };
    run().unwrap()
}

#[test]
fn a_the_serial_curve_is_a_hand_written_candle_loop() {
    let cfg = serial();
    let vars: BTreeMap<String, Var> = initial_weights(&cfg)
        .unwrap()
        .into_iter()
        .map(|(n, t)| (n, Var::from_tensor(&t).unwrap()))
        .collect();
    let mut opt = AdamW::new(vars.values().cloned().collect(), cfg.adamw());
    let schedule = LrSchedule {
        max_lr: cfg.lr,
        min_lr: cfg.min_lr,
        warmup: cfg.warmup,
        total: cfg.steps,
    };
    let corpus = Corpus::bundled();
    let mut plain = Vec::new();
    for step in 0..cfg.steps {
        let (x, y) = corpus
            .batch(&Sampler::of(&cfg), step, 0..cfg.batch)
            .unwrap();
        let loss = plain_loss(&vars, &x, &y, cfg.model.n_layer);
        let g = loss.backward().unwrap();
        let mut grads: Vec<Tensor> = vars
            .values()
            .map(|v| g.get(v.as_tensor()).unwrap().clone())
            .collect();
        let norm = grads
            .iter()
            .map(|t| {
                t.sqr()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap() as f64
            })
            .sum::<f64>()
            .sqrt();
        if norm > cfg.grad_clip {
            let scale = cfg.grad_clip / (norm + 1e-6);
            grads = grads
                .iter()
                .map(|t| t.affine(scale, 0.0).unwrap())
                .collect();
        }
        let grads: Vec<Option<Tensor>> = grads.into_iter().map(Some).collect();
        opt.step(&grads, schedule.at(step)).unwrap();
        plain.push(
            loss.to_dtype(DType::F64)
                .unwrap()
                .to_scalar::<f64>()
                .unwrap(),
        );
    }
    assert_close(
        &curve(&cfg, &TrainOptions::default()),
        &plain,
        1e-4,
        "1 × 1 × 1",
    );
    assert!(plain[19] < plain[0] - 0.5, "it learns: {plain:?}");
}

#[test]
fn b_one_step_of_every_layout_and_schedule_matches_one_device() {
    for (dp, pp, tp) in LAYOUTS {
        for s in schedules(pp) {
            check_step_parity(&cfg(dp, pp, tp, s), &serial(), &Corpus::bundled(), 1e-5)
                .unwrap_or_else(|e| panic!("{e:#}"));
        }
    }
}

/// Two ranks, four stages: rank 0 runs stages 0 and 3 (the embedding and the head, so
/// the tie is one variable through `Builder::shared` and needs no group), rank 1 runs 1
/// and 2. GPipe order.
const V_SHAPE: &str = "\
0,0F0,0F1,3F0,3F1,3B0,3B1,0B0,0B1
1,1F0,1F1,2F0,2F1,2B0,2B1,1B0,1B1
";

#[test]
fn c_a_csv_schedule_with_the_first_and_last_stage_on_one_rank() {
    let dir = scratch("csv");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("v.csv");
    std::fs::write(&path, V_SHAPE).unwrap();
    let v = TrainConfig::<OwnConfig> {
        schedule: path.to_str().unwrap().parse().unwrap(),
        virtual_stages: 2,
        microbatches: 2,
        ..cfg(1, 2, 1, "1f1b")
    };
    let reference = TrainConfig::<OwnConfig> {
        microbatches: 2,
        ..serial()
    };
    check_step_parity(&v, &reference, &Corpus::bundled(), 1e-5).unwrap_or_else(|e| panic!("{e:#}"));
    let tp2 = TrainConfig::<OwnConfig> { tp: 2, ..v.clone() };
    check_step_parity(&tp2, &reference, &Corpus::bundled(), 1e-5)
        .unwrap_or_else(|e| panic!("{e:#}"));
}

#[test]
fn d_a_vocabulary_the_tensor_parallel_degree_does_not_divide_is_padded() {
    let with_vocab = |c: TrainConfig<OwnConfig>| TrainConfig::<OwnConfig> {
        model: OwnConfig {
            vocab_size: 257,
            ..c.model.clone()
        },
        ..c
    };
    assert_eq!(with_vocab(serial()).model.vocab_size(), Some(257));
    for (dp, pp, tp) in [(1, 1, 2), (1, 2, 2), (2, 2, 2)] {
        let c = with_vocab(cfg(dp, pp, tp, "1f1b"));
        check_step_parity(&c, &with_vocab(serial()), &Corpus::bundled(), 1e-5)
            .unwrap_or_else(|e| panic!("{e:#}"));
    }
}

#[test]
fn e_twenty_steps_on_2x2x2_follow_the_serial_curve_on_every_schedule() {
    let want = curve(&serial(), &TrainOptions::default());
    for s in schedules(2) {
        let got = curve(&cfg(2, 2, 2, s), &TrainOptions::default());
        assert_close(&got, &want, 1e-4, s);
    }
}

#[test]
fn f_a_checkpoint_resumes_on_other_layouts_and_refuses_a_gpt() {
    let dir = scratch("ckpt");
    let opts = |resume| TrainOptions {
        checkpoint_dir: Some(dir.clone()),
        save_every: 10,
        resume,
        ..TrainOptions::default()
    };
    let full = curve(&cfg(1, 2, 2, "1f1b"), &opts(None));
    let same = curve(&cfg(1, 2, 2, "1f1b"), &opts(Some(Resume::Step(10))));
    assert_eq!(same, full[10..], "the same layout: bit-identical");
    for (dp, pp, tp) in [(2, 1, 1), (1, 4, 1)] {
        let resumed = curve(&cfg(dp, pp, tp, "1f1b"), &opts(Some(Resume::Step(10))));
        assert_close(&resumed, &full[10..], 1e-4, &format!("{dp} × {pp} × {tp}"));
    }

    // Export the step-10 weights, load them back as this model, and start a new run
    // from them (`--init`) on another layout: the same run as one started from the
    // checkpoint itself, and a better first loss than fresh weights on the same data.
    let step10 = dir.join("step-00000010");
    let w = Weights::<OwnConfig>::load(&step10, &OwnConfig::default()).unwrap();
    let out = scratch("export");
    std::fs::create_dir_all(&out).unwrap();
    let file = out.join("own.safetensors");
    w.export(&file).unwrap();
    let back = Weights::<OwnConfig>::load(&file, &OwnConfig::default()).unwrap();
    assert_eq!(back.config, w.config);
    assert_eq!(back.tensors.len(), w.tensors.len());
    let init = TrainOptions {
        init: Some(file.clone()),
        ..TrainOptions::default()
    };
    let from_export = curve(&cfg(2, 1, 2, "1f1b"), &init);
    let from_checkpoint = curve(
        &cfg(2, 1, 2, "1f1b"),
        &TrainOptions {
            init: Some(step10.clone()),
            ..TrainOptions::default()
        },
    );
    assert_eq!(from_export, from_checkpoint, "--init from the export");
    assert!(
        from_export[0] < full[0] - 0.5,
        "{from_export:?} vs {full:?}"
    );
    let e = Weights::<GptConfig>::load(&file, &GptConfig::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("holds a own-mlp-lm model, not a gpt model"),
        "{e}"
    );

    let gpt_dir = scratch("gpt");
    let gpt = TrainConfig::<GptConfig> {
        model: GptConfig {
            n_layer: 2,
            d_model: 16,
            n_head: 2,
            block_size: 8,
            ..GptConfig::default()
        },
        seq_len: 8,
        batch: 4,
        steps: 1,
        threads_per_worker: 1,
        ..TrainConfig::default()
    };
    let gpt_opts = TrainOptions {
        checkpoint_dir: Some(gpt_dir.clone()),
        ..TrainOptions::default()
    };
    train(&gpt, &Corpus::bundled(), &gpt_opts).unwrap();
    let resume = TrainOptions {
        resume: Some(Resume::Latest),
        ..gpt_opts
    };
    let e = train(&cfg(1, 2, 2, "1f1b"), &Corpus::bundled(), &resume).unwrap_err();
    let e = format!("{e:#}");
    assert!(
        e.contains(GptConfig::NAME) && e.contains(OwnConfig::NAME),
        "{e}"
    );
}

#[test]
fn g_the_example_stays_short() {
    let text = include_str!("../examples/own_model.rs");
    let code = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .count();
    assert!(code < 150, "examples/own_model.rs has {code} lines of code");
}

#[test]
fn the_data_fits_the_vocabulary() {
    // The trainer refuses token ids the embedding cannot look up.
    let small = TrainConfig::<OwnConfig> {
        model: OwnConfig {
            vocab_size: 100,
            ..serial().model
        },
        ..serial()
    };
    assert!(train(&small, &Corpus::bundled(), &TrainOptions::default()).is_err());
}
