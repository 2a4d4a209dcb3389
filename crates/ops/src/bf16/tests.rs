//! Every kernel this CPU runs against an f64 product of the same bf16 values.

use half::bf16;

use super::*;
use crate::kernel::{test_data, Dst};
use crate::OpsBackend;

/// The shapes: edges of the 32-blocks, a single row, column and depth, whole blocks
/// (whose contiguous bf16 rows are their own packing, in safe code), and blocks of rows
/// larger than one task's. Under Miri, where each 32 × 32 × 32 block of the emulated
/// kernel costs seconds, only the unsafe paths' cases: edges in every dimension, and
/// two blocks of columns and of depths.
fn shapes() -> Vec<(usize, usize, usize)> {
    if cfg!(miri) {
        return vec![(5, 17, 31), (3, 33, 40)];
    }
    vec![
        (1, 1, 1),
        (5, 17, 31),
        (33, 32, 33),
        (32, 45, 64),
        (3, 70, 100),
        (70, 33, 129),
        (300, 96, 520),
        (64, 64, 2048),
    ]
}

fn round(x: &[f64]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f64(v)).collect()
}

/// `Σ_p a[i][p] · b[p][j]` in f64, and `Σ |a[i][p] · b[p][j]|` (the scale of its
/// rounding errors).
fn reference(a: Mat<bf16>, b: Mat<bf16>, m: usize, n: usize, k: usize) -> Vec<(f64, f64)> {
    let mut out = Vec::with_capacity(m * n);
    for i in 0..m {
        for j in 0..n {
            let (mut s, mut abs) = (0f64, 0f64);
            for p in 0..k {
                let x = a.data[i * a.rs + p * a.cs].to_f64() * b.data[p * b.rs + j * b.cs].to_f64();
                s += x;
                abs += x.abs();
            }
            out.push((s, abs));
        }
    }
    out
}

