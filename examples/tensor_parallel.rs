//! Chapter 3, "Tensor parallelism" (`docs/tutorial/03-tensor-parallelism.md`).
//!
//! 1. A column-parallel layer `Y = XA`, `A = [A_1 A_2]`: each of two ranks computes its
//!    slice `Y_i = X·A_i` of the single-device output.
//! 2. A row-parallel layer `Y = X_1·A_1 + X_2·A_2`: the partial products are summed by
//!    an all-reduce (Megatron's `g`).
//! 3. The tensor-parallel MLP `Y = GeLU(X·A)·B` from `switchyard::shard::ParallelMlp` at
//!    tp = 2 on two threads against the same MLP on one device: the output and every
//!    gradient agree, and the collectives are counted (1 all-reduce forward, 1 backward).
//!
//! ```text
//! cargo run --release --example tensor_parallel
//! ```

use std::collections::BTreeMap;

use anyhow::ensure;
use candle_core::{DType, Device, Result, Tensor, Var};
use switchyard::comm::{local, Counting};
use switchyard::shard::{
    gather_full_tensor, single_device, ColumnConfig, ColumnParallelLinear, Init, LayerInit,
    ParallelMlp, ParamSource, ParamStore, RowConfig, RowParallelLinear, TpGroup,
};

const TP: usize = 2;
const D: usize = 8; // model width
const H: usize = 32; // MLP hidden width, split over the ranks
const SEED: u64 = 42;

fn main() -> anyhow::Result<()> {
    column_and_row()?;
    mlp_parity()
}

/// A `[batch = 2, seq = 3, D]` input, the same on every rank.
fn input() -> Result<Tensor> {
    let v: Vec<f32> = (0..2 * 3 * D)
        .map(|i| ((i * 5) % 7) as f32 / 3.0 - 1.0)
        .collect();
    Tensor::from_vec(v, (2, 3, D), &Device::Cpu)
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar()
}

fn column_and_row() -> anyhow::Result<()> {
    println!("== column- and row-parallel linear layers, tp = {TP}\n");
    let column = ColumnConfig {
        weight_init: Init::Normal { std: 0.3 },
        ..ColumnConfig::default()
    };
    let row = RowConfig {
        weight_init: Init::Normal { std: 0.3 },
        ..RowConfig::default()
    };
    // One device: Y = X·A, then Z = Y·B, with the full A ([out, in] = [H, D], stored as in
    // PyTorch) and B ([D, H]). Values depend only on (seed, name, shape), never on tp.
    let store = ParamStore::new(DType::F32, 0, 1, ParamSource::Init { seed: SEED })?;
    let fc = ColumnParallelLinear::new(&store.builder().pp("fc"), single_device(), D, H, column)?;
    let proj = RowParallelLinear::new(&store.builder().pp("proj"), single_device(), H, D, row)?;
    let y_full = fc.forward(&input()?)?;
    let z_full = proj.forward(&y_full)?;

    let per_rank = local::launch(TP, |tp| -> Result<(Vec<usize>, Tensor, Tensor)> {
        let store =
            ParamStore::for_group(tp.as_ref(), DType::F32, ParamSource::Init { seed: SEED })?;
        let fc = ColumnParallelLinear::new(&store.builder().pp("fc"), tp.clone(), D, H, column)?;
        let proj = RowParallelLinear::new(&store.builder().pp("proj"), tp.clone(), H, D, row)?;
        let y_i = fc.forward(&input()?)?; // this rank's H/p output features: no communication
        let z = proj.forward(&y_i)?; // X_i·B_i on each rank, summed by one all-reduce
        Ok((fc.weight().dims().to_vec(), y_i, z))
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;

    for (i, (a_i, y_i, z)) in per_rank.iter().enumerate() {
        let (lo, hi) = (i * H / TP, (i + 1) * H / TP);
        let dy = max_diff(y_i, &y_full.narrow(2, lo, H / TP)?)?;
        let dz = max_diff(z, &z_full)?;
        println!(
            "rank {i}: A_{i} {a_i:?} of [{H}, {D}]; Y_{i} {:?} = Y[.., {lo}..{hi}] (max diff {dy:.1e}); \
             Z = Σ Y_i·B_i {:?} = one device's Z (max diff {dz:.1e})",
            y_i.dims(),
            z.dims()
        );
        ensure!(dy < 1e-6 && dz < 1e-5, "rank {i} differs from one device");
    }
    println!();
    Ok(())
}

/// Forward and backward of the MLP on one rank of `tp`: the output, the input gradient,
/// every parameter's full gradient by name, and the collectives of each pass.
type MlpRun = (
    Tensor,
    Tensor,
    BTreeMap<String, Tensor>,
    [BTreeMap<&'static str, usize>; 2],
);

fn mlp_step(tp: TpGroup) -> Result<MlpRun> {
    let (tp, counts) = Counting::wrap(tp);
    let store = ParamStore::for_group(tp.as_ref(), DType::F32, ParamSource::Init { seed: SEED })?;
    let init = LayerInit {
        weight: Init::Normal { std: 0.3 },
        proj_weight: Init::Normal { std: 0.3 },
        bias: Init::Normal { std: 0.1 },
    };
    let mlp = ParallelMlp::new(&store.builder().pp("block"), tp.clone(), D, H, init)?;
    let x = Var::from_tensor(&input()?)?;
    let y = mlp.forward(x.as_tensor())?;
    let forward = counts.snapshot();
    counts.reset();
    let loss = y.sqr()?.sum_all()?; // y is replicated, so is the loss
    let grads = loss.backward()?;
    let backward = counts.snapshot();
    let mut full = BTreeMap::new();
    for p in store.params() {
        let g = grads
            .get(p.var.as_tensor())
            .expect("every parameter has a gradient");
        full.insert(p.name.clone(), gather_full_tensor(tp.as_ref(), &p.spec, g)?);
    }
    let dx = grads
        .get(x.as_tensor())
        .expect("the input has a gradient")
        .clone();
    Ok((y, dx, full, [forward, backward]))
}

fn mlp_parity() -> anyhow::Result<()> {
    println!("== ParallelMlp: GeLU(X·A)·B, A column-parallel, B row-parallel\n");
    let (y1, dx1, g1, _) = mlp_step(single_device())?;
    let runs = local::launch(TP, mlp_step).map_err(|e| anyhow::anyhow!("{e}"))?;
    for (rank, (y, dx, grads, [fwd, bwd])) in runs.iter().enumerate() {
        let mut worst = max_diff(y, &y1)?.max(max_diff(dx, &dx1)?);
        for (name, g) in grads {
            worst = worst.max(max_diff(g, &g1[name])?);
        }
        println!(
            "rank {rank}: collectives forward {fwd:?}, backward {bwd:?}; max difference from one device (output, input and {} parameter gradients): {worst:.1e}",
            grads.len()
        );
        ensure!(
            worst < 1e-5,
            "rank {rank} differs from one device by {worst}"
        );
        ensure!(
            fwd.get("all_reduce") == Some(&1) && bwd.get("all_reduce") == Some(&1),
            "a column-then-row pair costs one all-reduce each way"
        );
    }
    println!("\nthe tensor-parallel MLP computes the single-device MLP, with 1 all-reduce forward and 1 backward");
    Ok(())
}
