//! Chapter 8, "Many machines with MPI" (`docs/tutorial/08-mpi.md`): one rank per
//! process, as a library call.
//!
//! Every process of `mpirun -np 4` initialises MPI, trains its rank of a tiny GPT laid out
//! pp 2 × tp 2 with `train_rank`, and rank 0 prints the job's report. Then rank 0 trains
//! the same run on threads in its own process and checks that the losses agree: the
//! transport changes where the ranks run, not what they compute.
//!
//! ```text
//! scripts/install-mpi.sh
//! cargo build --release --features mpi --example mpi
//! mpirun --allow-run-as-root --oversubscribe -np 4 target/release/examples/mpi
//! ```

use anyhow::ensure;
use switchyard::models::GptConfig;
use switchyard::train::data::Corpus;
use switchyard::train::{train, train_rank, TrainConfig, TrainOptions};

fn main() -> anyhow::Result<()> {
    let cfg = TrainConfig {
        model: GptConfig {
            n_layer: 2,
            d_model: 32,
            block_size: 32,
            ..GptConfig::default()
        },
        seq_len: 32,
        batch: 8,
        steps: 5,
        warmup: 2,
        threads_per_worker: 1,
        ..TrainConfig::default()
    };
    let corpus = Corpus::bundled();
    let world = switchyard::comm::mpi::init()?;
    ensure!(
        world.world_size() == cfg.world_size(),
        "run me with mpirun -np {}",
        cfg.world_size()
    );
    let report = match train_rank(world, &cfg, &corpus, &TrainOptions::default()) {
        Ok(r) => r,
        Err(e) => switchyard::comm::mpi::abort(1, &format!("{e:#}")),
    };
    if let Some(report) = report {
        print!("{}", report.render(&cfg));
        let threads = train(&cfg, &corpus, &TrainOptions::default())?;
        for (m, t) in report.steps.iter().zip(&threads.steps) {
            ensure!(
                (m.loss - t.loss).abs() <= 1e-5 * t.loss.abs(),
                "step {}: {} under MPI, {} on threads",
                m.step,
                m.loss,
                t.loss
            );
        }
        println!("the MPI run's losses equal the in-process run's");
    }
    Ok(())
}
