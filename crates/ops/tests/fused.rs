//! The fused halves of a transformer block, `mlp` and `attention_block`, against the
//! compositions of ops they replace: the same value and the same gradient for every
//! input, in f64 and f32, with the tensor-parallel hooks (a "collective" that doubles)
//! on and off, with and without biases, on both backends (the composed twin of a pair
//! against the fused ops it replaces); and their refusals.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use common::{assert_close, tensor, to_f64, Rng};
use switchyard_ops::{
    attention_block, causal_attention_packed, linear_with, mlp, LinearOptions, OpsBackend,
    PairOptions, Reduce,
};

/// A pair as a function of `x, w1, b1, w2, b2`.
type Apply<'a> = dyn Fn(&Tensor, &Tensor, Option<&Tensor>, &Tensor, Option<&Tensor>) -> Tensor + 'a;
/// A pair for the given collectives.
type MakeApply = dyn for<'a> Fn(&'a PairOptions) -> Box<Apply<'a>>;

/// Five inputs `x, w1, b1, w2, b2` of these shapes (random, seeds from `seed`).
fn inputs(seed: u64, shapes: &[&[usize]; 5]) -> Vec<Vec<f64>> {
    let scale = [1.0, 0.5, 0.5, 0.5, 0.5];
    (0..5)
        .map(|i| Rng::new(seed + i as u64).vec(shapes[i].iter().product(), scale[i]))
        .collect()
}

/// `f` applied to the inputs as variables of `dtype` (biases left out unless `biases`),
/// then `Σ y ⊙ g` backward: the value, then the gradient of every input passed.
fn value_and_grads(
    vals: &[Vec<f64>],
    shapes: &[&[usize]; 5],
    dtype: DType,
    biases: bool,
    g: &[f64],
    f: &Apply,
) -> Vec<Vec<f64>> {
    let vars: Vec<Var> = (0..5)
        .map(|i| Var::from_tensor(&tensor(&vals[i], shapes[i], dtype)).unwrap())
        .collect();
    let t: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let (b1, b2) = match biases {
        true => (Some(t[2]), Some(t[4])),
        false => (None, None),
    };
    let y = f(t[0], t[1], b1, t[3], b2);
    let gt = tensor(g, y.dims(), dtype);
    let grads = (&y * gt).unwrap().sum_all().unwrap().backward().unwrap();
    let mut out = vec![to_f64(&y)];
    for (i, v) in t.iter().enumerate() {
        if biases || (i != 2 && i != 4) {
            out.push(to_f64(grads.get(v).unwrap()));
        }
    }
    out
}

/// The linear options of the two halves a fused pair replaces.
fn halves(opts: &PairOptions, gelu: bool) -> (LinearOptions, LinearOptions) {
    let first = LinearOptions {
        gelu,
        reduce_input_grad: opts.reduce_input_grad.clone(),
        ..LinearOptions::default()
    };
    let second = LinearOptions {
        reduce_output: opts.reduce_output.clone(),
        ..LinearOptions::default()
    };
    (first, second)
}

/// Runs `fused` and `plain` over f64 and f32, hooks on and off, biases on and off, and
/// compares every output.
fn check_pair(
    what: &str,
    shapes: &[&[usize]; 5],
    out_len: usize,
    fused: &MakeApply,
    plain: &MakeApply,
) {
    let vals = inputs(40, shapes);
    let g = Rng::new(49).vec(out_len, 1.0);
    let double: Reduce = Arc::new(|t: &Tensor| t.affine(2.0, 0.0));
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        for (hooks, backend) in [false, true]
            .into_iter()
            .flat_map(|h| OpsBackend::ALL.map(|b| (h, b)))
        {
            // Selective recomputation (the MLP's GELU output computed again in the
            // backward) changes nothing: bit for bit, and within `tol` of the plain ops.
            for recompute_gelu in [false, true] {
                let opts = PairOptions {
                    reduce_output: hooks.then(|| double.clone()),
                    reduce_input_grad: hooks.then(|| double.clone()),
                    backend,
                    recompute_gelu,
                    ..PairOptions::default()
                };
                let kept = PairOptions {
                    recompute_gelu: false,
                    ..opts.clone()
                };
                for biases in [true, false] {
                    let got = value_and_grads(&vals, shapes, dtype, biases, &g, &*fused(&opts));
                    let want = value_and_grads(&vals, shapes, dtype, biases, &g, &*plain(&opts));
                    let same = value_and_grads(&vals, shapes, dtype, biases, &g, &*fused(&kept));
                    assert_eq!(got.len(), want.len());
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        let at = format!(
                            "{what} ({backend}): output {i} {dtype:?} hooks {hooks} biases {biases} recompute {recompute_gelu}"
                        );
                        assert_close(&at, a, b, tol);
                        assert_close(&at, a, &same[i], 0.0);
                    }
                }
            }
        }
    }
}

