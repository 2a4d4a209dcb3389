//! Column-then-row parallel MLP (`d → 4d → d`), forward + backward, at tp = 1 and 2.
//!
//! Each sample launches the tensor-parallel group once and times `iters` steps on rank
//! 0 (every rank runs the same steps), so thread start-up is not measured.

use std::time::{Duration, Instant};

use candle_core::{DType, Device, Tensor, Var};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use switchyard_comm::local;
use switchyard_shard::{LayerInit, ParallelMlp, ParamSource, ParamStore};

const D: usize = 256;
const B: usize = 4;
const T: usize = 64;

fn run(tp: usize, iters: u64) -> Duration {
    let times = local::launch(tp, |comm| -> candle_core::Result<Duration> {
        let store =
            ParamStore::for_group(comm.as_ref(), DType::F32, ParamSource::Init { seed: 0 })?;
        let mlp = ParallelMlp::new(
            &store.builder(),
            comm.clone(),
            D,
            4 * D,
            LayerInit::default(),
        )?;
        let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (B, T, D), &Device::Cpu)?)?;
        let step = || -> candle_core::Result<()> {
            let y = mlp.forward(x.as_tensor())?;
            let grads = y.sqr()?.mean_all()?.backward()?;
            std::hint::black_box(grads);
            Ok(())
        };
        step()?; // warm-up
        let start = Instant::now();
        for _ in 0..iters {
            step()?;
        }
        Ok(start.elapsed())
    })
    .expect("tensor-parallel MLP step failed");
    times[0]
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("tp_mlp_fwd_bwd");
    g.sample_size(10);
    for tp in [1usize, 2] {
        g.bench_with_input(
            BenchmarkId::from_parameter(format!("tp{tp}")),
            &tp,
            |b, &tp| b.iter_custom(|iters| run(tp, iters)),
        );
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
