//! Chapter 5, "Bring your own model" (`docs/tutorial/05-bring-your-own-model.md`).
//!
//! A model that is not in switchyard — a stack of pre-norm residual MLP blocks
//! `x + B·GeLU(A·LayerNorm(x))`, trained to regress a fixed target — written once as
//! single-device code from switchyard-shard's layers, then:
//!
//! 1. its tensor-parallel plan is declared as data and checked against the parameters
//!    the layers actually created;
//! 2. one step is pipelined over 2 ranks × 2 tensor-parallel ranks (four threads, 1F1B)
//!    and every gradient is compared with the same model on one device;
//! 3. ten AdamW steps are taken both ways, and the loss curves are compared.
//!
//! ```text
//! cargo run --release --example own_model
//! ```

use std::collections::BTreeMap;
use std::ops::Range;

use anyhow::{anyhow, ensure};
use candle_core::{DType, Device, Result, Tensor, Var};
use switchyard::comm::{local, Mesh, MeshShape};
use switchyard::models::{plan_stages, LayerCosts, SplitSpec};
use switchyard::ops::{gelu, layer_norm};
use switchyard::pipeline::{Executor, Microbatches, Stage};
use switchyard::schedule::{generate, Program, ScheduleKind};
use switchyard::shard::{
    gather_full_tensor, single_device, Builder, ColumnConfig, ColumnParallelLinear, Init,
    ParamSource, ParamStore, RowConfig, RowParallelLinear, ShardSpec, TpGroup,
};
use switchyard::train::optim::{AdamW, AdamWConfig};

const D: usize = 16; // width
const HIDDEN: usize = 64; // MLP width, split over the tensor-parallel ranks
const LAYERS: usize = 4;
const MICROBATCHES: usize = 4;
const ROWS: usize = 8; // rows per microbatch
const SEED: u64 = 7;
const STEPS: usize = 10;
const LR: f64 = 1e-2;

// ---------------------------------------------------------------------------------------
// The model: ordinary single-device code. Whether it is sharded is decided by the size of
// the tensor-parallel group it is given (1: one device).

/// One block: `x + proj(gelu(fc(layer_norm(x))))`.
struct Block {
    ln_w: Var,
    ln_b: Var,
    fc: ColumnParallelLinear, // d → hidden, output features split over tp
    proj: RowParallelLinear,  // hidden → d, input features split, outputs summed
}

