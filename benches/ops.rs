//! The hot parts of a training step at the reference workload's shapes (4,096 tokens of
//! d 256, 8 heads of 32, T 128), forward and forward + backward, on one thread:
//!
//! * `matmul`: the fused linear ops (`[4096, 256] → 768` as qkv, `→ 1024` with GELU as
//!   the MLP's first layer, `[4096, 1024] → 256` as its second). Throughput is in FLOPs
//!   (2 per multiply-add; backward is twice the forward), so criterion's `elem/s` reads
//!   as FLOP/s.
//! * `attention`: the packed causal attention (FLOPs of the causal half, 4·T²·hd/2 per
//!   head forward, as the model count).
//! * `block`: the MLP and the attention half of a block, each one fused op as the models
//!   run them (`ops::mlp`, `ops::attention_block`), in FLOPs.
//! * `bf16`: the `matmul` products without bias in f32 against bf16 with f32
//!   accumulation on each bf16 kernel of this CPU (`ops::matmul_bf16_with`).
//! * `layer_norm`, `cross_entropy` (`[4096, 256]` logits), `gelu`: elements/s.
//!
//! Run: `cargo bench --bench ops` (add `-- attention` to filter). `docs/PERFORMANCE.md`
//! records the figures.

#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

use candle_core::{DType, Device, Tensor, Var};
use criterion::{criterion_group, Criterion, Throughput};
use switchyard::ops;

const TOKENS: usize = 4096;
const D: usize = 256;
const HEADS: usize = 8;
const T: usize = 128;

fn var(shape: &[usize], scale: f64) -> Var {
    let t = Tensor::randn(0f32, scale as f32, shape, &Device::Cpu).unwrap();
    Var::from_tensor(&t).unwrap()
}

/// Runs `f` on a one-thread rayon pool, as a worker of one core does.
fn one_thread<R: Send>(f: impl FnOnce() -> R + Send) -> R {
    rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap()
        .install(f)
}

fn matmul(c: &mut Criterion) {
    let mut g = c.benchmark_group("matmul");
    g.sample_size(10);
    for (name, k, n, gelu) in [
        ("qkv 256→768", D, 3 * D, false),
        ("fc+gelu 256→1024", D, 4 * D, true),
        ("proj 1024→256", 4 * D, D, false),
    ] {
        let x = var(&[TOKENS, k], 1.0);
        let w = var(&[n, k], 0.02);
        let b = var(&[n], 0.02);
        let fwd = || match gelu {
            true => ops::linear_gelu(x.as_tensor(), w.as_tensor(), Some(b.as_tensor())),
            false => ops::linear(x.as_tensor(), w.as_tensor(), Some(b.as_tensor())),
        };
        let flops = 2 * TOKENS * k * n;
        g.throughput(Throughput::Elements(flops as u64));
        g.bench_function(format!("{name} forward"), |bch| {
            bch.iter(|| one_thread(|| fwd().unwrap()))
        });
        g.throughput(Throughput::Elements(3 * flops as u64));
        g.bench_function(format!("{name} forward+backward"), |bch| {
            bch.iter(|| one_thread(|| fwd().unwrap().sum_all().unwrap().backward().unwrap()))
        });
    }
    g.finish();
}

