//! Values and gradients of every op against plain-Rust reference math (finite
//! differences and hand-derived gradients), in f64 and f32.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use common::{assert_close, check, input, tensor, to_f64, Rng};
use switchyard_ops::{
    causal_attention_packed, causal_self_attention, cross_entropy, gelu, layer_norm, linear,
    linear_gelu, linear_with, LinearOptions, Reduce,
};

// ---------------------------------------------------------------- LayerNorm

const EPS: f64 = 1e-5;

fn ln_ref(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let d = w.len();
    x.chunks(d)
        .flat_map(|row| {
            let mean = row.iter().sum::<f64>() / d as f64;
            let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
            let rstd = 1.0 / (var + EPS).sqrt();
            row.iter()
                .enumerate()
                .map(move |(j, v)| (v - mean) * rstd * w[j] + b[j])
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Hand-derived: with x̂ = (x − μ)·rstd and ĝ = g ⊙ w,
/// dx = rstd · (ĝ − mean(ĝ) − x̂ · mean(ĝ ⊙ x̂)), dw = Σ_rows g ⊙ x̂, db = Σ_rows g.
fn ln_grad(inp: &[Vec<f64>], g: &[f64]) -> Vec<Vec<f64>> {
    let (x, w) = (&inp[0], &inp[1]);
    let d = w.len();
    let (mut dx, mut dw, mut db) = (vec![], vec![0.0; d], vec![0.0; d]);
    for (row, gr) in x.chunks(d).zip(g.chunks(d)) {
        let mean = row.iter().sum::<f64>() / d as f64;
        let var = row.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / d as f64;
        let rstd = 1.0 / (var + EPS).sqrt();
        let xh: Vec<f64> = row.iter().map(|v| (v - mean) * rstd).collect();
        let gh: Vec<f64> = gr.iter().zip(w).map(|(a, b)| a * b).collect();
        let m1 = gh.iter().sum::<f64>() / d as f64;
        let m2 = gh.iter().zip(&xh).map(|(a, b)| a * b).sum::<f64>() / d as f64;
        for j in 0..d {
            dx.push(rstd * (gh[j] - m1 - xh[j] * m2));
            dw[j] += gr[j] * xh[j];
            db[j] += gr[j];
        }
    }
    vec![dx, dw, db]
}

#[test]
fn layer_norm_matches_reference() {
    let inputs = [
        input("x", &[2, 3, 8], 1, 2.0),
        input("weight", &[8], 2, 1.0),
        input("bias", &[8], 3, 1.0),
    ];
    check(
        "layer_norm",
        &inputs,
        &|t| layer_norm(&t[0], &t[1], &t[2], EPS),
        &|v| ln_ref(&v[0], &v[1], &v[2]),
        Some(&ln_grad),
    );
}

// ---------------------------------------------------------------- GELU

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

fn gelu_ref(x: f64) -> f64 {
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x.powi(3))).tanh())
}

fn gelu_deriv(x: f64) -> f64 {
    let t = (SQRT_2_OVER_PI * (x + 0.044715 * x.powi(3))).tanh();
    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * 0.044715 * x * x)
}

#[test]
fn gelu_matches_reference() {
    let inputs = [input("x", &[3, 7], 4, 4.0)];
    check(
        "gelu",
        &inputs,
        &|t| gelu(&t[0]),
        &|v| v[0].iter().map(|&x| gelu_ref(x)).collect(),
        Some(&|v, g| {
            vec![v[0]
                .iter()
                .zip(g)
                .map(|(&x, g)| g * gelu_deriv(x))
                .collect()]
        }),
    );
}

#[test]
fn gelu_other_dtypes_and_strided_inputs() {
    let x = Tensor::new(&[[-3.0f64, -0.5, 0.0], [0.5, 1.0, 3.0]], &Device::Cpu).unwrap();
    let want: Vec<f64> = to_f64(&x.t().unwrap())
        .iter()
        .map(|&v| gelu_ref(v))
        .collect();
    // A transposed (non-contiguous) input.
    assert_close(
        "gelu strided",
        &to_f64(&gelu(&x.t().unwrap()).unwrap()),
        &want,
        1e-12,
    );
    // bf16 goes through the composite path.
    let y = gelu(&x.t().unwrap().to_dtype(DType::BF16).unwrap()).unwrap();
    assert_eq!(y.dtype(), DType::BF16);
    assert_close("gelu bf16", &to_f64(&y), &want, 2e-2);
}

