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

/// `(dx, [d[w1 | b1], d[w2 | b2]])` of `Σ y ⊙ r` for the pair `f`, whole or split.
fn grads(
    shapes: &[&[usize]; 5],
    f: &dyn Fn(&Tensor, &PairWeights, &PairOptions) -> Tensor,
    precision: Precision,
    split: bool,
) -> (Vec<f64>, Vec<Vec<f64>>) {
    let vars: Vec<Var> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let v = Rng::new(70 + i as u64).vec(s.iter().product(), 1.0);
            Var::from_tensor(&tensor(&v, s, DType::F32)).unwrap()
        })
        .collect();
    let t: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let w = PairWeights::new(t[1], Some(t[2]), t[3], Some(t[4])).unwrap();
    let defer = DeferredWeights::new();
    defer.set_split(split);
    let opts = PairOptions {
        precision,
        defer: Some(defer.clone()),
        ..PairOptions::default()
    };
    let y = f(t[0], &w, &opts);
    let r = tensor(&Rng::new(98).vec(y.elem_count(), 1.0), y.dims(), DType::F32);
    let g = (y * r).unwrap().sum_all().unwrap().backward().unwrap();
    let dx = to_f64(g.get(t[0]).unwrap());
    let fused = |w: usize, b: usize| -> Vec<f64> {
        let (gw, gb) = (g.get(t[w]).unwrap(), g.get(t[b]).unwrap());
        to_f64(&Tensor::cat(&[gw, &gb.unsqueeze(1).unwrap()], 1).unwrap())
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
    for (what, shapes, f) in cases {
        for p in [Precision::F32, Precision::Bf16] {
            let whole = grads(shapes, f, p, false);
            let split = grads(shapes, f, p, true);
            assert_eq!(whole.0, split.0, "{what} {p}: input gradient");
            assert_eq!(whole.1, split.1, "{what} {p}: weight gradients");
        }
    }
}
