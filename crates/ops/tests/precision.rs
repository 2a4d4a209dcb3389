//! `Precision::Bf16` on every fused op with products (linear, linear + GELU, MLP,
//! attention block), forward and backward:
//!
//! * the forward against plain f64 math on the bf16-rounded operands (what the products
//!   multiply), which a wrong rounding point or a forgotten operand would break;
//! * the linear's backward against f64 math on the rounded operands and the rounded
//!   output gradient (`dX`, `dW`), which f32 products in the backward would break;
//! * value and gradients against the composed twin at bf16 (`OpsBackend::Composed`,
//!   which rounds at the same points), and against the f32 op within bf16's
//!   tolerance, and visibly different from f32 (the precision is applied);
//! * a clear error for a dtype other than f32.

mod common;

use candle_core::{DType, Tensor, Var};
use common::{assert_close, max_abs, tensor, to_f64, Rng};
use switchyard_ops::{
    attention_block_with, linear_with, mlp_with, LinearOptions, OpsBackend, PairOptions,
    PairWeights, Precision,
};

/// `v` rounded to the nearest bf16 (ties to even), as f64.
fn round(v: &[f64]) -> Vec<f64> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x as f32).to_f64())
        .collect()
}

/// `x · wᵀ + b` in f64, `x` `[n, i]`, `w` `[o, i]`.
fn affine(x: &[f64], w: &[f64], b: &[f64], i: usize) -> Vec<f64> {
    let o = b.len();
    x.chunks(i)
        .flat_map(|row| {
            (0..o).map(move |j| b[j] + (0..i).map(|p| row[p] * w[j * i + p]).sum::<f64>())
        })
        .collect()
}

fn gelu(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// Fused against composed bf16 gradients: the twin rounds at the same points, forward
/// and backward (1e-4: f32 sums in another order); the attention's backward reads its
/// bf16-kept output where the twin's reads the f32 one, and its scores are summed in
/// another order (5e-3).
const TWIN_GRAD_TOL: f64 = 1e-4;
const ATTENTION_TWIN_GRAD_TOL: f64 = 5e-3;

type Op = dyn Fn(OpsBackend, Precision, &[Tensor]) -> Tensor;

/// The value and the gradients of `Σ y ⊙ r` for every input, at a backend and precision.
fn run(
    vals: &[Vec<f64>],
    shapes: &[&[usize]],
    f: &Op,
    b: OpsBackend,
    p: Precision,
) -> Vec<Vec<f64>> {
    let vars: Vec<Var> = vals
        .iter()
        .zip(shapes)
        .map(|(v, s)| Var::from_tensor(&tensor(v, s, DType::F32)).unwrap())
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(b, p, &ts);
    assert_eq!(y.dtype(), DType::F32, "the op's output stays f32");
    let r = tensor(&Rng::new(99).vec(y.elem_count(), 1.0), y.dims(), DType::F32);
    let grads = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![to_f64(&y)];
    for v in &vars {
        out.push(to_f64(grads.get(v.as_tensor()).expect("a gradient")));
    }
    out
}

/// Fused bf16 against the composed twin at bf16 and against fused f32, value and every
/// gradient (relative to the largest element, in the max norm), and fused bf16 ≠ f32.
fn check(what: &str, shapes: &[&[usize]], f: &Op, grad_tol: f64) -> Vec<Vec<f64>> {
    let vals: Vec<Vec<f64>> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| Rng::new(40 + i as u64).vec(s.iter().product(), 1.0))
        .collect();
    let bf = run(&vals, shapes, f, OpsBackend::Fused, Precision::Bf16);
    let twin = run(&vals, shapes, f, OpsBackend::Composed, Precision::Bf16);
    let full = run(&vals, shapes, f, OpsBackend::Fused, Precision::F32);
    for (i, ((a, t), w)) in bf.iter().zip(&twin).zip(&full).enumerate() {
        let at = match i {
            0 => format!("{what}: value"),
            _ => format!("{what}: gradient of input {}", i - 1),
        };
        let twin_tol = if i == 0 { 1e-5 } else { grad_tol };
        assert_close(&format!("{at}, fused vs composed bf16"), a, t, twin_tol);
        assert_close(&format!("{at}, bf16 vs f32"), a, w, 3e-2);
        // The value differs from f32 (the precision is applied); so may every gradient
        // but the last bias's, `Σ_rows G`, which no product touches.
        let diff = a
            .iter()
            .zip(w)
            .fold(0.0f64, |m, (x, y)| m.max((x - y).abs()));
        if i == 0 {
            assert!(
                diff > 1e-6 * max_abs(w),
                "{at}: bf16 equals f32: precision not applied"
            );
        }
    }
    bf
}

