//! Cross-entropy, whole and vocabulary-parallel, against plain-Rust reference math
//! (hand-derived gradients), in f64 and f32: values, gradients, stability, padding and
//! refusals.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use common::{assert_close, check, input, tensor, to_f64, Rng};
use switchyard_ops::{cross_entropy, cross_entropy_parallel, Reduce};

// ---------------------------------------------------------------- cross-entropy

const TARGETS: [u32; 4] = [3, 0, 6, 3];

fn ce_ref(z: &[f64], v: usize) -> f64 {
    let n = z.len() / v;
    z.chunks(v)
        .zip(TARGETS)
        .map(|(row, t)| {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            lse - row[t as usize]
        })
        .sum::<f64>()
        / n as f64
}

/// Hand-derived: dL/dz = (softmax(z) − onehot(t)) / N.
fn ce_grad(z: &[f64], v: usize) -> Vec<f64> {
    let n = z.len() / v;
    z.chunks(v)
        .zip(TARGETS)
        .flat_map(|(row, t)| {
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = row.iter().map(|x| (x - max).exp()).sum();
            row.iter()
                .enumerate()
                .map(|(j, x)| ((x - max).exp() / z - f64::from(j == t as usize)) / n as f64)
                .collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn cross_entropy_matches_reference() {
    let v = 7;
    let targets = Tensor::new(&TARGETS, &Device::Cpu).unwrap();
    let inputs = [input("logits", &[4, v], 14, 3.0)];
    check(
        "cross_entropy",
        &inputs,
        &|x| cross_entropy(&x[0], &targets),
        &|x| vec![ce_ref(&x[0], v)],
        Some(&|x, g| vec![ce_grad(&x[0], v).iter().map(|d| d * g[0]).collect()]),
    );
}

#[test]
fn cross_entropy_is_stable_for_huge_logits() {
    let v = 7;
    let z: Vec<f64> = Rng::new(15)
        .vec(4 * v, 1.0)
        .iter()
        .map(|x| x * 1e4)
        .collect();
    let logits = Var::from_tensor(&tensor(&z, &[4, v], DType::F32)).unwrap();
    let targets = Tensor::new(&TARGETS, &Device::Cpu).unwrap();
    let loss = cross_entropy(logits.as_tensor(), &targets).unwrap();
    assert_close("huge-logit loss", &to_f64(&loss), &[ce_ref(&z, v)], 1e-5);
    let g = to_f64(loss.backward().unwrap().get(logits.as_tensor()).unwrap());
    assert_close("huge-logit grad", &g, &ce_grad(&z, v), 1e-5);
}

#[test]
fn cross_entropy_rejects_bad_targets() {
    let dev = Device::Cpu;
    let logits = Tensor::zeros((2, 5), DType::F32, &dev).unwrap();
    let err = cross_entropy(&logits, &Tensor::new(&[1u32, 5], &dev).unwrap())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("target 5 of row 1") && err.contains("5 classes"),
        "{err}"
    );
    let err = cross_entropy(&logits, &Tensor::new(&[1i64, 2], &dev).unwrap())
        .unwrap_err()
        .to_string();
    assert!(err.contains("u32"), "{err}");
}

// ---------------------------------------------------------------- all together

#[test]
fn cross_entropy_wide_rows() {
    let v = 37;
    let targets = Tensor::new(&TARGETS, &Device::Cpu).unwrap();
    let inputs = [input("logits", &[4, v], 30, 3.0)];
    check(
        "cross_entropy V=37",
        &inputs,
        &|x| cross_entropy(&x[0], &targets),
        &|x| vec![ce_ref(&x[0], v)],
        Some(&|x, g| vec![ce_grad(&x[0], v).iter().map(|d| d * g[0]).collect()]),
    );
}

/// Rank 0 of 2 holds classes 0..4 of 7; the hooks add the other rank's contribution,
/// computed here from the reference math, as an all-reduce would.
#[test]
fn vocabulary_parallel_cross_entropy_gives_the_slice_of_the_full_gradient() {
    let (v, local) = (7, 4);
    let full = Rng::new(31).vec(4 * v, 3.0);
    let other: Vec<Vec<f64>> = full.chunks(v).map(|r| r[local..].to_vec()).collect();
    let mine: Vec<f64> = full.chunks(v).flat_map(|r| r[..local].to_vec()).collect();
    let other_max = Arc::new(
        other
            .iter()
            .map(|r| r.iter().cloned().fold(f64::MIN, f64::max))
            .collect::<Vec<_>>(),
    );
    let om = other_max.clone();
    let reduce_max: Reduce = Arc::new(move |t: &Tensor| {
        let m: Vec<f64> = to_f64(t)
            .iter()
            .zip(om.iter())
            .map(|(a, b)| a.max(*b))
            .collect();
        Ok(tensor(&m, t.dims(), t.dtype()))
    });
    // The sum hook needs the global max of each row: the larger of both slices' maxima.
    let global_max: Vec<f64> = full
        .chunks(v)
        .map(|r| r.iter().cloned().fold(f64::MIN, f64::max))
        .collect();
    let reduce_sum: Reduce = Arc::new(move |t: &Tensor| {
        let mut s = to_f64(t);
        for (r, pair) in s.chunks_mut(2).enumerate() {
            pair[0] += other[r]
                .iter()
                .map(|z| (z - global_max[r]).exp())
                .sum::<f64>();
            let tg = TARGETS[r] as usize;
            if tg >= local {
                pair[1] += other[r][tg - local] - global_max[r];
            }
        }
        Ok(tensor(&s, t.dims(), t.dtype()))
    });
    let targets = Tensor::new(&TARGETS, &Device::Cpu).unwrap();
    let z = Var::from_tensor(&tensor(&mine, &[4, local], DType::F64)).unwrap();
    let loss =
        cross_entropy_parallel(z.as_tensor(), &targets, 0, v, reduce_max, reduce_sum).unwrap();
    assert_close("parallel loss", &to_f64(&loss), &[ce_ref(&full, v)], 1e-12);
    let g = to_f64(loss.backward().unwrap().get(z.as_tensor()).unwrap());
    let want: Vec<f64> = ce_grad(&full, v)
        .chunks(v)
        .flat_map(|r| r[..local].to_vec())
        .collect();
    assert_close("parallel grad", &g, &want, 1e-12);
}

/// Rank 1 of 2 over 7 classes padded to 8: it holds classes 4..7 and one padding column
/// (class 7), whose huge logit must count as −∞: the loss and the gradient of the real
/// columns are those of the 7 classes, and the padding column's gradient is 0.
#[test]
fn padding_columns_of_a_vocabulary_parallel_slice_are_left_out() {
    let (v, w, start) = (7, 4, 4);
    let full = Rng::new(37).vec(4 * v, 3.0);
    let other: Vec<Vec<f64>> = full.chunks(v).map(|r| r[..start].to_vec()).collect();
    let mine: Vec<f64> = full
        .chunks(v)
        .flat_map(|r| {
            let mut row = r[start..].to_vec();
            row.push(100.0); // padding
            row
        })
        .collect();
    let global_max: Vec<f64> = full
        .chunks(v)
        .map(|r| r.iter().cloned().fold(f64::MIN, f64::max))
        .collect();
    let om: Vec<f64> = other
        .iter()
        .map(|r| r.iter().cloned().fold(f64::MIN, f64::max))
        .collect();
    let reduce_max: Reduce = Arc::new(move |t: &Tensor| {
        let m: Vec<f64> = to_f64(t).iter().zip(&om).map(|(a, b)| a.max(*b)).collect();
        Ok(tensor(&m, t.dims(), t.dtype()))
    });
    let reduce_sum: Reduce = Arc::new(move |t: &Tensor| {
        let mut s = to_f64(t);
        for (r, pair) in s.chunks_mut(2).enumerate() {
            pair[0] += other[r]
                .iter()
                .map(|z| (z - global_max[r]).exp())
                .sum::<f64>();
            let tg = TARGETS[r] as usize;
            if tg < start {
                pair[1] += other[r][tg] - global_max[r];
            }
        }
        Ok(tensor(&s, t.dims(), t.dtype()))
    });
    let targets = Tensor::new(&TARGETS, &Device::Cpu).unwrap();
    for dtype in [DType::F64, DType::F32] {
        let z = Var::from_tensor(&tensor(&mine, &[4, w], dtype)).unwrap();
        let loss = cross_entropy_parallel(
            z.as_tensor(),
            &targets,
            start,
            v,
            reduce_max.clone(),
            reduce_sum.clone(),
        )
        .unwrap();
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-5 };
        assert_close("padded loss", &to_f64(&loss), &[ce_ref(&full, v)], tol);
        let g = to_f64(loss.backward().unwrap().get(z.as_tensor()).unwrap());
        let want: Vec<f64> = ce_grad(&full, v)
            .chunks(v)
            .flat_map(|r| {
                let mut row = r[start..].to_vec();
                row.push(0.0);
                row
            })
            .collect();
        assert_close("padded grad", &g, &want, tol);
        for r in 0..4 {
            assert_eq!(g[r * w + 3], 0.0, "padding gradient of row {r}");
        }
    }
    let bad = Tensor::new(&[3u32, 0, 7, 3], &Device::Cpu).unwrap();
    let err = cross_entropy_parallel(
        &tensor(&mine, &[4, w], DType::F64),
        &bad,
        start,
        v,
        reduce_max,
        reduce_sum,
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("target 7 of row 2 is out of range for 7 classes"),
        "{err}"
    );
}
