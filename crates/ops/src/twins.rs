//! Every AVX-512 kernel against its portable twin, and both against the math in f64.
//!
//! The portable side always runs (also under Miri, on these small shapes); the AVX-512
//! side runs where the CPU has it and prints a note where it does not. The kernels that
//! [`crate::kernel::simd`] compiles three times are run every way too: the fastest
//! build as called, the AVX2 build inside [`at_most_avx2`] (where the CPU has AVX2 and
//! FMA) and the baseline build inside [`portable_only`].

use std::mem::MaybeUninit;

use crate::attention::{softmax_row_bwd_portable, softmax_row_portable, transpose_portable};
use crate::kernel::{at_most_avx2, avx2, avx512, exp_f32, portable_only, test_data, Uninit};

/// Whether the AVX-512 side runs; prints a note when it does not.
fn has(what: &str) -> bool {
    let on = avx512();
    if !on {
        eprintln!("note: {what}: no AVX-512 here (or under Miri); only the portable twin ran");
    }
    on
}

/// Whether the AVX2 builds of the `simd!` kernels run here (else `at_most_avx2` runs
/// the baseline build, and comparing it with the baseline proves nothing); prints a
/// note when they do not.
fn has_avx2(what: &str) -> bool {
    let on = avx2();
    if !on {
        eprintln!("note: {what}: no AVX2 and FMA here (or under Miri): its AVX2 build did not run");
    }
    on
}

/// The same bits, element by element (`==` would let `0.0` and `-0.0` pass).
fn same_bits(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: length");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert_eq!(x.to_bits(), y.to_bits(), "{what}[{i}]: {x} vs {y}");
    }
}

/// `got` within `tol · (1 + |want|)` of `want`, element by element.
fn close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let err = (g as f64 - w).abs();
        assert!(
            err <= tol * (1.0 + w.abs()),
            "{what}[{i}]: {g} vs {w} (error {err:e})"
        );
    }
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

/// A `Vec` from a kernel that writes all `n` elements of its output.
fn written(n: usize, f: impl FnOnce(&mut [MaybeUninit<f32>])) -> Vec<f32> {
    let mut v = Uninit::new(n).unwrap();
    f(v.as_mut());
    // SAFETY: every caller passes a kernel that writes all `n` elements.
    unsafe { v.assume_init() }
}

/// Row lengths and live prefixes across the 16-lane edges.
const ROWS: [(usize, usize); 8] = [
    (1, 1),
    (5, 3),
    (16, 16),
    (17, 1),
    (17, 17),
    (32, 20),
    (48, 33),
    (70, 64),
];
const SCALE: f64 = 0.353_553_39; // 1/√8

/// The causal softmax row in f64: probabilities (0 after `live`) and the log-sum-exp.
fn softmax_ref(s: &[f32], live: usize) -> (Vec<f64>, f64) {
    let z: Vec<f64> = s[..live].iter().map(|&v| v as f64 * SCALE).collect();
    let m = z.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let sum: f64 = z.iter().map(|v| (v - m).exp()).sum();
    let mut p: Vec<f64> = z.iter().map(|v| (v - m).exp() / sum).collect();
    p.resize(s.len(), 0.0);
    (p, m + sum.ln())
}

