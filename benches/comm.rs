//! The in-process transport against the memory bus.
//!
//! For each size from 4 KiB to 64 MiB: a 2-thread memcpy of the same bytes (the yardstick),
//! then all-reduce, all-gather and a send/recv ping at world sizes 2 and 4. Criterion's
//! throughput is the buffer size per operation, so the ratio of two throughputs at one
//! size is the ratio of their bandwidths. `docs/PERFORMANCE.md` records the figures.
//!
//! Run: `cargo bench --bench comm` (add `-- all_reduce/2` to filter).

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use switchyard_comm::local::Launcher;
use switchyard_comm::{Communicator, ReduceOp};

const SIZES: [usize; 5] = [4 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20];

fn label(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{}MiB", bytes >> 20)
    } else {
        format!("{}KiB", bytes >> 10)
    }
}

/// `iters` copies of `bytes` by `threads` threads, each copying its share.
fn memcpy(bytes: usize, threads: usize, iters: u64) -> Duration {
    let n = bytes / 4;
    let src = vec![1f32; n];
    let mut dst = vec![0f32; n];
    let per = n.div_ceil(threads);
    let barrier = Barrier::new(threads);
    let times: Vec<Duration> = std::thread::scope(|s| {
        let handles: Vec<_> = dst
            .chunks_mut(per)
            .zip(src.chunks(per))
            .map(|(d, sr)| {
                let barrier = &barrier;
                s.spawn(move || {
                    d.copy_from_slice(sr);
                    barrier.wait();
                    let t = Instant::now();
                    for _ in 0..iters {
                        d.copy_from_slice(black_box(sr));
                        black_box(&d);
                    }
                    t.elapsed()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    times.into_iter().max().unwrap()
}

/// Runs `op` `iters` times on every rank of a fresh job, each rank on its own input
/// from `setup`; returns the slowest rank's time.
fn timed<S, F>(world: usize, iters: u64, setup: S, op: F) -> Duration
where
    S: Fn(usize) -> Tensor + Sync,
    F: Fn(&dyn Communicator, &Tensor) -> switchyard_comm::Result<()> + Sync,
{
    let out = Launcher::new(world)
        .threads_per_worker(1)
        .run(|comm| {
            let x = setup(comm.rank());
            op(&*comm, &x)?; // warm-up
            comm.barrier()?;
            let t = Instant::now();
            for _ in 0..iters {
                op(&*comm, &x)?;
            }
            Ok::<_, switchyard_comm::CommError>(t.elapsed())
        })
        .expect("benchmark launch");
    out.into_iter().max().unwrap()
}

fn input(bytes: usize, rank: usize) -> Tensor {
    Tensor::full(rank as f32, bytes / 4, &Device::Cpu).unwrap()
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("memcpy");
    for &bytes in &SIZES {
        g.throughput(Throughput::Bytes(bytes as u64));
        g.bench_function(BenchmarkId::new("2threads", label(bytes)), |b| {
            b.iter_custom(|iters| memcpy(bytes, 2, iters))
        });
    }
    g.finish();

    for world in [2usize, 4] {
        let mut g = c.benchmark_group(format!("all_reduce/{world}"));
        for &bytes in &SIZES {
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function(label(bytes), |b| {
                b.iter_custom(|iters| {
                    timed(
                        world,
                        iters,
                        |r| input(bytes, r),
                        |comm, x| {
                            black_box(comm.all_reduce(x, ReduceOp::Sum)?);
                            Ok(())
                        },
                    )
                })
            });
        }
        g.finish();

        let mut g = c.benchmark_group(format!("all_gather/{world}"));
        for &bytes in &SIZES {
            // The output is `bytes`; each rank contributes bytes / world.
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function(label(bytes), |b| {
                b.iter_custom(|iters| {
                    timed(
                        world,
                        iters,
                        |r| input(bytes / world, r),
                        |comm, x| {
                            black_box(comm.all_gather(x, 0)?);
                            Ok(())
                        },
                    )
                })
            });
        }
        g.finish();

        let mut g = c.benchmark_group(format!("send_recv/{world}"));
        for &bytes in &SIZES {
            g.throughput(Throughput::Bytes(bytes as u64));
            g.bench_function(label(bytes), |b| {
                b.iter_custom(|iters| {
                    timed(
                        world,
                        iters,
                        |r| input(bytes, r),
                        |comm, x| {
                            // A ring: every rank sends to the next and receives from the previous.
                            let n = comm.world_size();
                            comm.send(x, (comm.rank() + 1) % n, 0)?;
                            black_box(comm.recv((comm.rank() + n - 1) % n, 0)?);
                            Ok(())
                        },
                    )
                })
            });
        }
        g.finish();
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = bench
}
criterion_main!(benches);
