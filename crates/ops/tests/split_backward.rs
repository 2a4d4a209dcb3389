//! A split backward (zero-bubble schedules' `I` and `W`): with a split
//! [`DeferredWeights`], the fused MLP and attention compute only the input gradient in
//! their backward, give no gradient to their weights, and the deferred job gives the
//! weights' gradients: all bit for bit those of the whole backward, at f32 and at bf16.
//! Not split, the same options compute everything at once.

mod common;

use candle_core::{DType, Tensor, Var};
use common::{tensor, to_f64, Rng};
use switchyard_ops::{
    attention_block_with, mlp_with, DeferredWeights, PairOptions, PairWeights, Precision,
};

/// The element types and biases of one case.
#[derive(Clone, Copy, Debug)]
struct Case {
    /// The weights' and biases' type.
    dtype: DType,
    /// The input's (bf16: activations kept as bf16, the incoming gradient bf16 too).
    x_dtype: DType,
    bias: bool,
}

/// `(dx, [d[w1 | b1], d[w2 | b2]])` of `Σ y ⊙ r` for the pair `f`, whole or split
/// (`d w1` and `d w2` alone without biases).
fn grads(
    shapes: &[&[usize]; 5],
    f: &dyn Fn(&Tensor, &PairWeights, &PairOptions) -> Tensor,
    precision: Precision,
    split: bool,
    case: Case,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let vars: Vec<Var> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let v = Rng::new(70 + i as u64).vec(s.iter().product(), 1.0);
            let dtype = if i == 0 { case.x_dtype } else { case.dtype };
            Var::from_tensor(&tensor(&v, s, dtype)).unwrap()
        })
        .collect();
    let t: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let b = |i: usize| case.bias.then_some(t[i]);
    let w = PairWeights::new(t[1], b(2), t[3], b(4)).unwrap();
    let defer = DeferredWeights::new();
    defer.set_split(split);
    let opts = PairOptions {
        precision,
        defer: Some(defer.clone()),
        ..PairOptions::default()
    };
    let y = f(t[0], &w, &opts);
    let r = tensor(&Rng::new(98).vec(y.elem_count(), 1.0), y.dims(), y.dtype());
    let g = (y * r).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = to_f64(g.get(t[0]).unwrap());
    let fused = |w: usize, b: usize| -> Vec<f64> {
        let gw = g.get(t[w]).unwrap();
        match case.bias {
            true => {
                let gb = g.get(t[b]).unwrap().unsqueeze(1).unwrap();
                to_f64(&Tensor::cat(&[gw, &gb], 1).unwrap())
            }
            false => to_f64(gw),
        }
    };
    match split {
        false => {
            assert_eq!(defer.pending(), 0, "a whole backward defers nothing");
            (dx, vec![fused(1, 2), fused(3, 4)])
        }
        true => {
            for (i, w) in t.iter().enumerate().skip(1) {
                assert!(
                    g.get(w).is_none(),
                    "a split backward gave weight {i} a gradient"
                );
            }
            assert_eq!(defer.pending(), 1, "one deferred job per backward");
            let w = defer.run_oldest().unwrap().expect("the deferred products");
            assert!(defer.run_oldest().unwrap().is_none());
            (dx, w.iter().map(to_f64).collect())
        }
    }
}

#[test]
fn a_split_backward_gives_the_whole_backwards_gradients() {
    let (b, t, d, hidden, heads) = (2, 9, 24, 40, 3);
    let mlp = |x: &Tensor, w: &PairWeights, o: &PairOptions| mlp_with(x, w, o).unwrap();
    let attn = |x: &Tensor, w: &PairWeights, o: &PairOptions| {
        attention_block_with(x, w, heads, o).unwrap()
    };
    let mlp_shapes: [&[usize]; 5] = [&[b, t, d], &[hidden, d], &[hidden], &[d, hidden], &[d]];
    let attn_shapes: [&[usize]; 5] = [&[b, t, d], &[3 * d, d], &[3 * d], &[d, d], &[d]];
    type Pair<'a> = &'a dyn Fn(&Tensor, &PairWeights, &PairOptions) -> Tensor;
    let cases: [(&str, &[&[usize]; 5], Pair); 2] = [
        ("mlp", &mlp_shapes, &mlp),
        ("attention", &attn_shapes, &attn),
    ];
    let case = |dtype, x_dtype, bias| Case {
        dtype,
        x_dtype,
        bias,
    };
    // f32 and bf16 products; bf16 activations (the incoming gradient bf16 too: the
    // biases' sums move to `W`); f64; no biases.
    let runs = [
        (Precision::F32, case(DType::F32, DType::F32, true)),
        (Precision::Bf16, case(DType::F32, DType::F32, true)),
        (Precision::Bf16, case(DType::F32, DType::BF16, true)),
        (Precision::F32, case(DType::F64, DType::F64, true)),
        (Precision::F32, case(DType::F32, DType::F32, false)),
        (Precision::Bf16, case(DType::F32, DType::BF16, false)),
    ];
    for (what, shapes, f) in cases {
        for (p, c) in runs {
            let whole = grads(shapes, f, p, false, c);
            let split = grads(shapes, f, p, true, c);
            assert_eq!(whole.0, split.0, "{what} {p} {c:?}: input gradient");
            assert_eq!(whole.1, split.1, "{what} {p} {c:?}: weight gradients");
        }
    }
}