/// `attention_block` is `linear`, then `causal_attention_packed`, then `linear`
/// (T = 37 crosses the causal blocks; 2 heads of 3).
#[test]
fn attention_block_equals_the_three_ops() {
    let (b, t, d, heads, hd, out) = (2, 37, 5, 2, 3, 4);
    let dl = heads * hd;
    let shapes: [&[usize]; 5] = [&[b, t, d], &[3 * dl, d], &[3 * dl], &[out, dl], &[out]];
    check_pair(
        "attention_block",
        &shapes,
        b * t * out,
        &move |opts| {
            Box::new(move |x, w1, b1, w2, b2| {
                attention_block(x, w1, b1, w2, b2, heads, opts).unwrap()
            })
        },
        &move |opts| {
            Box::new(move |x, w1, b1, w2, b2| {
                let (first, second) = halves(opts, false);
                let qkv = linear_with(x, w1, b1, &first).unwrap();
                let a = causal_attention_packed(&qkv, heads).unwrap();
                linear_with(&a, w2, b2, &second).unwrap()
            })
        },
    );
}

/// `mlp` is `linear_gelu` then `linear`.
#[test]
fn mlp_equals_the_two_linear_ops() {
    let (n, d, hidden, out) = (19, 5, 12, 7);
    let shapes: [&[usize]; 5] = [&[2, n, d], &[hidden, d], &[hidden], &[out, hidden], &[out]];
    check_pair(
        "mlp",
        &shapes,
        2 * n * out,
        &|opts| Box::new(move |x, w1, b1, w2, b2| mlp(x, w1, b1, w2, b2, opts).unwrap()),
        &|opts| {
            Box::new(move |x, w1, b1, w2, b2| {
                let (first, second) = halves(opts, true);
                let h = linear_with(x, w1, b1, &first).unwrap();
                linear_with(&h, w2, b2, &second).unwrap()
            })
        },
    );
}

#[test]
fn attention_block_rejects_bad_heads_and_shapes() {
    let dev = Device::Cpu;
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev).unwrap();
    let o = PairOptions::default();
    let (w, p) = (z(&[12, 6]), z(&[6, 4]));
    // 12 is not 3 × 5 heads; a rank-2 input; a projection of the wrong width.
    for (x, heads, proj) in [
        (z(&[1, 4, 6]), 5, &p),
        (z(&[4, 6]), 2, &p),
        (z(&[1, 4, 6]), 2, &w),
    ] {
        let e = attention_block(&x, &w, None, proj, None, heads, &o)
            .unwrap_err()
            .to_string();
        assert!(e.contains("attention_block"), "{e}");
    }
}

#[test]
fn mlp_rejects_mismatched_shapes() {
    let dev = Device::Cpu;
    let z = |s: &[usize]| Tensor::zeros(s, DType::F32, &dev).unwrap();
    let o = PairOptions::default();
    let e = mlp(&z(&[3, 4]), &z(&[8, 4]), None, &z(&[4, 9]), None, &o).unwrap_err();
    assert!(e.to_string().contains("mlp: shapes"), "{e}");
    let e = mlp(
        &z(&[3, 4]),
        &z(&[8, 4]),
        Some(&z(&[7])),
        &z(&[4, 8]),
        None,
        &o,
    )
    .unwrap_err();
    assert!(e.to_string().contains("b1"), "{e}");
}
