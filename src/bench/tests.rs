use super::*;

#[test]
fn presets_are_valid_configurations() {
    for name in ["reference", "small", "tiny"] {
        let p = Preset::named(name).unwrap();
        for c in cases(&p) {
            config(&p, &c).validate().unwrap();
        }
    }
    assert!(Preset::named("huge")
        .unwrap_err()
        .to_string()
        .contains("reference"));
    // 6 × 6.38M non-embedding parameters + 6 · 8 · 256 · 129.
    let r = Preset::named("reference").unwrap();
    assert_eq!(r.tokens_per_step(), 4096);
    assert_eq!(
        r.flops_per_token(),
        6.0 * 6_384_128.0 + 6.0 * 8.0 * 256.0 * 129.0
    );
}

/// The FLOP count against a count by hand of every product of a tiny GPT.
#[test]
fn flops_per_token_counts_the_products_a_token_needs() {
    let (v, d, t) = (4.0, 2.0, 3.0);
    let mut p = Preset::named("tiny").unwrap();
    p.model = GptConfig {
        vocab_size: 4,
        block_size: 3,
        n_layer: 1,
        n_head: 1,
        d_model: 2,
        tied_embeddings: false,
        ops: OpsBackend::Fused,
        precision: Precision::F32,
        moe: Default::default(),
        hidden_dropout: 0.0,
    };
    p.seq_len = 3;
    // Forward, per token: a weight matrix `a × b` (with its bias) costs 2ab for the
    // product (biases and LayerNorms: 2 per parameter, counted like weights).
    let qkv = d * 3.0 * d + 3.0 * d;
    let proj = d * d + d;
    let fc = d * 4.0 * d + 4.0 * d;
    let fc_proj = 4.0 * d * d + d;
    let norms = 3.0 * 2.0 * d; // ln_1, ln_2, ln_f
    let head = d * v;
    let weights_forward = 2.0 * (qkv + proj + fc + fc_proj + norms + head);
    // Causal attention, forward: the three positions of a sequence see 1, 2 and 3
    // keys; each key costs d multiply-adds in QKᵀ and d in A·V.
    let keys_per_token = (1.0 + 2.0 + 3.0) / t;
    let attention_forward = 2.0 * (2.0 * d * keys_per_token);
    // Backward: twice the forward.
    let hand = 3.0 * (weights_forward + attention_forward);
    assert_eq!(p.flops_per_token(), hand);
    // The embedding tables are not counted, and a tied head is (its product runs).
    p.model.tied_embeddings = true;
    assert_eq!(p.flops_per_token(), hand);
}

#[test]
fn zero_steps_or_microbatches_that_do_not_divide_the_batch_are_refused() {
    let tiny = Preset::named("tiny").unwrap();
    tiny.check().unwrap();
    let with = |f: fn(&mut Preset)| {
        let mut p = tiny.clone();
        f(&mut p);
        p.check()
    };
    assert!(with(|p| p.steps = 0)
        .unwrap_err()
        .to_string()
        .starts_with("--steps must be at least 1"));
    assert_eq!(
        with(|p| p.microbatches = 3).unwrap_err().to_string(),
        "--microbatches 3 does not divide the tiny preset's batch of 8 sequences: use one of 1, 2, 4, 8"
    );
    assert_eq!(
        with(|p| p.microbatches = 0).unwrap_err().to_string(),
        "--microbatches must be at least 1"
    );
    // Every count the message offers runs every row.
    for m in [1, 2, 4, 8] {
        let mut p = tiny.clone();
        p.microbatches = m;
        p.check().unwrap();
        for c in cases(&p) {
            config(&p, &c).validate().unwrap();
        }
    }
}

/// Calibration runs and every row of every preset gets a finite, positive prediction
/// with its breakdown (no timing is asserted: the machine decides).
#[test]
fn the_time_model_calibrates_and_predicts_every_row() {
    let models = calibrate(&[&cases(&Preset::named("tiny").unwrap())[0]]).unwrap();
    assert_eq!(models.len(), 1);
    let tm = &models[0].1;
    assert!(tm.flops_per_s_per_thread > 0.0 && tm.curves.len() == 3);
    for name in ["reference", "small", "tiny"] {
        let p = Preset::named(name).unwrap();
        for c in cases(&p) {
            let s = predict_step_time(&config(&p, &c), tm).unwrap();
            assert!(
                s.seconds.is_finite() && s.seconds > 0.0,
                "{name} {}: {s:?}",
                c.name
            );
            assert!(s.compute_s > 0.0 && s.seconds >= s.pipeline_s, "{s:?}");
            assert_eq!(s.bubble_fraction > 0.0, c.pp > 1, "{name} {}", c.name);
            assert_eq!(s.tp_comm_s > 0.0, c.tp > 1, "{name} {}", c.name);
            assert_eq!(s.dp_allreduce_s > 0.0, c.dp > 1, "{name} {}", c.name);
        }
    }
}

#[test]
fn the_tiny_preset_runs_and_reports() {
    let p = Preset::named("tiny").unwrap();
    let rows = cases(&p)
        .iter()
        .filter(|c| c.name == "1 worker" || c.name == "pp 2 1f1b")
        .map(|c| run_case(&p, c).unwrap())
        .collect();
    let report = Report::new(p, 100.0, rows);
    assert_eq!(report.rows[0].speedup, Some(1.0));
    assert_eq!(report.rows[1].bubble_predicted.len(), 2);
    assert!(report.rows.iter().all(|r| r.final_loss.is_finite()));
    let table = report.render();
    assert!(table.contains("| pp 2 1f1b | 2 × 1 |"), "{table}");
}