#[test]
fn softmax_rows_match_their_twin_and_f64() {
    let avx = has("softmax rows");
    has_avx2("softmax rows");
    for (n, live) in ROWS {
        let s: Vec<f32> = test_data(n, n as u64 + 7, 4.0)
            .iter()
            .map(|&v| v as f32)
            .collect();
        let (want, want_lse) = softmax_ref(&s, live);
        let what = format!("softmax row of {n}, {live} live");
        let mut p = s.clone();
        let lse = portable_only(|| softmax_row_portable(&mut p, live, SCALE));
        close(&format!("portable {what}"), &p, &want, 1e-6);
        close(&format!("portable {what} lse"), &[lse], &[want_lse], 1e-6);
        // Its AVX2 build (where the CPU has it) rounds alike.
        // (Only where it runs: Miri perturbs `exp` and `ln` from run to run, so two runs
        // of the baseline build need not agree bit for bit there.)
        if avx2() {
            let mut v = s.clone();
            let l = at_most_avx2(|| softmax_row_portable(&mut v, live, SCALE));
            same_bits(&format!("AVX2 build of the {what}"), &v, &p);
            same_bits(&format!("AVX2 build of the {what}: lse"), &[l], &[lse]);
        }
        #[cfg(target_arch = "x86_64")]
        if avx {
            let mut a = s.clone();
            // SAFETY: the CPU has AVX-512 (and FMA); 1 ≤ live ≤ n.
            let l = unsafe { crate::avx512::softmax_row(&mut a, live, SCALE as f32) };
            close(&format!("AVX-512 {what}"), &a, &want, 1e-6);
            close(&format!("AVX-512 {what} lse"), &[l], &[want_lse], 1e-6);
            close(&format!("AVX-512 vs portable {what}"), &a, &widen(&p), 1e-6);
        }
    }
    let _ = avx;
}

#[test]
fn softmax_row_gradients_match_their_twin_and_f64() {
    let avx = has("softmax row gradients");
    has_avx2("softmax row gradients");
    for (n, live) in ROWS {
        let s: Vec<f32> = test_data(n, n as u64 + 11, 4.0)
            .iter()
            .map(|&v| v as f32)
            .collect();
        let dp: Vec<f32> = test_data(n, n as u64 + 13, 1.0)
            .iter()
            .map(|&v| v as f32)
            .collect();
        let (p, lse) = softmax_ref(&s, live);
        let dsum = 0.25f32;
        // P = exp(scale·s − lse), dS = scale · P ⊙ (dP − D); both 0 after `live`.
        let ds: Vec<f64> = (0..n)
            .map(|j| SCALE * p[j] * (dp[j] as f64 - dsum as f64))
            .collect();
        let what = format!("softmax row gradient of {n}, {live} live");
        let (mut pp, mut pd) = (s.clone(), dp.clone());
        portable_only(|| softmax_row_bwd_portable(&mut pp, &mut pd, live, SCALE, lse as f32, dsum));
        close(&format!("portable {what}: P"), &pp, &p, 1e-6);
        close(&format!("portable {what}: dS"), &pd, &ds, 1e-6);
        if avx2() {
            let (mut vp, mut vd) = (s.clone(), dp.clone());
            at_most_avx2(|| {
                softmax_row_bwd_portable(&mut vp, &mut vd, live, SCALE, lse as f32, dsum)
            });
            same_bits(&format!("AVX2 build of the {what}: P"), &vp, &pp);
            same_bits(&format!("AVX2 build of the {what}: dS"), &vd, &pd);
        }
        #[cfg(target_arch = "x86_64")]
        if avx {
            let (mut ap, mut ad) = (s.clone(), dp.clone());
            // SAFETY: the CPU has AVX-512 (and FMA); live ≤ n = both lengths.
            unsafe {
                crate::avx512::softmax_row_bwd(
                    &mut ap,
                    &mut ad,
                    live,
                    SCALE as f32,
                    lse as f32,
                    dsum,
                )
            };
            close(&format!("AVX-512 {what}: P"), &ap, &p, 1e-6);
            close(&format!("AVX-512 {what}: dS"), &ad, &ds, 1e-6);
            close(
                &format!("AVX-512 vs portable {what}: P"),
                &ap,
                &widen(&pp),
                1e-6,
            );
            close(
                &format!("AVX-512 vs portable {what}: dS"),
                &ad,
                &widen(&pd),
                1e-6,
            );
        }
    }
    let _ = avx;
}