/// The products of `matmul` without bias, in f32 (`ops::linear`, the fused f32 path)
/// against bf16 with f32 accumulation (`ops::matmul_bf16`) on each bf16 kernel this CPU
/// runs (`amx`, `avx512_bf16`, `emulated`), bf16 operands; and the best kernel with f32
/// operands rounded as they are packed. In FLOPs; compare as ratios to the f32 row.
fn bf16(c: &mut Criterion) {
    let mut g = c.benchmark_group("bf16");
    g.sample_size(10);
    for (name, k, n) in [
        ("qkv 256→768", D, 3 * D),
        ("fc 256→1024", D, 4 * D),
        ("proj 1024→256", 4 * D, D),
    ] {
        let x = var(&[TOKENS, k], 1.0);
        let w = var(&[n, k], 0.02);
        let (x16, w16) = (
            x.as_tensor().to_dtype(DType::BF16).unwrap(),
            w.as_tensor().to_dtype(DType::BF16).unwrap(),
        );
        g.throughput(Throughput::Elements((2 * TOKENS * k * n) as u64));
        g.bench_function(format!("{name} f32"), |bch| {
            bch.iter(|| one_thread(|| ops::linear(x.as_tensor(), w.as_tensor(), None).unwrap()))
        });
        for kernel in ops::Bf16Kernel::available() {
            g.bench_function(format!("{name} bf16 {kernel}"), |bch| {
                bch.iter(|| {
                    one_thread(|| ops::matmul_bf16_with(&x16, &w16.t().unwrap(), kernel).unwrap())
                })
            });
        }
        // The whole op, forward and backward: f32 `linear` against `linear_bf16` (a bf16
        // input and output, the f32 master weight rounded while packing).
        let x16 = Var::from_tensor(&x16).unwrap();
        g.throughput(Throughput::Elements(3 * (2 * TOKENS * k * n) as u64));
        g.bench_function(format!("{name} linear f32 forward+backward"), |bch| {
            bch.iter(|| {
                one_thread(|| {
                    let y = ops::linear(x.as_tensor(), w.as_tensor(), None).unwrap();
                    y.sum_all().unwrap().backward().unwrap()
                })
            })
        });
        g.bench_function(format!("{name} linear_bf16 forward+backward"), |bch| {
            bch.iter(|| {
                one_thread(|| {
                    let y = ops::linear_bf16(x16.as_tensor(), w.as_tensor(), None).unwrap();
                    y.sum_all().unwrap().backward().unwrap()
                })
            })
        });
        // What candle's own bf16 ops add around the op above: the loss (a sum) and its
        // gradient (zeros, an add, a broadcast) on a `[4096, n]` bf16 tensor.
        let y16 = Var::from_tensor(&Tensor::zeros((TOKENS, n), DType::BF16, &Device::Cpu).unwrap())
            .unwrap();
        g.bench_function(
            format!("{name} candle bf16 sum+backward of the output"),
            |bch| {
                bch.iter(|| one_thread(|| y16.as_tensor().sum_all().unwrap().backward().unwrap()))
            },
        );
        g.throughput(Throughput::Elements((2 * TOKENS * k * n) as u64));
        let best = ops::Bf16Kernel::best();
        g.bench_function(format!("{name} bf16 {best}, f32 operands"), |bch| {
            bch.iter(|| {
                one_thread(|| ops::matmul_bf16(x.as_tensor(), &w.as_tensor().t().unwrap()).unwrap())
            })
        });
    }
    g.finish();
}

fn attention(c: &mut Criterion) {
    let mut g = c.benchmark_group("attention");
    g.sample_size(10);
    let qkv = var(&[TOKENS / T, T, 3 * D], 1.0);
    let hd = D / HEADS;
    let flops = (TOKENS / T) * HEADS * 2 * T * T * hd; // two products, causal half
    g.throughput(Throughput::Elements(flops as u64));
    g.bench_function("packed forward", |b| {
        b.iter(|| one_thread(|| ops::causal_attention_packed(qkv.as_tensor(), HEADS).unwrap()))
    });
    g.throughput(Throughput::Elements(3 * flops as u64));
    g.bench_function("packed forward+backward", |b| {
        b.iter(|| {
            one_thread(|| {
                let y = ops::causal_attention_packed(qkv.as_tensor(), HEADS).unwrap();
                y.sum_all().unwrap().backward().unwrap()
            })
        })
    });
    g.finish();
}