#[test]
fn linear_forward_is_the_product_of_the_rounded_operands() {
    let (n, i, o) = (37, 70, 45);
    let shapes: [&[usize]; 3] = [&[n, i], &[o, i], &[o]];
    let lin = |gelu: bool| {
        move |b: OpsBackend, p: Precision, t: &[Tensor]| {
            let opts = LinearOptions {
                gelu,
                backend: b,
                precision: p,
                ..LinearOptions::default()
            };
            linear_with(&t[0], &t[1], Some(&t[2]), &opts).unwrap()
        }
    };
    let y = check("linear bf16", &shapes, &lin(false), TWIN_GRAD_TOL);
    let yg = check("linear + gelu bf16", &shapes, &lin(true), TWIN_GRAD_TOL);
    let (x, w, b) = (
        Rng::new(40).vec(n * i, 1.0),
        Rng::new(41).vec(o * i, 1.0),
        Rng::new(42).vec(o, 1.0),
    );
    let want = affine(&round(&x), &round(&w), &b, i);
    assert_close("linear bf16 vs f64 on rounded operands", &y[0], &want, 1e-6);
    // The backward's products read the output gradient `G` (here `r` of `Σ y ⊙ r`)
    // rounded too: dX = round(G)·round(W), dW = round(G)ᵀ·round(X), db = Σ_rows G.
    let g = Rng::new(99).vec(n * o, 1.0);
    let g = g.iter().map(|&v| v as f32 as f64).collect::<Vec<_>>();
    let (gr, wr, xr) = (round(&g), round(&w), round(&x));
    let dx: Vec<f64> = (0..n * i)
        .map(|e| {
            (0..o)
                .map(|j| gr[(e / i) * o + j] * wr[j * i + e % i])
                .sum()
        })
        .collect();
    let dw: Vec<f64> = (0..o * i)
        .map(|e| (0..n).map(|r| gr[r * o + e / i] * xr[r * i + e % i]).sum())
        .collect();
    let db: Vec<f64> = (0..o).map(|j| (0..n).map(|r| g[r * o + j]).sum()).collect();
    assert_close(
        "linear bf16 dX vs f64 on rounded operands",
        &y[1],
        &dx,
        1e-6,
    );
    assert_close(
        "linear bf16 dW vs f64 on rounded operands",
        &y[2],
        &dw,
        1e-6,
    );
    assert_close("linear bf16 db vs f64", &y[3], &db, 1e-6);
    // GELU runs on the pre-activation rounded to bf16.
    let want: Vec<f64> = round(&want).into_iter().map(gelu).collect();
    assert_close("linear + gelu bf16 vs f64", &yg[0], &want, 1e-5);
}

#[test]
fn mlp_and_attention_block_at_bf16() {
    let (bsz, t, d, hidden, heads) = (2, 9, 24, 40, 3);
    let shapes: [&[usize]; 5] = [&[bsz, t, d], &[hidden, d], &[hidden], &[d, hidden], &[d]];
    let mlp = |b: OpsBackend, p: Precision, ts: &[Tensor]| {
        let w = PairWeights::new(&ts[1], Some(&ts[2]), &ts[3], Some(&ts[4])).unwrap();
        let opts = PairOptions {
            backend: b,
            precision: p,
            ..PairOptions::default()
        };
        mlp_with(&ts[0], &w, &opts).unwrap()
    };
    let got = check("mlp bf16", &shapes, &mlp, TWIN_GRAD_TOL);
    // Forward: y = round(gelu(round(x·w1ᵀ + b1)))·round(w2)ᵀ + b2, in f64.
    let v: Vec<Vec<f64>> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| Rng::new(40 + i as u64).vec(s.iter().product(), 1.0))
        .collect();
    let pre = round(&affine(&round(&v[0]), &round(&v[1]), &v[2], d));
    let h: Vec<f64> = pre.into_iter().map(gelu).collect();
    let want = affine(&round(&h), &round(&v[3]), &v[4], hidden);
    // h is rounded from f32 GELU here and f64 GELU there: a tie may round either way.
    assert_close("mlp bf16 vs f64 on rounded operands", &got[0], &want, 1e-3);
    let recompute = |b: OpsBackend, p: Precision, ts: &[Tensor]| {
        let w = PairWeights::new(&ts[1], Some(&ts[2]), &ts[3], Some(&ts[4])).unwrap();
        let opts = PairOptions {
            backend: b,
            precision: p,
            recompute_gelu: true,
            ..PairOptions::default()
        };
        mlp_with(&ts[0], &w, &opts).unwrap()
    };
    let again = check(
        "mlp bf16, GELU recomputed",
        &shapes,
        &recompute,
        TWIN_GRAD_TOL,
    );
    for (i, (a, b)) in again.iter().zip(&got).enumerate() {
        assert_eq!(a, b, "recomputing GELU at bf16 changes output/gradient {i}");
    }
    let attn_shapes: [&[usize]; 5] = [&[bsz, t, d], &[3 * d, d], &[3 * d], &[d, d], &[d]];
    let attn = move |b: OpsBackend, p: Precision, ts: &[Tensor]| {
        let w = PairWeights::new(&ts[1], Some(&ts[2]), &ts[3], Some(&ts[4])).unwrap();
        let opts = PairOptions {
            backend: b,
            precision: p,
            ..PairOptions::default()
        };
        attention_block_with(&ts[0], &w, heads, &opts).unwrap()
    };
    check(
        "attention block bf16",
        &attn_shapes,
        &attn,
        ATTENTION_TWIN_GRAD_TOL,
    );
}

#[test]
fn bf16_precision_refuses_other_dtypes() {
    let x = Tensor::zeros((2, 3), DType::F64, &candle_core::Device::Cpu).unwrap();
    let w = Tensor::zeros((4, 3), DType::F64, &candle_core::Device::Cpu).unwrap();
    let opts = LinearOptions {
        precision: Precision::Bf16,
        ..LinearOptions::default()
    };
    let e = linear_with(&x, &w, None, &opts).unwrap_err().to_string();
    assert!(
        e.contains("linear") && e.contains("bf16") && e.contains("F64"),
        "{e}"
    );
}