#[test]
fn transposes_match_their_twin_and_the_definition() {
    let avx = has("transposes");
    for (rows, cols) in [
        (1, 1),
        (3, 2),
        (8, 8),
        (16, 16),
        (17, 5),
        (5, 33),
        (40, 3),
        (9, 12),
    ] {
        let rs = cols + 2;
        let src: Vec<f32> = (0..(rows - 1) * rs + cols).map(|i| i as f32).collect();
        let want: Vec<f64> = (0..cols * rows)
            .map(|i| src[(i % rows) * rs + i / rows] as f64)
            .collect();
        let mut p = vec![-1f32; cols * rows];
        transpose_portable(&src, rs, rows, cols, &mut p);
        close(&format!("portable transpose {rows}×{cols}"), &p, &want, 0.0);
        #[cfg(target_arch = "x86_64")]
        if avx {
            let mut a = vec![-1f32; cols * rows];
            // SAFETY: AVX-512; `src` holds (rows − 1)·rs + cols and `a` cols·rows elements.
            unsafe { crate::avx512::transpose(&src, rs, rows, cols, &mut a, rows) };
            assert_eq!(a, p, "AVX-512 vs portable transpose {rows}×{cols}");
        }
        #[cfg(target_arch = "x86_64")]
        if has_avx2("transposes") {
            let mut a = vec![-1f32; cols * rows];
            // SAFETY: AVX2; `src` holds (rows − 1)·rs + cols and `a` cols·rows elements.
            unsafe { crate::avx2::transpose(&src, rs, rows, cols, &mut a, rows) };
            assert_eq!(a, p, "AVX2 vs portable transpose {rows}×{cols}");
        }
    }
    let _ = avx;
}

#[test]
fn gelu_and_its_gradient_match_their_twin_and_f64() {
    let avx = has("GELU");
    let n = if cfg!(miri) { 37 } else { 1001 };
    // An odd length (a masked tail), from −10.5 to 10.5.
    let x: Vec<f32> = (0..n)
        .map(|i| (i as f32 / (n - 1) as f32 - 0.5) * 21.0)
        .collect();
    let g: Vec<f32> = (0..n).map(|i| 1.0 + (i % 7) as f32 * 0.1).collect();
    let (c, a) = (0.797_884_560_802_865_4f64, 0.044_715f64);
    let (mut want_y, mut want_d) = (vec![], vec![]);
    for (&v, &gv) in x.iter().zip(&g) {
        let v = v as f64;
        let t = (c * (v + a * v * v * v)).tanh();
        want_y.push(0.5 * v * (1.0 + t));
        let dt = (1.0 - t * t) * c * (1.0 + 3.0 * a * v * v);
        want_d.push(gv as f64 * (0.5 * (1.0 + t) + 0.5 * v * dt));
    }
    let (py, pd) = crate::gelu::portable(&x, &g);
    // Up to f32's cancellation in 1 + tanh for x ≪ 0.
    close("portable GELU", &py, &want_y, 1e-6);
    close("portable GELU gradient", &pd, &want_d, 1e-5);
    // The AVX2 build of the same kernels (where the CPU has it): the same rounding.
    // (Only where it runs: under Miri two runs of one build need not agree bit for bit.)
    if has_avx2("GELU") {
        let (vy, vd) = at_most_avx2(|| crate::gelu::simd_build(&x, &g));
        same_bits("AVX2 build of GELU", &vy, &py);
        same_bits("AVX2 build of GELU's gradient", &vd, &pd);
    }
    #[cfg(target_arch = "x86_64")]
    if avx {
        // SAFETY (both): the CPU has AVX-512 and FMA; the kernels write all n elements.
        let y = written(n, |y| unsafe { crate::avx512::gelu(&x, y) });
        let d = written(n, |d| unsafe { crate::avx512::gelu_grad(&x, &g, d) });
        close("AVX-512 GELU", &y, &want_y, 1e-6);
        close("AVX-512 GELU gradient", &d, &want_d, 1e-5);
        // Absolute: for x ≪ 0, 1 + tanh cancels to a few ulp of 1 in both.
        for i in 0..n {
            let tol = 4e-7 * (1.0 + x[i].abs());
            assert!(
                (y[i] - py[i]).abs() <= tol,
                "y at {}: {} vs {}",
                x[i],
                y[i],
                py[i]
            );
            assert!(
                (d[i] - pd[i]).abs() <= tol,
                "dx at {}: {} vs {}",
                x[i],
                d[i],
                pd[i]
            );
        }
    }
    let _ = avx;
}