#[test]
fn every_kernel_is_the_product_of_the_bf16_values_summed_in_f32() {
    let kernels = Bf16Kernel::available();
    assert_eq!(kernels.last(), Some(&Bf16Kernel::Emulated));
    for (m, n, k) in shapes() {
        let a = round(&test_data(m * k, 1, 2.0));
        let b = round(&test_data(k * n, 2, 2.0));
        let (bt_data, at_data) = (transpose(&b, k, n), transpose(&a, m, k));
        // Every other element: neither stride is 1 (packing's general path).
        let spread = |x: &[bf16]| -> Vec<bf16> {
            x.iter().flat_map(|&v| [v, bf16::from_f32(7.0)]).collect()
        };
        let (a2, b2) = (spread(&a), spread(&b));
        // Row-major, each operand transposed (a weight stored [out, in]), strided.
        let layouts = [
            (Mat::rows(&a, k), Mat::rows(&b, n), "a · b"),
            (Mat::rows(&at_data, m).t(), Mat::rows(&b, n), "(aᵀ)ᵀ · b"),
            (Mat::rows(&a, k), Mat::rows(&bt_data, k).t(), "a · (bᵀ)ᵀ"),
            (
                Mat {
                    data: &a2,
                    rs: 2 * k,
                    cs: 2,
                },
                Mat {
                    data: &b2,
                    rs: 2 * n,
                    cs: 2,
                },
                "strided a · strided b",
            ),
        ];
        for (i, (am, bm, form)) in layouts.into_iter().enumerate() {
            let want = reference(am, bm, m, n, k);
            // Under Miri each layout once, writing and accumulating in turn.
            let modes = match cfg!(miri) {
                true => vec![i % 2 == 1],
                false => vec![false, true],
            };
            for &kernel in &kernels {
                for &accumulate in &modes {
                    let ld = n + 3;
                    let start = test_data(m * ld, 3, 1.0);
                    let mut dst: Vec<f32> = start.iter().map(|&x| x as f32).collect();
                    let d = match accumulate {
                        true => Dst::Add(&mut dst),
                        false => Dst::Set(&mut dst),
                    };
                    gemm(kernel, m, n, k, d, ld, am, bm);
                    for i in 0..m {
                        for j in 0..ld {
                            let got = dst[i * ld + j] as f64;
                            let before = start[i * ld + j] as f32 as f64;
                            if j >= n {
                                assert_eq!(got, before, "{kernel} {form}: padding written");
                                continue;
                            }
                            let (s, abs) = want[i * n + j];
                            let s = if accumulate { s + before } else { s };
                            let tol = (k as f64 + 2.0) * f32::EPSILON as f64 * (abs + before.abs());
                            assert!(
                                (got - s).abs() <= tol + 1e-30,
                                "{kernel} {form} m {m} n {n} k {k} acc {accumulate} ({i}, {j}): \
                                 {got} against {s} (tolerance {tol})"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn a_bias_is_added_once_to_every_row() {
    // Whole blocks and edges, several chunks of depth (not under Miri), an empty depth.
    let more = match cfg!(miri) {
        true => vec![(3, 5, 0)],
        false => vec![(64, 40, 1100), (3, 5, 0)],
    };
    for (m, n, k) in shapes().into_iter().chain(more) {
        let a = round(&test_data(m * k, 1, 2.0));
        let b = round(&test_data(k * n, 2, 2.0));
        let bias: Vec<f32> = test_data(n, 4, 3.0).iter().map(|&x| x as f32).collect();
        let (am, bm) = (Mat::rows(&a, k), Mat::rows(&b, n));
        let want = reference(am, bm, m, n, k);
        for &kernel in &Bf16Kernel::available() {
            let ld = n + 2;
            let mut dst = vec![f32::NAN; m * ld];
            gemm_bias(kernel, m, n, k, Dst::Set(&mut dst), ld, am, bm, Some(&bias));
            for i in 0..m {
                for j in 0..ld {
                    let got = dst[i * ld + j] as f64;
                    if j >= n {
                        assert!(got.is_nan(), "{kernel}: padding written");
                        continue;
                    }
                    let (s, abs) = want[i * n + j];
                    let c = bias[j] as f64;
                    let tol = (k as f64 + 2.0) * f32::EPSILON as f64 * (abs + c.abs());
                    assert!(
                        (got - (s + c)).abs() <= tol + 1e-30,
                        "{kernel} m {m} n {n} k {k} ({i}, {j}): {got} against {}",
                        s + c
                    );
                }
            }
        }
    }
}

#[test]
fn an_empty_depth_is_an_empty_sum() {
    for kernel in Bf16Kernel::available() {
        let mut dst = vec![7f32; 6];
        let empty: [bf16; 0] = [];
        let (a, b) = (Mat::rows(&empty, 0), Mat::rows(&empty, 3));
        gemm(kernel, 2, 3, 0, Dst::Add(&mut dst), 3, a, b);
        assert_eq!(dst, [7.0; 6], "{kernel}");
        gemm(kernel, 2, 3, 0, Dst::Set(&mut dst), 3, a, b);
        assert_eq!(dst, [0.0; 6], "{kernel}");
    }
}

#[test]
fn f32_operands_are_rounded_to_the_nearest_bf16() {
    let (m, n, k) = (9, 40, 37);
    let a = test_data(m * k, 4, 1.0);
    let b = test_data(k * n, 5, 1.0);
    let a32: Vec<f32> = a.iter().map(|&x| x as f32).collect();
    let b32: Vec<f32> = b.iter().map(|&x| x as f32).collect();
    let a16: Vec<bf16> = a32.iter().map(|&x| bf16::from_f32(x)).collect();
    let b16: Vec<bf16> = b32.iter().map(|&x| bf16::from_f32(x)).collect();
    for kernel in Bf16Kernel::available() {
        let mut x = vec![0f32; m * n];
        let mut y = vec![0f32; m * n];
        gemm(
            kernel,
            m,
            n,
            k,
            Dst::Set(&mut x),
            n,
            Mat::rows(&a32, k),
            Mat::rows(&b32, n),
        );
        gemm(
            kernel,
            m,
            n,
            k,
            Dst::Set(&mut y),
            n,
            Mat::rows(&a16, k),
            Mat::rows(&b16, n),
        );
        assert_eq!(x, y, "{kernel}");
    }
    // Ties go to even: 1 + 2⁻⁸ is halfway between 1 and 1 + 2⁻⁷.
    assert_eq!(1.0f32 + 1.0 / 256.0, f32::from_bits(0x3f80_8000));
    assert_eq!(ToBf16::bits(1.0f32 + 1.0 / 256.0), 0x3f80);
    assert_eq!(ToBf16::bits(1.0f32 + 3.0 / 256.0), 0x3f82);
}

#[test]
fn rounding_to_bf16_is_halfs() {
    let mut xs: Vec<f32> = vec![
        0.0,
        -0.0,
        1.0,
        1.0 + 1.0 / 256.0,
        1.0 + 3.0 / 256.0,
        f32::MAX,
        f32::MIN_POSITIVE,
        f32::MIN_POSITIVE / 3.0,
        f32::INFINITY,
        f32::NEG_INFINITY,
        f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::from_bits(0x7fff_ffff),
        f32::from_bits(0x7f7f_ffff),
    ];
    xs.extend(
        test_data(if cfg!(miri) { 100 } else { 100_000 }, 12, 1e3)
            .iter()
            .map(|&x| x as f32),
    );
    for &x in &xs {
        let want = bf16::from_f32(x);
        let got = bf16::from_bits(round_to_bf16(x));
        match x.is_nan() {
            true => assert!(got.is_nan(), "{x:?}"),
            false => assert_eq!(got.to_bits(), want.to_bits(), "{x:?} ({:#x})", x.to_bits()),
        }
    }
    // The vectorised passes round the same way: into a new vector, and in place too.
    let bits = |v: &[bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
    let halves = to_bf16_vec(&xs);
    let mut both = xs.clone();
    let halves_too = round_and_halve(&mut both);
    assert_eq!(bits(&halves_too), bits(&halves));
    let f32_bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(f32_bits(&both), f32_bits(&widen(&halves)));
}

#[test]
fn the_packed_b_block_is_the_vnni_layout() {
    // B[p][c] = 1000·p + c, k = 40, n = 35: two depth blocks, two panels.
    let (k, n) = (40, 35);
    let b: Vec<f32> = (0..k * n)
        .map(|i| (1000 * (i / n) + i % n) as f32)
        .collect();
    let b16: Vec<bf16> = b.iter().map(|&x| bf16::from_f32(x)).collect();
    let pb = pack_b(Mat::rows(&b16, n), k, n);
    assert_eq!((pb.kb, pb.data.len()), (2, 64 * 64));
    let at = |panel: usize, block: usize, half: usize, row: usize, col: usize, e: usize| {
        bf16::from_bits(
            pb.data[(panel * 2 + block) * B_BLOCK + half * 512 + row * 32 + col * 2 + e],
        )
    };
    // Read in place from the transpose: the same packing.
    let bt = transpose(&b16, k, n);
    assert_eq!(pack_b(Mat::rows(&bt, k).t(), k, n).data, pb.data);
    // Depths 34 and 35 (block 1, pair-row 1) of column 16 + 3 (panel 0, second tile).
    assert_eq!(at(0, 1, 1, 1, 3, 0), bf16::from_f32(34_019.0));
    assert_eq!(at(0, 1, 1, 1, 3, 1), bf16::from_f32(35_019.0));
    // Column 33 (panel 1, first tile, column 1), depth 0; depth 40 and beyond are zero.
    assert_eq!(at(1, 0, 0, 0, 1, 0), bf16::from_f32(33.0));
    assert_eq!(at(1, 1, 0, 4, 1, 0), bf16::ZERO);
    // Column 35 and beyond are zero.
    assert_eq!(at(1, 0, 0, 0, 3, 0), bf16::ZERO);
}

fn transpose<T: Copy>(x: &[T], rows: usize, cols: usize) -> Vec<T> {
    (0..cols * rows)
        .map(|i| x[(i % rows) * cols + i / rows])
        .collect()
}

#[test]
#[cfg_attr(miri, ignore = "candle's own matmul, the reference here, reads /sys")]
fn the_tensor_op_reads_any_strides_and_refuses_other_dtypes() -> candle_core::Result<()> {
    use candle_core::{DType, Device, Tensor};
    let dev = Device::Cpu;
    let x = Tensor::new(test_data(6 * 40, 6, 1.0).as_slice(), &dev)?
        .reshape((6, 40))?
        .to_dtype(DType::F32)?;
    // A weight stored [out, in], used transposed as in a linear layer.
    let w = Tensor::new(test_data(20 * 40, 7, 1.0).as_slice(), &dev)?
        .reshape((20, 40))?
        .to_dtype(DType::BF16)?;
    let want = x
        .to_dtype(DType::BF16)?
        .to_dtype(DType::F32)?
        .matmul(&w.to_dtype(DType::F32)?.t()?)?;
    for kernel in Bf16Kernel::available() {
        let got = matmul_bf16_with(&x, &w.t()?, kernel)?;
        let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "{kernel}: {diff}");
    }
    let e = matmul_bf16(&x.to_dtype(DType::F64)?, &w.t()?).unwrap_err();
    assert!(e.to_string().contains("bf16 or f32 CPU tensors"), "{e}");
    let e = matmul_bf16(&x, &w).unwrap_err();
    assert!(e.to_string().contains("inner dims differ"), "{e}");
    Ok(())
}

#[test]
fn this_cpu_offers_its_native_kernels() {
    let all = Bf16Kernel::available();
    eprintln!("bf16 kernels on this CPU: {all:?}");
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    if std::is_x86_feature_detected!("avx512bf16") && std::is_x86_feature_detected!("avx512f") {
        assert!(all.contains(&Bf16Kernel::Avx512Bf16));
    }
    assert_eq!(Bf16Kernel::best(), all[0]);
    assert_eq!(Bf16Kernel::best().is_native(), all.len() > 1);
}

/// `x` rounded to bf16 and back, as f64.
fn via_bf16(x: &[f64]) -> Vec<f64> {
    x.iter().map(|&v| bf16::from_f64(v).to_f64()).collect()
}

/// `Σ_p a[i][p]·b[j][p]` for row-major `a` `[m, k]` and `b` `[n, k]`.
fn abt(a: &[f64], b: &[f64], m: usize, n: usize, k: usize) -> Vec<f64> {
    (0..m * n)
        .map(|ij| (0..k).map(|p| a[ij / n * k + p] * b[ij % n * k + p]).sum())
        .collect()
}

fn close(what: &str, got: &[f64], want: &[f64], rel: f64, abs: f64) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g - w).abs() <= rel * w.abs() + abs,
            "{what}[{i}]: {g} against {w}"
        );
    }
}

#[test]
#[cfg_attr(miri, ignore = "candle's tensors read /sys")]
fn linear_bf16_is_the_bf16_product_of_the_rounded_operands_and_so_is_its_backward(
) -> candle_core::Result<()> {
    use candle_core::{DType, Device, Tensor, Var};
    let dev = Device::Cpu;
    let (rows, inf, outf) = (10, 40, 33);
    let xv = test_data(rows * inf, 8, 2.0);
    let wv = test_data(outf * inf, 9, 0.5);
    let bv = test_data(outf, 10, 0.5);
    let cv = test_data(rows * outf, 11, 1.0);
    let f32s = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
    let to64 = |t: &Tensor| -> candle_core::Result<Vec<f64>> {
        t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()
    };
    let w = Var::from_tensor(&Tensor::from_vec(f32s(&wv), (outf, inf), &dev)?)?;
    let b = Var::from_tensor(&Tensor::from_vec(f32s(&bv), outf, &dev)?)?;
    let c = Tensor::from_vec(f32s(&cv), (2, rows / 2, outf), &dev)?;
    // The reference: every operand as the op sees it (bf16), sums in f64.
    let (xr, wr) = (
        via_bf16(&f32s(&xv).iter().map(|&x| x as f64).collect::<Vec<_>>()),
        via_bf16(&wv),
    );
    let g = via_bf16(&cv);
    let y_ref: Vec<f64> = abt(&xr, &wr, rows, outf, inf)
        .iter()
        .enumerate()
        .map(|(i, y)| y + bv[i % outf] as f32 as f64)
        .collect();
    let gt: Vec<f64> = (0..outf * rows)
        .map(|i| g[(i % rows) * outf + i / rows])
        .collect();
    let xrt: Vec<f64> = (0..inf * rows)
        .map(|i| xr[(i % rows) * inf + i / rows])
        .collect();
    let dw_ref = abt(&gt, &xrt, outf, inf, rows);
    let wrt: Vec<f64> = (0..inf * outf)
        .map(|i| wr[(i % outf) * inf + i / outf])
        .collect();
    let dx_ref = abt(&g, &wrt, rows, inf, outf);
    let db_ref: Vec<f64> = (0..outf)
        .map(|j| (0..rows).map(|r| g[r * outf + j]).sum())
        .collect();
    for x_dtype in [DType::F32, DType::BF16] {
        for backend in [OpsBackend::Fused, OpsBackend::Composed] {
            let what = format!("{x_dtype:?} input, {backend:?}");
            let x = Var::from_tensor(
                &Tensor::from_vec(f32s(&xv), (2, rows / 2, inf), &dev)?.to_dtype(x_dtype)?,
            )?;
            let y = linear_bf16_on(x.as_tensor(), w.as_tensor(), Some(b.as_tensor()), backend)?;
            assert_eq!(
                (y.dtype(), y.dims()),
                (DType::BF16, &[2, rows / 2, outf][..])
            );
            // One rounding to bf16 of an f32 sum (the twin rounds the product first).
            close(
                &format!("{what}: y"),
                &to64(&y)?,
                &y_ref,
                2.0 * 2f64.powi(-8),
                1e-2,
            );
            let grads = (y.to_dtype(DType::F32)? * &c)?.sum_all()?.backward()?;
            let (dx, dw, db) = (
                grads.get(x.as_tensor()).expect("dx"),
                grads.get(w.as_tensor()).expect("dw"),
                grads.get(b.as_tensor()).expect("db"),
            );
            assert_eq!(
                (dx.dtype(), dw.dtype(), db.dtype()),
                (x_dtype, DType::F32, DType::F32)
            );
            if backend == OpsBackend::Composed {
                // candle's bf16 matmul rounds its results to bf16.
                close(
                    &format!("{what}: dW"),
                    &to64(dw)?,
                    &dw_ref,
                    2f64.powi(-7),
                    1e-2,
                );
                continue;
            }
            // f32 sums of exact products: f32 roundings only, but for dX in bf16.
            let dx_rel = if x_dtype == DType::BF16 {
                2f64.powi(-8)
            } else {
                1e-5
            };
            close(&format!("{what}: dX"), &to64(dx)?, &dx_ref, dx_rel, 1e-5);
            close(&format!("{what}: dW"), &to64(dw)?, &dw_ref, 1e-5, 1e-5);
            close(&format!("{what}: db"), &to64(db)?, &db_ref, 1e-6, 1e-6);
        }
    }
    // A broadcast gradient (of a plain sum) is read in place: every dW row is Σ_rows X.
    let x = Var::from_tensor(&Tensor::from_vec(f32s(&xv), (2, rows / 2, inf), &dev)?)?;
    let y = linear_bf16(x.as_tensor(), w.as_tensor(), None)?;
    let grads = y.sum_all()?.backward()?;
    let dw = to64(grads.get(w.as_tensor()).expect("dw"))?;
    let col: Vec<f64> = (0..inf)
        .map(|i| (0..rows).map(|r| xr[r * inf + i]).sum())
        .collect();
    let want: Vec<f64> = (0..outf * inf).map(|i| col[i % inf]).collect();
    close("dW of a sum", &dw, &want, 1e-5, 1e-5);
    let e = linear_bf16(
        &Tensor::zeros((2, inf), DType::F64, &dev)?,
        w.as_tensor(),
        None,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("a bf16 or f32 input and an f32 weight"),
        "{e}"
    );
    Ok(())
}
