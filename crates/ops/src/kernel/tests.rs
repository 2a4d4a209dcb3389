//! The products, the buffers and the fast math of the kernel module against plain loops.

use super::*;

#[test]
fn fast_exp_and_tanh_are_accurate() {
    let mut worst_exp = 0.0f64;
    let mut worst_tanh = 0.0f64;
    // Coarser under Miri (an interpreter), which runs these tests too.
    let coarse = if cfg!(miri) { 100.0 } else { 1.0 };
    let mut x = -87.0f32;
    while x < 88.0 {
        let e = (exp_f32(x) as f64 - (x as f64).exp()).abs() / (x as f64).exp();
        worst_exp = worst_exp.max(e);
        x += 0.0137 * coarse;
    }
    let mut x = -12.0f32;
    while x < 12.0 {
        let e = (tanh_f32(x) as f64 - (x as f64).tanh()).abs();
        worst_tanh = worst_tanh.max(e);
        x += 0.00113 * coarse;
    }
    assert!(worst_exp < 4e-7, "exp relative error {worst_exp:e}");
    assert!(worst_tanh < 2e-7, "tanh absolute error {worst_tanh:e}");
    let tiny = exp_f32(-1000.0);
    assert!(tiny > 0.0 && tiny < 1.2e-38, "{tiny:e}");
    assert!(exp_f32(88.7).is_finite());
}

#[test]
fn reductions_match_plain_loops() {
    let v: Vec<f64> = (0..37).map(|i| (i as f64 * 0.7).sin()).collect();
    let w: Vec<f64> = (0..37).map(|i| (i as f64 * 0.3).cos()).collect();
    assert!((sum(&v) - v.iter().sum::<f64>()).abs() < 1e-12);
    let d: f64 = v.iter().zip(&w).map(|(a, b)| a * b).sum();
    assert!((dot(&v, &w) - d).abs() < 1e-12);
    assert_eq!(max(&v), v.iter().cloned().fold(f64::NEG_INFINITY, f64::max));
}

#[test]
fn uninit_buffers_become_the_written_vectors() {
    let mut u = Uninit::<f32>::new(5).unwrap();
    assert_eq!(u.as_mut().len(), 5);
    for (i, v) in u.as_mut().iter_mut().enumerate() {
        v.write(i as f32);
    }
    // SAFETY: all five elements were written.
    assert_eq!(unsafe { u.assume_init() }, [0.0, 1.0, 2.0, 3.0, 4.0]);
    // Through the raw pointer, as parallel tasks write.
    let mut u = Uninit::<f64>::new(3).unwrap();
    let p = SharedMut(u.as_mut_ptr());
    for i in 0..3 {
        // SAFETY: i < 3, the buffer's length.
        unsafe { p.ptr().add(i).write(-(i as f64)) };
    }
    // SAFETY: all three were written.
    assert_eq!(unsafe { u.assume_init() }, [0.0, -1.0, -2.0]);
    // SAFETY: nothing to write.
    assert!(unsafe { Uninit::<f32>::new(0).unwrap().assume_init() }.is_empty());
    let err = Uninit::<f64>::new(usize::MAX / 4).err().expect("too large");
    assert!(err.to_string().contains("cannot allocate"), "{err}");
}

/// `c = (init or 0) + a·b` in f64 with `c` of row stride `ld`.
fn naive(
    m: usize,
    n: usize,
    k: usize,
    a: Mat<f64>,
    b: Mat<f64>,
    init: Option<&[f64]>,
    ld: usize,
) -> Vec<f64> {
    let mut c = init.map_or(vec![0.0; (m - 1) * ld + n], |c| c.to_vec());
    for i in 0..m {
        for j in 0..n {
            let base = if init.is_some() { c[i * ld + j] } else { 0.0 };
            c[i * ld + j] = base
                + (0..k)
                    .map(|p| a.data[i * a.rs + p * a.cs] * b.data[p * b.rs + j * b.cs])
                    .sum::<f64>();
        }
    }
    c
}