#[test]
fn fast_exp_twins_agree() {
    // The portable `exp_f32` against f64 here; the AVX-512 `exp` against both in
    // `avx512::tests` (it works on registers).
    let step = if cfg!(miri) { 1.37 } else { 0.0137 };
    let mut x = -87.0f32;
    while x < 88.0 {
        let want = (x as f64).exp();
        assert!((exp_f32(x) as f64 - want).abs() <= 4e-7 * want, "exp({x})");
        x += step;
    }
}

/// The kernels compiled three times by `simd!`: the fastest build (as called), the AVX2
/// build (inside `at_most_avx2`) and the baseline build (inside `portable_only`) against
/// f64 rows.
#[test]
fn simd_builds_of_the_row_kernels_agree_with_f64() {
    let (rows, d) = (3, 37);
    let x: Vec<f32> = test_data(rows * d, 1, 2.0)
        .iter()
        .map(|&v| v as f32)
        .collect();
    let w: Vec<f32> = test_data(d, 2, 1.0)
        .iter()
        .map(|&v| 1.0 + v as f32)
        .collect();
    let b: Vec<f32> = test_data(d, 3, 1.0).iter().map(|&v| v as f32).collect();
    let g: Vec<f32> = test_data(rows * d, 4, 1.0)
        .iter()
        .map(|&v| v as f32)
        .collect();
    let eps = 1e-5;
    // LayerNorm forward and backward in f64.
    let (mut want_y, mut want_dx) = (vec![], vec![]);
    let (mut want_dw, mut want_db) = (vec![0.0; d], vec![0.0; d]);
    for r in 0..rows {
        let xr = widen(&x[r * d..(r + 1) * d]);
        let gr = widen(&g[r * d..(r + 1) * d]);
        let mean = xr.iter().sum::<f64>() / d as f64;
        let var = xr.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
        let rs = 1.0 / (var + eps).sqrt();
        let xh: Vec<f64> = xr.iter().map(|v| (v - mean) * rs).collect();
        let gh: Vec<f64> = (0..d).map(|j| gr[j] * w[j] as f64).collect();
        let m1 = gh.iter().sum::<f64>() / d as f64;
        let m2 = (0..d).map(|j| gh[j] * xh[j]).sum::<f64>() / d as f64;
        for j in 0..d {
            want_y.push(xh[j] * w[j] as f64 + b[j] as f64);
            want_dx.push(rs * (gh[j] - m1 - xh[j] * m2));
            want_dw[j] += gr[j] * xh[j];
            want_db[j] += gr[j];
        }
    }
    has_avx2("row kernels");
    let mut outputs: Vec<Vec<Vec<f32>>> = Vec::new();
    for build in ["fastest (AVX-512 where the CPU has it)", "AVX2", "baseline"] {
        let mut mine: Vec<Vec<f32>> = Vec::new();
        let run = || {
            let mut st = Uninit::new(2 * rows).unwrap();
            let y = written(rows * d, |y| {
                crate::norm::ln_rows(&x, &w, &b, eps, y, st.as_mut())
            });
            // SAFETY: `ln_rows` wrote two statistics for each of the `rows` rows.
            let st = unsafe { st.assume_init() };
            let (mut dw, mut db, mut xh, mut gh) =
                (vec![0f32; d], vec![0f32; d], vec![0f32; d], vec![0f32; d]);
            let dx = written(rows * d, |dx| {
                crate::norm::ln_rows_bwd(&x, &g, &w, &st, dx, &mut dw, &mut db, &mut xh, &mut gh)
            });
            (y, dx, dw, db)
        };
        let (y, dx, dw, db) = match build {
            "baseline" => portable_only(run),
            "AVX2" => at_most_avx2(run),
            _ => run(),
        };
        close(&format!("{build} LayerNorm"), &y, &want_y, 1e-5);
        close(&format!("{build} LayerNorm dx"), &dx, &want_dx, 1e-5);
        close(&format!("{build} LayerNorm dw"), &dw, &want_dw, 1e-5);
        close(&format!("{build} LayerNorm db"), &db, &want_db, 1e-5);
        mine.extend([y, dx, dw, db]);

        // Cross-entropy's rows: Σ exp(z − m) and exp(z − lse)·scale.
        let m: Vec<f32> = (0..rows)
            .map(|r| {
                x[r * d..(r + 1) * d]
                    .iter()
                    .cloned()
                    .fold(f32::MIN, f32::max)
            })
            .collect();
        let want_s: Vec<f64> = (0..rows)
            .map(|r| {
                (0..d)
                    .map(|j| (x[r * d + j] as f64 - m[r] as f64).exp())
                    .sum()
            })
            .collect();
        let lse: Vec<f32> = (0..rows).map(|r| m[r] + (want_s[r] as f32).ln()).collect();
        let want_dz: Vec<f64> = (0..rows * d)
            .map(|i| (x[i] as f64 - lse[i / d] as f64).exp() * 0.5)
            .collect();
        let run = || {
            let s = written(rows, |s| crate::loss::sum_exp(&x, d, d, &m, s));
            let dz = written(rows * d, |dz| {
                crate::loss::softmax_scaled(&x, d, d, &lse, 0.5, dz)
            });
            (s, dz)
        };
        let (s, dz) = match build {
            "baseline" => portable_only(run),
            "AVX2" => at_most_avx2(run),
            _ => run(),
        };
        close(&format!("{build} sum_exp"), &s, &want_s, 1e-6);
        close(&format!("{build} softmax_scaled"), &dz, &want_dz, 1e-6);
        mine.extend([s, dz]);

        // The same over a slice whose last columns are vocabulary padding: left out of
        // the sums, and a zero gradient.
        let valid = d - d / 3;
        let want_s: Vec<f64> = (0..rows)
            .map(|r| {
                (0..valid)
                    .map(|j| (x[r * d + j] as f64 - m[r] as f64).exp())
                    .sum()
            })
            .collect();
        let want_dz: Vec<f64> = (0..rows * d)
            .map(|i| match i % d < valid {
                true => (x[i] as f64 - lse[i / d] as f64).exp() * 0.5,
                false => 0.0,
            })
            .collect();
        let run = || {
            let s = written(rows, |s| crate::loss::sum_exp(&x, d, valid, &m, s));
            let dz = written(rows * d, |dz| {
                crate::loss::softmax_scaled(&x, d, valid, &lse, 0.5, dz)
            });
            (s, dz)
        };
        let (s, dz) = match build {
            "baseline" => portable_only(run),
            "AVX2" => at_most_avx2(run),
            _ => run(),
        };
        close(&format!("{build} padded sum_exp"), &s, &want_s, 1e-6);
        close(
            &format!("{build} padded softmax_scaled"),
            &dz,
            &want_dz,
            1e-6,
        );
        mine.extend([s, dz]);
        outputs.push(mine);
    }
    // The AVX2 and baseline builds round alike: the same bits (where AVX2 runs; under
    // Miri, which perturbs `exp` and `ln` from run to run, two runs of the baseline
    // build need not agree).
    if avx2() {
        for (i, (v, b)) in outputs[1].iter().zip(&outputs[2]).enumerate() {
            same_bits(&format!("AVX2 against baseline, output {i}"), v, b);
        }
    }
}
