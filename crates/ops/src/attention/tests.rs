//! The attention's slice-level forward and backward on two threads against plain f64
//! math: small enough for Miri, which checks that the tasks writing disjoint columns of
//! one output never hold overlapping `&mut` borrows.

use std::sync::OnceLock;

use super::{Attention, Geo};
use crate::kernel::{at_most_avx2, avx2, portable_only, test_data, Float};

/// Which builds of the kernels run: the fastest the CPU has, or capped for the whole op,
/// its tasks on the pool's threads included (`kernel::Inherited`).
#[derive(Clone, Copy, Debug)]
enum Build {
    Fastest,
    Avx2,
    Portable,
}

impl Build {
    fn run<R>(self, f: impl FnOnce() -> R) -> R {
        match self {
            Build::Fastest => f(),
            Build::Avx2 => at_most_avx2(f),
            Build::Portable => portable_only(f),
        }
    }
}

/// Forward and backward of causal attention in f64 for one (batch, head) pair:
/// `q`, `k`, `v`, `d_o` are `t × hd` row-major; returns `(o, dq, dk, dv)`.
#[allow(clippy::type_complexity)]
fn reference(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    d_o: &[f64],
    t: usize,
    hd: usize,
) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
    let scale = 1.0 / (hd as f64).sqrt();
    let at = |x: &[f64], i: usize, d: usize| x[i * hd + d];
    let mut p = vec![0.0; t * t];
    for i in 0..t {
        let s: Vec<f64> = (0..=i)
            .map(|j| (0..hd).map(|d| at(q, i, d) * at(k, j, d)).sum::<f64>() * scale)
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
        for j in 0..=i {
            p[i * t + j] = (s[j] - m).exp() / z;
        }
    }
    let mut o = vec![0.0; t * hd];
    let (mut dq, mut dk, mut dv) = (vec![0.0; t * hd], vec![0.0; t * hd], vec![0.0; t * hd]);
    for i in 0..t {
        for d in 0..hd {
            o[i * hd + d] = (0..t).map(|j| p[i * t + j] * at(v, j, d)).sum();
        }
    }
    for i in 0..t {
        // dP = dO·vᵀ; dS = P ⊙ (dP − Σ_j P·dP).
        let dp: Vec<f64> = (0..t)
            .map(|j| (0..hd).map(|d| at(d_o, i, d) * at(v, j, d)).sum())
            .collect();
        let dot: f64 = (0..t).map(|j| p[i * t + j] * dp[j]).sum();
        for j in 0..t {
            let ds = p[i * t + j] * (dp[j] - dot);
            for d in 0..hd {
                dv[j * hd + d] += p[i * t + j] * at(d_o, i, d);
                dq[i * hd + d] += ds * at(k, j, d) * scale;
                dk[j * hd + d] += ds * at(q, i, d) * scale;
            }
        }
    }
    (o, dq, dk, dv)
}

fn run<T: Float>(b: usize, h: usize, t: usize, hd: usize, tol: f64) {
    run_as::<T>(Build::Fastest, b, h, t, hd, tol)
}

