//! bf16 activations: every fused op (LayerNorm, cross-entropy, linear, linear + GELU,
//! MLP, attention block) takes a bf16 input with f32 parameters, computes in f32, and
//! gives a bf16 output (the cross-entropy an f32 loss) and a bf16 input gradient.
//!
//! Each is checked against the same op on an f32 tensor holding the same (bf16)
//! values at the same precision: the output is that op's output rounded to bf16, the
//! input gradient (from the same bf16 output gradient) that op's input gradient rounded
//! to bf16, and the parameters' gradients are equal, all bit for bit: the bf16 path
//! reads and writes bf16 and changes nothing in between. So they are within bf16's
//! tolerance of the f32 ops by construction, which the test checks as well.

mod common;

use std::sync::Arc;

use candle_core::{DType, Tensor, Var};
use common::{assert_close, tensor, to_f64, Rng};
use switchyard_ops::{
    attention_block_with, cross_entropy, cross_entropy_parallel, layer_norm, linear_with, mlp_with,
    LinearOptions, PairOptions, PairWeights, Precision, Reduce,
};

/// `v` rounded to bf16 values (ties to even), as f64.
fn round(v: &[f64]) -> Vec<f64> {
    v.iter()
        .map(|&x| half::bf16::from_f32(x as f32).to_f64())
        .collect()
}

type Op = dyn Fn(&[Tensor]) -> Tensor;

/// The output (as f64) and the gradients of `Σ y ⊙ r` for every input, with the first
/// input of `dtype` and the others f32; `r` is bf16-valued, so a bf16 output and an
/// f32 one receive the same gradient.
fn run(vals: &[Vec<f64>], shapes: &[&[usize]], f: &Op, dtype: DType) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = vals
        .iter()
        .zip(shapes)
        .enumerate()
        .map(|(i, (v, s))| {
            let dt = if i == 0 { dtype } else { DType::F32 };
            Var::from_tensor(&tensor(v, s, dt)).unwrap()
        })
        .collect();
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let y = f(&ts);
    let r = round(&Rng::new(99).vec(y.elem_count(), 1.0));
    let r = tensor(&r, y.dims(), DType::F32);
    let loss = (y.to_dtype(DType::F32).unwrap() * r)
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    let g = vars
        .iter()
        .map(|v| grads.get(v.as_tensor()).expect("a gradient").clone())
        .collect();
    (y, g)
}

/// The bf16 path of `f` against its f32 path on the same values (see the module doc);
/// `out` is the dtype the bf16 path's output must have.
fn check(what: &str, shapes: &[&[usize]], f: &Op, out: DType) {
    let vals: Vec<Vec<f64>> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let v = Rng::new(60 + i as u64).vec(s.iter().product(), 1.0);
            if i == 0 {
                round(&v)
            } else {
                v
            }
        })
        .collect();
    let (yh, gh) = run(&vals, shapes, f, DType::BF16);
    let (yf, gf) = run(&vals, shapes, f, DType::F32);
    assert_eq!(yh.dtype(), out, "{what}: the output's dtype");
    assert_eq!(
        gh[0].dtype(),
        DType::BF16,
        "{what}: the input gradient's dtype"
    );
    let rounded = |t: &Tensor| round(&to_f64(t));
    let want = match out {
        DType::BF16 => rounded(&yf),
        _ => to_f64(&yf),
    };
    assert_eq!(to_f64(&yh), want, "{what}: output ≠ the f32 op's, rounded");
    assert_eq!(to_f64(&gh[0]), rounded(&gf[0]), "{what}: input gradient");
    for (i, (a, b)) in gh.iter().zip(&gf).enumerate().skip(1) {
        assert_eq!(
            a.dtype(),
            DType::F32,
            "{what}: parameter {i}'s gradient is f32"
        );
        assert_eq!(to_f64(a), to_f64(b), "{what}: gradient of parameter {i}");
    }
    // Within bf16's tolerance of the f32 op, in the max norm.
    assert_close(&format!("{what}: output"), &to_f64(&yh), &to_f64(&yf), 8e-3);
    assert_close(
        &format!("{what}: dx"),
        &to_f64(&gh[0]),
        &to_f64(&gf[0]),
        8e-3,
    );
}

#[test]
fn layer_norm_takes_bf16_activations() {
    let shapes: [&[usize]; 3] = [&[3, 7, 40], &[40], &[40]];
    let ln = |t: &[Tensor]| layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap();
    check("layer norm", &shapes, &ln, DType::BF16);
}

#[test]
fn linear_and_pairs_take_bf16_activations() {
    let (n, i, o) = (37, 70, 45);
    for gelu in [false, true] {
        let lin = move |t: &[Tensor]| {
            let opts = LinearOptions {
                gelu,
                precision: Precision::Bf16,
                ..LinearOptions::default()
            };
            linear_with(&t[0], &t[1], Some(&t[2]), &opts).unwrap()
        };
        let what = if gelu { "linear + gelu" } else { "linear" };
        check(what, &[&[n, i], &[o, i], &[o]], &lin, DType::BF16);
    }
    let (bsz, t, d, hidden, heads) = (2, 9, 24, 40, 3);
    let opts = PairOptions {
        precision: Precision::Bf16,
        ..PairOptions::default()
    };
    let o2 = opts.clone();
    let mlp = move |ts: &[Tensor]| {
        let w = PairWeights::new(&ts[1], Some(&ts[2]), &ts[3], Some(&ts[4])).unwrap();
        mlp_with(&ts[0], &w, &o2).unwrap()
    };
    let shapes: [&[usize]; 5] = [&[bsz, t, d], &[hidden, d], &[hidden], &[d, hidden], &[d]];
    check("mlp", &shapes, &mlp, DType::BF16);
    let attn = move |ts: &[Tensor]| {
        let w = PairWeights::new(&ts[1], Some(&ts[2]), &ts[3], Some(&ts[4])).unwrap();
        attention_block_with(&ts[0], &w, heads, &opts).unwrap()
    };
    let shapes: [&[usize]; 5] = [&[bsz, t, d], &[3 * d, d], &[3 * d], &[d, d], &[d]];
    check("attention block", &shapes, &attn, DType::BF16);
}

#[test]
fn cross_entropy_takes_bf16_logits() {
    let (n, v) = (23, 37);
    let targets: Vec<u32> = (0..n).map(|r| (r * 7 % v) as u32).collect();
    let tg = Tensor::new(targets.as_slice(), &candle_core::Device::Cpu).unwrap();
    let t2 = tg.clone();
    let ce = move |t: &[Tensor]| cross_entropy(&t[0], &t2).unwrap();
    check("cross-entropy", &[&[n, v]], &ce, DType::F32);
    // A vocabulary-parallel slice that ends in padding (columns 30.. of 37: a
    // vocabulary of 30 classes).
    let in_range: Vec<u32> = targets.iter().map(|&c| c % 30).collect();
    let tg = Tensor::new(in_range.as_slice(), &candle_core::Device::Cpu).unwrap();
    let id: Reduce = Arc::new(|t: &Tensor| Ok(t.clone()));
    let par = move |t: &[Tensor]| {
        cross_entropy_parallel(&t[0], &tg, 0, 30, id.clone(), id.clone()).unwrap()
    };
    check("cross-entropy, padded slice", &[&[n, v]], &par, DType::F32);
}