/// The portable products (the `gemm` crate) on every destination kind, transposed
/// and strided operands, a destination row stride above `n`, and `k = 0`.
#[test]
fn portable_matmul_matches_the_naive_product() {
    for (m, n, k) in [(1, 1, 1), (3, 5, 4), (7, 2, 9), (4, 4, 0), (2, 17, 3)] {
        for (ta, tb) in [(false, false), (true, false), (false, true), (true, true)] {
            let av = test_data(m * k + 3, 1, 1.0);
            let bv = test_data(k * n + 3, 2, 1.0);
            let a = if ta {
                Mat::rows(&av, m).t()
            } else {
                Mat::rows(&av, k)
            };
            let b = if tb {
                Mat::rows(&bv, k).t()
            } else {
                Mat::rows(&bv, n)
            };
            let ld = n + 2;
            let len = (m - 1) * ld + n;
            let init = test_data(len, 3, 1.0);
            let what = format!("{m}×{n}×{k} ta {ta} tb {tb}");
            let check = |got: &[f64], want: &[f64], written_only: bool| {
                for (i, (g, w)) in got.iter().zip(want).enumerate() {
                    if written_only && i % ld >= n {
                        continue;
                    }
                    assert!((g - w).abs() < 1e-12, "{what}: [{i}] {g} vs {w}");
                }
            };
            portable_only(|| {
                let mut c = init.clone();
                matmul(m, n, k, Dst::Add(&mut c), ld, a, b, false);
                check(&c, &naive(m, n, k, a, b, Some(&init), ld), false);
                let mut c = init.clone();
                matmul(m, n, k, Dst::Set(&mut c), ld, a, b, false);
                let want = naive(m, n, k, a, b, None, ld);
                check(&c, &want, true);
                // Between the rows, `Set` leaves the destination alone.
                for i in (0..len).filter(|i| i % ld >= n) {
                    assert_eq!(c[i], init[i], "{what}: wrote past n");
                }
                let mut u = Uninit::<f64>::new(len + ld - n).unwrap();
                // Fill the gaps between rows, which the product does not write.
                for (i, v) in u.as_mut().iter_mut().enumerate() {
                    if i % ld >= n {
                        v.write(0.0);
                    }
                }
                matmul(m, n, k, Dst::Uninit(u.as_mut()), ld, a, b, false);
                // SAFETY: the product wrote columns 0..n of every row, the loop the rest.
                let c = unsafe { u.assume_init() };
                check(&c[..len], &want, true);
            });
        }
    }
}

#[test]
#[should_panic(expected = "destination out of bounds")]
fn matmul_refuses_a_short_destination() {
    let a = [1.0f64; 4];
    let mut c = [0.0f64; 3];
    matmul(
        2,
        2,
        2,
        Dst::Set(&mut c),
        2,
        Mat::rows(&a, 2),
        Mat::rows(&a, 2),
        false,
    );
}

/// A test's ceiling reaches a task on another thread that inherits it, and only that
/// task: the thread's own ceiling is put back after it, also when it panics.
#[test]
fn a_ceiling_reaches_the_tasks_that_inherit_it() {
    let (best, best_avx2) = (avx512(), avx2());
    let (inherited, plain) = at_most_avx2(|| {
        let ceiling = Inherited::here();
        std::thread::scope(|s| {
            let inherited = s.spawn(move || ceiling.run(|| (avx512(), avx2())));
            let plain = s.spawn(avx512);
            (inherited.join().unwrap(), plain.join().unwrap())
        })
    });
    assert_eq!(
        inherited,
        (false, best_avx2),
        "under the inherited AVX2 ceiling"
    );
    assert_eq!(
        plain, best,
        "a thread that inherits nothing runs the best build"
    );
    let portable = portable_only(Inherited::here);
    let panicked = std::panic::catch_unwind(|| {
        portable.run(|| panic!("a deliberate panic, after which the ceiling must be put back"))
    });
    assert!(panicked.is_err());
    assert_eq!(
        (avx512(), avx2()),
        (best, best_avx2),
        "the ceiling is put back"
    );
}