fn run_as<T: Float>(build: Build, b: usize, h: usize, t: usize, hd: usize, tol: f64) {
    let dl = h * hd;
    let x64 = test_data(b * t * 3 * dl, 5, 1.5);
    let do64 = test_data(b * t * dl, 6, 1.0);
    let x: Vec<T> = x64.iter().map(|&v| T::from_f64(v)).collect();
    let d_o: Vec<T> = do64.iter().map(|&v| T::from_f64(v)).collect();
    let attn = Attention {
        n_head: h,
        lse: OnceLock::new(),
    };
    let g = Geo {
        b,
        t,
        h,
        hd,
        scale: 1.0 / (hd as f64).sqrt(),
    };
    // Two threads: under Miri each pair is a task, so pairs run at once; elsewhere
    // only shapes of more than `pairs_per_task` pairs are split.
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let (o, dx) = pool.install(|| {
        build.run(|| {
            let o = attn.forward(&x, g).unwrap();
            let dx = attn.backward_slices(&x, &o, &d_o, g).unwrap();
            (o, dx)
        })
    });
    assert_eq!((o.len(), dx.len()), (b * t * dl, b * t * 3 * dl));
    let close = |what: &str, got: T, want: f64| {
        let got = got.to_f64();
        assert!(
            (got - want).abs() <= tol * (1.0 + want.abs()),
            "{what} ({b}, {h}, {t}, {hd}), {build:?} build: {got} vs {want}"
        );
    };
    for bi in 0..b {
        for hi in 0..h {
            // The pair's q, k, v and dO as t × hd matrices.
            let take = |src: &[f64], ld: usize, off: usize| -> Vec<f64> {
                (0..t)
                    .flat_map(|i| (0..hd).map(move |d| (i, d)))
                    .map(|(i, d)| src[(bi * t + i) * ld + off + hi * hd + d])
                    .collect()
            };
            let (q, k, v) = (
                take(&x64, 3 * dl, 0),
                take(&x64, 3 * dl, dl),
                take(&x64, 3 * dl, 2 * dl),
            );
            let (ro, dq, dk, dv) = reference(&q, &k, &v, &take(&do64, dl, 0), t, hd);
            for i in 0..t {
                for d in 0..hd {
                    let (row_o, row_x) = ((bi * t + i) * dl, (bi * t + i) * 3 * dl + hi * hd + d);
                    close("o", o[row_o + hi * hd + d], ro[i * hd + d]);
                    close("dq", dx[row_x], dq[i * hd + d]);
                    close("dk", dx[row_x + dl], dk[i * hd + d]);
                    close("dv", dx[row_x + 2 * dl], dv[i * hd + d]);
                }
            }
        }
    }
}

/// Four (batch, head) pairs on a pool of two threads (two pairs under Miri), T = 18
/// across the 16-row blocks.
#[test]
fn forward_and_backward_on_two_threads_match_f64() {
    // Under Miri two f64 pairs, of two sequences (the batch offset), still across a
    // block's edge (each pair is a task there, so the two threads write at once); the f32
    // path shares the f64 one but for `exp`: a smaller shape, of two heads.
    match cfg!(miri) {
        true => {
            run::<f64>(2, 1, 18, 3, 1e-10);
            run::<f32>(1, 2, 5, 3, 2e-5);
        }
        false => {
            run::<f64>(2, 2, 18, 3, 1e-10);
            run::<f32>(2, 2, 18, 3, 2e-5);
        }
    }
    // One position, one head, one column.
    run::<f64>(1, 1, 1, 1, 1e-12);
}

#[test]
fn empty_sequences_and_batches_give_empty_results() {
    for (b, t) in [(2, 0), (0, 3), (0, 0)] {
        let attn = Attention {
            n_head: 2,
            lse: OnceLock::new(),
        };
        let g = Geo {
            b,
            t,
            h: 2,
            hd: 3,
            scale: 1.0 / 3f64.sqrt(),
        };
        let o = attn.forward::<f32>(&[], g).unwrap();
        let dx = attn.backward_slices::<f32>(&[], &o, &[], g).unwrap();
        assert!(o.is_empty() && dx.is_empty(), "B = {b}, T = {t}");
    }
}

/// The op end to end on each build of its kernels: on an AVX-512 CPU the AVX2 small
/// products and transposes run only here and in their unit tests. T = 72 crosses the
/// 16-row blocks (the last of 8 rows) and the 6 × 16 tile's row edges; hd = 20 is two
/// whole vectors of 8 columns and a masked rest; the 24 pairs are more than
/// `pairs_per_task` (11 here), so the pool's two threads each run some, under the
/// ceiling they inherit.
#[test]
#[cfg_attr(
    miri,
    ignore = "Miri runs the portable path only, which the test above covers"
)]
fn every_build_matches_f64() {
    if !avx2() {
        eprintln!("note: no AVX2 and FMA here: the AVX2 build did not run");
    }
    let (b, h, t, hd) = (2, 12, 72, 20);
    assert!(
        b * h
            > super::pairs_per_task(Geo {
                b,
                t,
                h,
                hd,
                scale: 1.0
            })
    );
    for build in [Build::Fastest, Build::Avx2, Build::Portable] {
        run_as::<f32>(build, b, h, t, hd, 2e-5);
    }
}