impl Block {
    fn new(vb: &Builder, tp: &TpGroup) -> Result<Block> {
        let normal = Init::Normal { std: 0.2 };
        Ok(Block {
            ln_w: vb.param("ln.weight", &[D], ShardSpec::Replicated, Init::Ones)?,
            ln_b: vb.param("ln.bias", &[D], ShardSpec::Replicated, Init::Zeros)?,
            fc: ColumnParallelLinear::new(
                &vb.pp("fc"),
                tp.clone(),
                D,
                HIDDEN,
                ColumnConfig {
                    weight_init: normal,
                    bias_init: Init::Normal { std: 0.1 },
                    ..ColumnConfig::default()
                },
            )?,
            proj: RowParallelLinear::new(
                &vb.pp("proj"),
                tp.clone(),
                HIDDEN,
                D,
                RowConfig {
                    weight_init: normal,
                    ..RowConfig::default()
                },
            )?,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = layer_norm(x, self.ln_w.as_tensor(), self.ln_b.as_tensor(), 1e-5)?;
        x + self.proj.forward(&gelu(&self.fc.forward(&h)?)?)?
    }
}

/// The blocks one pipeline stage runs: a `switchyard::pipeline::Stage`.
struct MyStage {
    blocks: Vec<Block>,
    params: Vec<Var>,
}

impl MyStage {
    /// Creates blocks `layers` (named `blocks.{i}.…`) in `store`.
    fn new(layers: Range<usize>, store: &ParamStore, tp: &TpGroup) -> Result<MyStage> {
        let first = store.len();
        let blocks = layers
            .map(|i| Block::new(&store.builder().pp(format!("blocks.{i}")), tp))
            .collect::<Result<Vec<_>>>()?;
        Ok(MyStage {
            blocks,
            params: store.vars()[first..].to_vec(),
        })
    }
}

impl Stage for MyStage {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.blocks.iter().try_fold(x.clone(), |x, b| b.forward(&x))
    }
    fn params(&self) -> &[Var] {
        &self.params
    }
}

/// The tensor-parallel plan, as data: Megatron's column-then-row pairing.
const PLAN: &[(&str, ShardSpec)] = &[
    ("ln.weight", ShardSpec::Replicated),
    ("ln.bias", ShardSpec::Replicated),
    ("fc.weight", ShardSpec::Split { dim: 0, blocks: 1 }), // column-parallel: rows of [out, in]
    ("fc.bias", ShardSpec::Split { dim: 0, blocks: 1 }),
    ("proj.weight", ShardSpec::Split { dim: 1, blocks: 1 }), // row-parallel: columns
    ("proj.bias", ShardSpec::Replicated),                    // added once, after the sum
];

fn planned_spec(name: &str) -> Option<ShardSpec> {
    let rest = name.strip_prefix("blocks.")?.split_once('.')?.1;
    PLAN.iter().find(|(p, _)| *p == rest).map(|(_, s)| *s)
}

// ---------------------------------------------------------------------------------------
// Data: fixed inputs and targets, one pair per microbatch.

fn input(m: usize) -> Result<Tensor> {
    let v: Vec<f32> = (0..ROWS * D)
        .map(|i| (((i * 7 + m * 3) % 13) as f32 - 6.0) / 6.0)
        .collect();
    Tensor::from_vec(v, (ROWS, D), &Device::Cpu)
}

fn target(m: usize) -> Result<Tensor> {
    input(m)?.sin()
}

fn mse(out: &Tensor, m: usize) -> Result<Tensor> {
    (out - target(m)?)?.sqr()?.mean_all()
}

fn adam(params: Vec<Var>) -> AdamW {
    let config = AdamWConfig {
        beta1: 0.9,
        beta2: 0.95,
        eps: 1e-8,
        weight_decay: 0.0,
        ..AdamWConfig::default()
    };
    AdamW::new(params, config)
}

// ---------------------------------------------------------------------------------------

/// One device: the mean loss over the microbatches and every gradient by name, per step.
fn single_device_run() -> anyhow::Result<(Vec<f64>, BTreeMap<String, Tensor>)> {
    let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: SEED })?;
    let model = MyStage::new(0..LAYERS, &store, &single_device())?;
    for p in store.params() {
        ensure!(
            planned_spec(&p.name) == Some(p.spec),
            "{} was created with {:?}, the plan says {:?}",
            p.name,
            p.spec,
            planned_spec(&p.name)
        );
    }
    let mut opt = adam(store.vars());
    let (mut losses, mut first_grads) = (Vec::new(), BTreeMap::new());
    for step in 0..STEPS {
        let mut total = Tensor::zeros((), DType::F32, &Device::Cpu)?;
        for m in 0..MICROBATCHES {
            total = (total + mse(&model.forward(&input(m)?)?, m)?)?;
        }
        let loss = (total / MICROBATCHES as f64)?;
        let grads = loss.backward()?;
        let g: Vec<Option<Tensor>> = store.vars().iter().map(|v| grads.get(v).cloned()).collect();
        if step == 0 {
            for (p, g) in store.params().iter().zip(&g) {
                first_grads.insert(p.name.clone(), g.clone().expect("a gradient"));
            }
        }
        losses.push(loss.to_scalar::<f32>()? as f64);
        opt.step(&g, LR)?;
    }
    Ok((losses, first_grads))
}

/// What one rank of the pipelined run returns.
struct RankRun {
    losses: Vec<f64>,
    first_grads: Vec<(String, Tensor)>,
}