/// The two halves of a transformer block as one op each ([`ops::mlp`] and
/// [`ops::attention_block`], the way the models run them): the products' FLOPs plus the
/// attention's causal half.
fn block(c: &mut Criterion) {
    let mut g = c.benchmark_group("block");
    g.sample_size(10);
    let x = var(&[TOKENS / T, T, D], 1.0);
    let (w1, b1) = (var(&[4 * D, D], 0.02), var(&[4 * D], 0.02));
    let (w2, b2) = (var(&[D, 4 * D], 0.02), var(&[D], 0.02));
    let (wq, bq) = (var(&[3 * D, D], 0.02), var(&[3 * D], 0.02));
    let (wp, bp) = (var(&[D, D], 0.02), var(&[D], 0.02));
    let opts = ops::PairOptions::default();
    let mlp = || {
        let (w1, b1, w2, b2) = (
            w1.as_tensor(),
            b1.as_tensor(),
            w2.as_tensor(),
            b2.as_tensor(),
        );
        ops::mlp(x.as_tensor(), w1, Some(b1), w2, Some(b2), &opts).unwrap()
    };
    let attn = || {
        let (wq, bq, wp, bp) = (
            wq.as_tensor(),
            bq.as_tensor(),
            wp.as_tensor(),
            bp.as_tensor(),
        );
        ops::attention_block(x.as_tensor(), wq, Some(bq), wp, Some(bp), HEADS, &opts).unwrap()
    };
    let hd = D / HEADS;
    let mlp_flops = 2 * TOKENS * 2 * D * 4 * D;
    let attn_flops = 2 * TOKENS * 4 * D * D + (TOKENS / T) * HEADS * 2 * T * T * hd;
    for (name, flops, f) in [
        ("mlp", mlp_flops, &mlp as &(dyn Fn() -> Tensor + Sync)),
        ("attention", attn_flops, &attn),
    ] {
        g.throughput(Throughput::Elements(flops as u64));
        g.bench_function(format!("{name} forward"), |bch| bch.iter(|| one_thread(f)));
        g.throughput(Throughput::Elements(3 * flops as u64));
        g.bench_function(format!("{name} forward+backward"), |bch| {
            bch.iter(|| one_thread(|| f().sum_all().unwrap().backward().unwrap()))
        });
    }
    g.finish();
}

fn elementwise(c: &mut Criterion) {
    let mut g = c.benchmark_group("rows");
    g.sample_size(20);
    let x = var(&[TOKENS, D], 1.0);
    let w = var(&[D], 1.0);
    let b = var(&[D], 0.1);
    let targets: Vec<u32> = (0..TOKENS as u32).map(|i| (i * 7) % 256).collect();
    let targets = Tensor::new(targets.as_slice(), &Device::Cpu).unwrap();
    g.throughput(Throughput::Elements((TOKENS * D) as u64));
    g.bench_function("layer_norm forward+backward", |bch| {
        bch.iter(|| {
            one_thread(|| {
                let y = ops::layer_norm(x.as_tensor(), w.as_tensor(), b.as_tensor(), 1e-5);
                y.unwrap().sum_all().unwrap().backward().unwrap()
            })
        })
    });
    g.bench_function("cross_entropy forward+backward", |bch| {
        bch.iter(|| {
            one_thread(|| {
                let l = ops::cross_entropy(x.as_tensor(), &targets).unwrap();
                l.backward().unwrap()
            })
        })
    });
    g.bench_function("add_bias forward", |bch| {
        bch.iter(|| {
            one_thread(|| ops::add_bias(x.as_tensor(), b.as_tensor(), ops::OpsBackend::Fused))
        })
    });
    // A residual sum, plain and with GPT-2's dropout on its branch (the mask drawn from
    // each element's place, in the same pass): what hidden dropout adds to a sum.
    let (r, a) = (var(&[8, TOKENS / 8, D], 1.0), var(&[8, TOKENS / 8, D], 1.0));
    let mask = ops::DropoutMask {
        p: 0.1,
        key: ops::DropoutMask::step_key(1, 0),
        site: 1,
        first_row: 0,
        first_position: 0,
    };
    g.bench_function("residual sum forward", |bch| {
        bch.iter(|| one_thread(|| r.as_tensor() + a.as_tensor()))
    });
    g.bench_function("dropout_add forward", |bch| {
        bch.iter(|| {
            one_thread(|| {
                ops::dropout_add(r.as_tensor(), a.as_tensor(), &mask, ops::OpsBackend::Fused)
            })
        })
    });
    let h = var(&[TOKENS, 4 * D], 1.0);
    g.throughput(Throughput::Elements((TOKENS * 4 * D) as u64));
    g.bench_function("gelu forward+backward", |bch| {
        bch.iter(|| {
            one_thread(|| {
                ops::gelu(h.as_tensor())
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap()
            })
        })
    });
    let _ = DType::F32;
    g.finish();
}

criterion_group!(benches, matmul, bf16, attention, block, elementwise);

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
