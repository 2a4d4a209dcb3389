//! One training step (forward, backward, gradient sync, AdamW) of the `small` preset
//! (d 128, 4 layers, T 64, 16 sequences) on one worker and on 2 pipeline ranks with 1F1B
//! over 8 microbatches, each worker on one thread. The time of a step is rank 0's, after
//! one untimed step; throughput is in tokens.
//!
//! A second group times ZeRO 3 with and without prefetching the gathers, with a
//! network's latency on every collective ([`Latency`]); a third the data-parallel
//! all-reduce overlapped with the backward or after it, and ZeRO 2's reduce-scatters on
//! a thread of their own or not, over a slow link ([`Latency::wrap_link`]).
//!
//! Run: `cargo bench --bench step`. `switchyard bench` times the full reference workload.

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion, Throughput};
use switchyard::bench::{cases, config, Preset};
use switchyard::comm::local::Launcher;
use switchyard::comm::{Communicator, Latency};
use switchyard::models::GptConfig;
use switchyard::shard::ParamSource;
use switchyard::train::data::Corpus;
use switchyard::train::{TrainConfig, Worker};

/// `iters` steps of `case` after one warm-up step; rank 0's time.
fn steps(preset: &Preset, case: &str, iters: u64) -> Duration {
    let c = cases(preset).into_iter().find(|c| c.name == case).unwrap();
    steps_of(config(preset, &c), Duration::ZERO, iters)
}

/// `iters` steps of `cfg` after one warm-up step, every collective `latency` late
/// ([`Latency`]); rank 0's time.
fn steps_of(cfg: TrainConfig<GptConfig>, latency: Duration, iters: u64) -> Duration {
    steps_over(cfg, &|world| Latency::wrap(world, latency), iters)
}

/// `iters` steps of `cfg` after one warm-up step, over the world `link` makes of each
/// rank's; rank 0's time.
fn steps_over(
    mut cfg: TrainConfig<GptConfig>,
    link: &(dyn Fn(Arc<dyn Communicator>) -> Arc<dyn Communicator> + Sync),
    iters: u64,
) -> Duration {
    cfg.steps = iters as usize + 1;
    let corpus = Corpus::bundled();
    let times = Launcher::new(cfg.world_size())
        .threads_per_worker(1)
        .run(|world| -> anyhow::Result<Duration> {
            let world = link(world);
            let mut w = Worker::new(world, &cfg, &corpus, ParamSource::Init { seed: cfg.seed })?;
            let _ = w.step(0)?;
            let t = Instant::now();
            for i in 0..iters as usize {
                let _ = w.step(i + 1)?;
            }
            Ok(t.elapsed())
        })
        .unwrap();
    times[0]
}

fn step(c: &mut Criterion) {
    let p = Preset::named("small").unwrap();
    let mut g = c.benchmark_group("step");
    g.sample_size(10);
    g.throughput(Throughput::Elements(p.tokens_per_step() as u64));
    for case in ["1 worker", "pp 2 1f1b"] {
        g.bench_function(format!("small {case}"), |b| {
            b.iter_custom(|iters| steps(&p, case, iters))
        });
    }
    g.finish();
}

/// ZeRO 3 on 2 replicas with every collective 1 ms late (a network's latency): the
/// segments' gathers in the step's path, or prefetched on the communication thread
/// while the segment before computes. Compare the two as a ratio.
fn zero3_prefetch(c: &mut Criterion) {
    let p = Preset::named("small").unwrap();
    let dp2 = cases(&p).into_iter().find(|c| c.name == "dp 2").unwrap();
    let mut g = c.benchmark_group("zero3");
    g.sample_size(10);
    g.throughput(Throughput::Elements(p.tokens_per_step() as u64));
    for prefetch in [false, true] {
        let cfg = TrainConfig {
            zero: 3,
            zero_prefetch: prefetch,
            ..config(&p, &dp2)
        };
        let name = format!("small dp 2, 1 ms a collective, prefetch {prefetch}");
        g.bench_function(name, |b| {
            b.iter_custom(|iters| steps_of(cfg.clone(), Duration::from_millis(1), iters))
        });
    }
    g.finish();
}

/// The small preset on 2 replicas over a link of 0.1 ms and 0.25 GB/s (a slow network,
/// whose transfers cost no core): the gradients all-reduced after the backward, or
/// block by block during it (`overlap_grad_reduce`). Compare the two as a ratio.
fn overlap_grad_reduce(c: &mut Criterion) {
    let p = Preset::named("small").unwrap();
    let dp2 = cases(&p).into_iter().find(|c| c.name == "dp 2").unwrap();
    let mut g = c.benchmark_group("overlap");
    g.sample_size(10);
    g.throughput(Throughput::Elements(p.tokens_per_step() as u64));
    let link = |w| Latency::wrap_link(w, Duration::from_micros(100), 0.25e9);
    // ZeRO 2's reduce-scatters on the rank's thread or on their own (the same flag).
    for (zero, overlap) in [(0, false), (0, true), (2, false), (2, true)] {
        let cfg = TrainConfig {
            overlap_grad_reduce: overlap,
            zero,
            ..config(&p, &dp2)
        };
        let name = format!("small dp 2 zero {zero}, 0.25 GB/s link, overlap {overlap}");
        g.bench_function(name, |b| {
            b.iter_custom(|iters| steps_over(cfg.clone(), &link, iters))
        });
    }
    g.finish();
}

criterion_group!(benches, step, zero3_prefetch, overlap_grad_reduce);

/// mimalloc reads `MIMALLOC_PURGE_DELAY` when the process starts; `-1` keeps freed memory
/// in the process, as `switchyard bench` does, so the timings include no page faults of
/// memory handed back to the OS. Re-runs this bench with it set.
fn main() {
    switchyard::keep_freed_memory();
    benches();
    criterion::Criterion::default()
        .configure_from_args()
        .final_summary();
}