/// pp 2 × tp 2 on four threads: the same steps, with the 1F1B schedule.
fn pipelined_run(program: &Program) -> anyhow::Result<Vec<RankRun>> {
    let shape = MeshShape::new(1, program.num_ranks(), 2);
    let plans = plan_stages(
        &LayerCosts::uniform(LAYERS, 0.0, 1.0, 0.0),
        program.num_stages as usize,
        &SplitSpec::Even,
    )
    .map_err(|e| anyhow!(e))?;
    local::launch(shape.world_size(), |world| -> anyhow::Result<RankRun> {
        let mesh = Mesh::new(world, shape)?;
        let store = ParamStore::for_group(&*mesh.tp, DType::F32, ParamSource::Init { seed: SEED })?;
        let s = mesh.coord.pp as u32; // one stage per pipeline rank
        let stage = MyStage::new(plans[s as usize].blocks.clone(), &store, &mesh.tp)?;
        let exec = Executor::new(program, &*mesh.pp, vec![(s, &stage as &dyn Stage)])?;
        let mut opt = adam(store.vars());
        let (mut losses, mut first_grads) = (Vec::new(), Vec::new());
        for step in 0..STEPS {
            let out = exec.run(&Microbatches {
                inputs: (0..MICROBATCHES).map(input).collect::<Result<Vec<_>>>()?,
                loss: &mse,
                loss_scale: 1.0 / MICROBATCHES as f64,
            })?;
            let grads = out.grads[&s].clone();
            if step == 0 {
                for (p, g) in store.params().iter().zip(&grads) {
                    let g = g.as_ref().expect("a gradient");
                    first_grads.push((p.name.clone(), gather_full_tensor(&*mesh.tp, &p.spec, g)?));
                }
            }
            // The last stage saw every microbatch's loss; the first stage sees none.
            let l = &out.losses;
            losses.push(l.iter().map(|(_, l)| l).sum::<f64>() / l.len().max(1) as f64);
            opt.step(&grads, LR)?;
        }
        Ok(RankRun {
            losses,
            first_grads,
        })
    })
    .map_err(|e| anyhow!("{e}"))
}

fn main() -> anyhow::Result<()> {
    println!("== 1. The plan\n");
    for (name, spec) in PLAN {
        println!("blocks.*.{name:<12} {spec:?}");
    }
    let (want_losses, want_grads) = single_device_run()?;
    println!("every parameter the layers created has the spec the plan declares\n");

    let program = generate(ScheduleKind::OneFOneB, 2, MICROBATCHES)?;
    println!("== 2. One step on pp 2 × tp 2 (1F1B) against one device\n{program}");
    let ranks = pipelined_run(&program)?;
    let mut worst = 0f64;
    for r in &ranks {
        for (name, g) in &r.first_grads {
            let want = &want_grads[name];
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()? as f64;
            let diff = (g - want)?.abs()?.max_all()?.to_scalar::<f32>()? as f64;
            worst = worst.max(diff / scale.max(1e-12));
        }
    }
    let stages_seen: usize = ranks.iter().map(|r| r.first_grads.len()).sum();
    println!(
        "{} gradients compared (2 stages × 2 tensor ranks); worst relative difference {worst:.1e}",
        stages_seen
    );
    ensure!(
        worst <= 1e-5,
        "gradients differ from one device: {worst:.1e}"
    );

    println!("\n== 3. {STEPS} AdamW steps\n\nstep   one device   pp 2 × tp 2");
    // World ranks 2 and 3 are the last pipeline stage (pp index 1); they hold the losses.
    let got = &ranks[2].losses;
    for (step, (a, b)) in want_losses.iter().zip(got).enumerate() {
        println!("{step:>4}   {a:>10.6}   {b:>11.6}");
        ensure!((a - b).abs() <= 1e-4 * a.abs(), "step {step}: {b} vs {a}");
    }
    ensure!(
        want_losses[STEPS - 1] < want_losses[0],
        "the model did not learn"
    );
    println!("\nthe pipelined, tensor-parallel model trains exactly like the single-device model");
    Ok(())
}