// ---------------------------------------------------------------- linear

fn linear_ref(x: &[f64], w: &[f64], b: Option<&[f64]>, out_f: usize) -> Vec<f64> {
    let in_f = w.len() / out_f;
    x.chunks(in_f)
        .flat_map(|row| {
            (0..out_f)
                .map(|o| {
                    let dot: f64 = (0..in_f).map(|i| row[i] * w[o * in_f + i]).sum();
                    dot + b.map_or(0.0, |b| b[o])
                })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Hand-derived: dX = G·W, dW = Gᵀ·X, db = Σ_rows G.
fn linear_grad(inp: &[Vec<f64>], g: &[f64], out_f: usize) -> Vec<Vec<f64>> {
    let (x, w) = (&inp[0], &inp[1]);
    let in_f = w.len() / out_f;
    let rows = x.len() / in_f;
    let mut dx = vec![0.0; x.len()];
    let mut dw = vec![0.0; w.len()];
    let mut db = vec![0.0; out_f];
    for n in 0..rows {
        for o in 0..out_f {
            let gv = g[n * out_f + o];
            db[o] += gv;
            for i in 0..in_f {
                dx[n * in_f + i] += gv * w[o * in_f + i];
                dw[o * in_f + i] += gv * x[n * in_f + i];
            }
        }
    }
    vec![dx, dw, db]
}

#[test]
fn linear_matches_reference_rank2_and_rank3() {
    for x_shape in [&[5usize, 6][..], &[2, 3, 6][..]] {
        let inputs = [
            input("x", x_shape, 5, 1.0),
            input("weight", &[4, 6], 6, 0.5),
            input("bias", &[4], 7, 0.5),
        ];
        check(
            &format!("linear {x_shape:?}"),
            &inputs,
            &|t| linear(&t[0], &t[1], Some(&t[2])),
            &|v| linear_ref(&v[0], &v[1], Some(&v[2]), 4),
            Some(&|v, g| linear_grad(v, g, 4)),
        );
    }
}

#[test]
fn linear_without_bias() {
    let inputs = [
        input("x", &[2, 3, 6], 8, 1.0),
        input("weight", &[4, 6], 9, 0.5),
    ];
    check(
        "linear no bias",
        &inputs,
        &|t| linear(&t[0], &t[1], None),
        &|v| linear_ref(&v[0], &v[1], None, 4),
        Some(&|v, g| linear_grad(v, g, 4)[..2].to_vec()),
    );
}

#[test]
fn linear_rejects_bad_shapes() {
    let dev = Device::Cpu;
    let x = Tensor::zeros((2, 5), DType::F32, &dev).unwrap();
    let w = Tensor::zeros((4, 6), DType::F32, &dev).unwrap();
    let err = linear(&x, &w, None).unwrap_err().to_string();
    assert!(err.contains("[N, 6]") && err.contains("[2, 5]"), "{err}");
    let x = Tensor::zeros((2, 6), DType::F32, &dev).unwrap();
    let b = Tensor::zeros(3, DType::F32, &dev).unwrap();
    let err = linear(&x, &w, Some(&b)).unwrap_err().to_string();
    assert!(err.contains("bias") && err.contains("[4]"), "{err}");
}

// ---------------------------------------------------------------- attention

fn attention_ref(q: &[f64], k: &[f64], v: &[f64], bh: usize, t: usize, hd: usize) -> Vec<f64> {
    let mut out = vec![0.0; q.len()];
    for s in 0..bh {
        let at = |m: &[f64], i: usize, d: usize| m[(s * t + i) * hd + d];
        for i in 0..t {
            let scores: Vec<f64> = (0..=i)
                .map(|j| {
                    (0..hd).map(|d| at(q, i, d) * at(k, j, d)).sum::<f64>() / (hd as f64).sqrt()
                })
                .collect();
            let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..hd {
                out[(s * t + i) * hd + d] = (0..=i).map(|j| e[j] / z * at(v, j, d)).sum();
            }
        }
    }
    out
}

#[test]
fn causal_attention_matches_reference() {
    let (b, h, t, hd) = (2, 2, 5, 3);
    let shape = [b, h, t, hd];
    let inputs = [
        input("q", &shape, 10, 1.5),
        input("k", &shape, 11, 1.5),
        input("v", &shape, 12, 1.0),
    ];
    check(
        "causal_self_attention",
        &inputs,
        &|x| causal_self_attention(&x[0], &x[1], &x[2]),
        &|x| attention_ref(&x[0], &x[1], &x[2], b * h, t, hd),
        None,
    );
}

#[test]
fn causal_attention_accepts_strided_views() {
    // q, k, v as transposed views of a (B, T, H, hd) tensor, as a model produces them.
    let (b, h, t, hd) = (1, 2, 4, 3);
    let vals = Rng::new(13).vec(b * t * h * hd, 1.0);
    let x = tensor(&vals, &[b, t, h, hd], DType::F64)
        .transpose(1, 2)
        .unwrap();
    let y = causal_self_attention(&x, &x, &x).unwrap();
    let xc = to_f64(&x.contiguous().unwrap());
    let want = attention_ref(&xc, &xc, &xc, b * h, t, hd);
    assert_close("strided attention", &to_f64(&y), &want, 1e-12);
}

/// A pre-LN MLP block end to end: every input (x, LN weight and bias, both linear
/// weights and biases) receives a non-zero gradient.
#[test]
fn every_input_of_a_composed_block_gets_a_gradient() {
    let dev = Device::Cpu;
    let mut rng = Rng::new(16);
    let mut var = |shape: &[usize]| {
        let n = shape.iter().product();
        Var::from_tensor(&tensor(&rng.vec(n, 0.5), shape, DType::F32)).unwrap()
    };
    let (x, lw, lb) = (var(&[2, 4, 8]), var(&[8]), var(&[8]));
    let (w1, b1, w2, b2) = (var(&[12, 8]), var(&[12]), var(&[8, 12]), var(&[8]));
    let h = layer_norm(x.as_tensor(), lw.as_tensor(), lb.as_tensor(), EPS).unwrap();
    let h = gelu(&linear(&h, w1.as_tensor(), Some(b1.as_tensor())).unwrap()).unwrap();
    let y = linear(&h, w2.as_tensor(), Some(b2.as_tensor())).unwrap();
    let qkv = y.reshape((2, 4, 2, 4)).unwrap().transpose(1, 2).unwrap();
    let a = causal_self_attention(&qkv, &qkv, &qkv).unwrap();
    let logits = a.transpose(1, 2).unwrap().reshape((8, 8)).unwrap();
    let targets = Tensor::new(&[0u32, 1, 2, 3, 4, 5, 6, 7], &dev).unwrap();
    let grads = cross_entropy(&logits, &targets)
        .unwrap()
        .backward()
        .unwrap();
    for (name, v) in [("x", &x), ("ln.weight", &lw), ("ln.bias", &lb), ("w1", &w1)]
        .into_iter()
        .chain([("b1", &b1), ("w2", &w2), ("b2", &b2)])
    {
        let g = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        let m = g
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(m > 0.0 && m.is_finite(), "{name}: gradient max {m}");
    }
}

// ---------------------------------------------------------------- fused variants

#[test]
fn linear_gelu_matches_reference() {
    let inputs = [
        input("x", &[2, 5, 19], 20, 1.0),
        input("weight", &[23, 19], 21, 0.5),
        input("bias", &[23], 22, 0.5),
    ];
    let pre = |v: &[Vec<f64>]| linear_ref(&v[0], &v[1], Some(&v[2]), 23);
    check(
        "linear_gelu",
        &inputs,
        &|t| linear_gelu(&t[0], &t[1], Some(&t[2])),
        &|v| pre(v).iter().map(|&z| gelu_ref(z)).collect(),
        Some(&|v, g| {
            let gz: Vec<f64> = pre(v)
                .iter()
                .zip(g)
                .map(|(&z, g)| g * gelu_deriv(z))
                .collect();
            linear_grad(v, &gz, 23)
        }),
    );
}

/// The tensor-parallel hooks, with a "collective" that doubles its input (the sum over 2
/// ranks that hold the same tensor). Forward: `y = 2·x·wᵀ + b` (reduced before the bias).
/// Backward follows Megatron's pairing rather than the local function: the output
/// reduction's backward is the identity (each rank's partial product gets the full
/// gradient), and the input gradient is reduced, so `dx = 2·G·W`, `dw = Gᵀ·X`,
/// `db = Σ G`.
#[test]
fn linear_hooks_reduce_the_output_and_the_input_gradient() {
    let double: Reduce = Arc::new(|t: &Tensor| t.affine(2.0, 0.0));
    let opts = LinearOptions {
        reduce_output: Some(double.clone()),
        reduce_input_grad: Some(double),
        ..LinearOptions::default()
    };
    let vals = [
        Rng::new(23).vec(7 * 6, 1.0),
        Rng::new(24).vec(4 * 6, 0.5),
        Rng::new(25).vec(4, 0.5),
    ];
    let g = Rng::new(26).vec(7 * 4, 1.0);
    let vars: Vec<Var> = [(0, &[7usize, 6][..]), (1, &[4, 6]), (2, &[4])]
        .iter()
        .map(|&(i, s)| Var::from_tensor(&tensor(&vals[i], s, DType::F64)).unwrap())
        .collect();
    let t: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let y = linear_with(t[0], t[1], Some(t[2]), &opts).unwrap();
    let want: Vec<f64> = linear_ref(&vals[0], &vals[1], None, 4)
        .iter()
        .enumerate()
        .map(|(i, y)| 2.0 * y + vals[2][i % 4])
        .collect();
    assert_close("hooked value", &to_f64(&y), &want, 1e-12);
    let gt = tensor(&g, &[7, 4], DType::F64);
    let grads = (y * gt).unwrap().sum_all().unwrap().backward().unwrap();
    let mut want = linear_grad(&vals, &g, 4);
    want[0].iter_mut().for_each(|x| *x *= 2.0);
    for (i, name) in ["dx", "dw", "db"].iter().enumerate() {
        let got = to_f64(grads.get(t[i]).unwrap());
        assert_close(name, &got, &want[i], 1e-12);
    }
}

#[test]
fn layer_norm_rows_wider_than_a_vector() {
    let inputs = [
        input("x", &[5, 37], 26, 2.0),
        input("weight", &[37], 27, 1.0),
        input("bias", &[37], 28, 1.0),
    ];
    check(
        "layer_norm d=37",
        &inputs,
        &|t| layer_norm(&t[0], &t[1], &t[2], EPS),
        &|v| ln_ref(&v[0], &v[1], &v[2]),
        Some(&ln_grad),
    );
}

/// Long enough (T = 70) to cross the kernel's 16-row causal blocks, with a partial
/// last block.
#[test]
fn packed_causal_attention_matches_reference_across_blocks() {
    let (b, h, t, hd) = (1, 2, 70, 3);
    let dl = h * hd;
    let inputs = [input("qkv", &[b, t, 3 * dl], 29, 1.5)];
    // Unpack [B, T, 3·H·hd] into the (B·H, T, hd) layout of `attention_ref`.
    let split = |x: &[f64], part: usize| -> Vec<f64> {
        let mut out = Vec::with_capacity(b * h * t * hd);
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    let row = (bi * t + ti) * 3 * dl + part * dl + hi * hd;
                    out.extend_from_slice(&x[row..row + hd]);
                }
            }
        }
        out
    };
    let reference = |v: &[Vec<f64>]| -> Vec<f64> {
        let o = attention_ref(
            &split(&v[0], 0),
            &split(&v[0], 1),
            &split(&v[0], 2),
            b * h,
            t,
            hd,
        );
        // Back to [B, T, H·hd].
        let mut y = vec![0.0; b * t * dl];
        for bi in 0..b {
            for hi in 0..h {
                for ti in 0..t {
                    for d in 0..hd {
                        y[(bi * t + ti) * dl + hi * hd + d] = o[((bi * h + hi) * t + ti) * hd + d];
                    }
                }
            }
        }
        y
    };
    check(
        "causal_attention_packed T=70",
        &inputs,
        &|x| causal_attention_packed(&x[0], h),
        &reference,
        None,
    );
}
