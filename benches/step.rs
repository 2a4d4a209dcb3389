//! One training step (forward, backward, gradient sync, AdamW) of the `small` preset
//! (d 128, 4 layers, T 64, 16 sequences) on one worker and on 2 pipeline ranks with 1F1B
//! over 8 microbatches, each worker on one thread. The time of a step is rank 0's, after
//! one untimed step; throughput is in tokens.
//!
//! Run: `cargo bench --bench step`. `switchyard bench` times the full reference workload.

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::time::{Duration, Instant};

use criterion::{criterion_group, Criterion, Throughput};
use switchyard::bench::{cases, config, Preset};
use switchyard::comm::local::Launcher;
use switchyard::shard::ParamSource;
use switchyard::train::data::Corpus;
use switchyard::train::Worker;

/// `iters` steps of `case` after one warm-up step; rank 0's time.
fn steps(preset: &Preset, case: &str, iters: u64) -> Duration {
    let c = cases(preset).into_iter().find(|c| c.name == case).unwrap();
    let mut cfg = config(preset, &c);
    cfg.steps = iters as usize + 1;
    let corpus = Corpus::bundled();
    let times = Launcher::new(cfg.world_size())
        .threads_per_worker(1)
        .run(|world| -> anyhow::Result<Duration> {
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

criterion_group!(benches, step);

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
