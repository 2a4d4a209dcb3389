//! The GPT's declared plan against what its layers build, and stage splits that cover
//! every parameter exactly once.

use std::collections::HashMap;

use candle_core::DType;
use switchyard_comm::local;
use switchyard_models::plan::gpt_spec;
use switchyard_models::{gpt_layer_costs, plan_stages, GptConfig, GptStage, SplitSpec};
use switchyard_shard::{ParamSource, ParamStore};

fn names_of_stage(
    cfg: &GptConfig,
    stages: usize,
    split: &SplitSpec,
    s: usize,
) -> Vec<(String, Vec<usize>)> {
    let plans = plan_stages(&gpt_layer_costs(cfg, 16), stages, split).unwrap();
    let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 1 }).unwrap();
    GptStage::new(cfg, &plans[s], &store, switchyard_shard::single_device()).unwrap();
    store
        .params()
        .into_iter()
        .map(|p| (p.name, p.full_shape))
        .collect()
}

#[test]
fn every_parameter_follows_the_declared_tensor_parallel_plan() {
    for (vocab, tp) in [(256, 2), (257, 2), (257, 4)] {
        let mut cfg = GptConfig::tiny(2);
        cfg.vocab_size = vocab;
        follows_the_plan(&cfg, tp);
    }
}

fn follows_the_plan(cfg: &GptConfig, tp: usize) {
    let cfg = cfg.clone();
    let specs = local::launch(tp, |tp| {
        let plans = plan_stages(&gpt_layer_costs(&cfg, 16), 1, &SplitSpec::Even).unwrap();
        let store = ParamStore::for_group(&*tp, DType::F32, ParamSource::Init { seed: 1 })?;
        GptStage::new(&cfg, &plans[0], &store, tp.clone())?;
        Ok::<_, candle_core::Error>(
            store
                .params()
                .into_iter()
                .map(|p| (p.name, p.spec))
                .collect::<Vec<_>>(),
        )
    })
    .unwrap();
    for (name, spec) in &specs[0] {
        assert_eq!(gpt_spec(name, cfg.vocab_size), Some(*spec), "{name}");
    }
    assert_eq!(specs[0].len(), cfg.param_shapes().len());
}

#[test]
fn any_split_builds_every_parameter_exactly_once() {
    for tied in [false, true] {
        let mut cfg = GptConfig::tiny(5);
        cfg.tied_embeddings = tied;
        let want: HashMap<String, Vec<usize>> = cfg.param_shapes().into_iter().collect();
        for (stages, split) in [
            (1, "even"),
            (2, "1,4"),
            (2, "3,2"),
            (3, "balanced"),
            (5, "even"),
        ] {
            let split: SplitSpec = split.parse().unwrap();
            let mut seen: HashMap<String, Vec<usize>> = HashMap::new();
            for s in 0..stages {
                for (name, shape) in names_of_stage(&cfg, stages, &split, s) {
                    // A tied table is held by the first and the last stage.
                    let again = seen.insert(name.clone(), shape);
                    assert!(
                        again.is_none() || (tied && name == "transformer.wte.weight"),
                        "{name} built twice"
                    );
                }
            }
            assert_eq!(seen, want, "stages {stages} split {split}");
        }
    }
}

/// The footprint's arithmetic counts what a stage builds: every parameter of a rank, by
/// its shard, for tied and untied heads, padded vocabularies and any split.
#[test]
fn the_footprint_counts_what_each_stage_builds() {
    use switchyard_models::Model;
    for tied in [false, true] {
        for (vocab, tp) in [(256, 1), (257, 2), (257, 4)] {
            let cfg = GptConfig {
                vocab_size: vocab,
                tied_embeddings: tied,
                ..GptConfig::tiny(3)
            };
            for stages in 1..=3 {
                let plans =
                    plan_stages(&gpt_layer_costs(&cfg, 16), stages, &SplitSpec::Even).unwrap();
                for plan in &plans {
                    let store =
                        ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 1 }).unwrap();
                    GptStage::new(&cfg, plan, &store, switchyard_shard::single_device()).unwrap();
                    let sizes: Vec<usize> = store
                        .params()
                        .iter()
                        .map(|p| {
                            p.spec
                                .local_shape(&p.full_shape, tp)
                                .unwrap()
                                .iter()
                                .product()
                        })
                        .collect();
                    let f = cfg.footprint(plan, tp, 16, false).unwrap();
                    let what = format!("tied {tied}, V {vocab}, tp {tp}, stage {plan:?}");
                    assert_eq!(f.params, sizes.iter().sum::<usize>(), "{what}");
                    assert_eq!(f.tensors, sizes.len(), "{what}");
                    assert_eq!(f.largest, *sizes.iter().max().unwrap(), "{what}");
                    let holds_copy = tied && stages > 1 && (plan.embed || plan.head);
                    assert_eq!(f.tied.len(), usize::from(holds_copy), "{what}");
                }
            }
        }
    }
}

/// Hidden dropout drops only inside a training step: a stage with a rate but no step
/// (evaluation, sampling) computes what a stage without dropout computes; with a step
/// set it drops (and another microbatch draws other masks); with the step unset again
/// it drops nothing.
#[test]
fn dropout_drops_only_while_a_step_is_set() {
    use candle_core::{Device, Tensor};
    use switchyard_models::{DropoutStep, ModelStage};
    use switchyard_pipeline::Stage;
    let stage = |p: f64| {
        let mut cfg = GptConfig::tiny(2);
        cfg.hidden_dropout = p;
        let plans = plan_stages(&gpt_layer_costs(&cfg, 8), 1, &SplitSpec::Even).unwrap();
        let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: 1 }).unwrap();
        GptStage::new(&cfg, &plans[0], &store, switchyard_shard::single_device()).unwrap()
    };
    let ids = Tensor::new(
        &[[1u32, 2, 3, 4, 5, 6, 7, 8], [8, 7, 6, 5, 4, 3, 2, 1]],
        &Device::Cpu,
    )
    .unwrap();
    let logits = |s: &GptStage| -> Vec<f32> {
        Stage::forward(s, &ids)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let (plain, dropping) = (stage(0.0), stage(0.1));
    let want = logits(&plain);
    assert_eq!(logits(&dropping), want, "no step: nothing dropped");
    dropping.set_dropout_step(Some(DropoutStep {
        seed: 1,
        step: 0,
        first_row: 0,
    }));
    Stage::microbatch(&dropping, 0);
    let first = logits(&dropping);
    assert_ne!(first, want, "a step set: dropped");
    Stage::microbatch(&dropping, 1);
    assert_ne!(logits(&dropping), first, "another microbatch: other masks");
    dropping.set_dropout_step(None);
    assert_eq!(logits(&dropping), want, "the step unset: nothing dropped");
}
