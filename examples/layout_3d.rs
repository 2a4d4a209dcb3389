//! Chapter 4, "Putting it together: dp × pp × tp" (`docs/tutorial/04-3d-parallelism.md`).
//!
//! 1. Prints how the ranks of a `dp 2 × pp 2 × tp 2` job map onto the mesh, and the
//!    tensor-, pipeline- and data-parallel groups each rank belongs to (eight threads
//!    deriving them with `switchyard::comm::Mesh`).
//! 2. Compares ways of splitting 8 workers: pipeline bubble (from the simulator),
//!    weights per rank, and how often each kind of communication happens.
//! 3. Trains a tiny GPT on that 2 × 2 × 2 mesh (eight threads) and on one thread, and
//!    checks that both runs produce the same loss curve.
//!
//! ```text
//! cargo run --release --example layout_3d
//! ```

use anyhow::{ensure, Context};
use switchyard::comm::{describe, local, Mesh, MeshShape};
use switchyard::models::GptConfig;
use switchyard::schedule::{generate, simulate, Costs, ScheduleKind};
use switchyard::train::data::Corpus;
use switchyard::train::{train, TrainConfig, TrainOptions};

/// The model and batch of the layout table.
const LAYERS: usize = 8;
const BATCH: usize = 32;

fn main() -> anyhow::Result<()> {
    let shape = MeshShape::new(2, 2, 2);

    println!("== 1. The mesh {shape}: rank = (pp · dp + dp_index) · tp + tp_index\n");
    print!("rank");
    for r in 0..shape.world_size() {
        print!(" {r:>2}");
    }
    println!();
    type Axis = fn(&switchyard::comm::MeshCoord) -> usize;
    let axes: [(&str, Axis); 3] = [("pp", |c| c.pp), ("dp", |c| c.dp), ("tp", |c| c.tp)];
    for (name, get) in axes {
        print!("{name:<4}");
        for r in 0..shape.world_size() {
            print!(" {:>2}", get(&shape.coord(r)));
        }
        println!();
    }
    println!();

    let groups = local::launch(shape.world_size(), |world| {
        let mesh = Mesh::new(world, shape)?;
        Ok::<_, switchyard::comm::CommError>([
            describe(&*mesh.tp),
            describe(&*mesh.pp),
            describe(&*mesh.dp),
        ])
    })
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    for (r, [tp, pp, dp]) in groups.iter().enumerate() {
        println!("rank {r}: {tp:<10} {pp:<10} {dp}");
        ensure!(
            shape.rank(shape.coord(r)) == r,
            "coord and rank are inverses"
        );
    }
    // Tensor-parallel partners are neighbours; a pipeline stage is a block of dp·tp ranks.
    ensure!(groups[0][0] == "tp[0,1]" && groups[0][1] == "pp[0,4]" && groups[0][2] == "dp[0,2]");

    println!(
        "\n== 2. Eight workers, {LAYERS} layers, a global batch of {BATCH} sequences in microbatches of 1\n"
    );
    println!("dp pp tp   microbatches   bubble   weights    block all-reduces   messages of   dp all-reduce");
    println!("           per replica    (1F1B)   per rank   per rank, step      pp rank 0     per rank, step");
    for (dp, pp, tp) in [
        (8, 1, 1),
        (4, 2, 1),
        (4, 1, 2),
        (2, 2, 2),
        (2, 4, 1),
        (1, 4, 2),
        (1, 2, 4),
        (1, 8, 1),
    ] {
        let m = BATCH / dp;
        let bubble =
            simulate(&generate(ScheduleKind::OneFOneB, pp, m)?, &Costs::default())?.bubble_fraction;
        // A tensor-parallel block all-reduces twice forward and twice backward per
        // microbatch; pipeline rank 0 sends an activation and receives a gradient per
        // microbatch (a middle rank twice that); data parallelism all-reduces this rank's
        // gradients once per step.
        let tp_ar = if tp > 1 { 4 * (LAYERS / pp) * m } else { 0 };
        let pp_msgs = if pp > 1 { 2 * m } else { 0 };
        let dp_ar = if dp > 1 {
            format!("1/{} model", pp * tp)
        } else {
            "-".into()
        };
        println!(
            "{dp:<2} {pp:<2} {tp:<2}   {m:>12}   {:>5.1}%   1/{:<6}   {tp_ar:>17}   {pp_msgs:>11}   {dp_ar:>13}",
            100.0 * bubble,
            pp * tp
        );
    }

    println!(
        "\n== 3. The same tiny GPT trained on dp 2 × pp 2 × tp 2 (8 threads) and on 1 thread\n"
    );
    let base = TrainConfig {
        model: GptConfig {
            n_layer: 4,
            d_model: 32,
            block_size: 32,
            ..GptConfig::default()
        },
        seq_len: 32,
        batch: 8, // sequences per step over all replicas: the same global batch for both
        microbatches: 2,
        steps: 10,
        warmup: 2,
        threads_per_worker: 1,
        ..TrainConfig::default()
    };
    let mesh_cfg = TrainConfig {
        dp: 2,
        pp: 2,
        tp: 2,
        ..base.clone()
    };
    let one_cfg = TrainConfig {
        dp: 1,
        pp: 1,
        tp: 1,
        ..base
    };
    let corpus = Corpus::bundled();
    let opts = TrainOptions::default();
    let mesh = train(&mesh_cfg, &corpus, &opts).context("dp 2 × pp 2 × tp 2")?;
    print!("{}", mesh.render(&mesh_cfg));
    let one = train(&one_cfg, &corpus, &opts).context("one thread")?;
    print!("{}", one.render(&one_cfg));

    println!("\nstep   loss (2×2×2)   loss (1×1×1)   relative difference");
    for (a, b) in mesh.steps.iter().zip(&one.steps) {
        let rel = (a.loss - b.loss).abs() / b.loss.abs();
        println!(
            "{:>4}   {:>12.6}   {:>12.6}   {rel:.1e}",
            a.step, a.loss, b.loss
        );
        ensure!(rel <= 1e-4, "step {}: the layouts disagree", a.step);
    }
    println!("\nevery layout trains the same model");
    Ok(())
}
