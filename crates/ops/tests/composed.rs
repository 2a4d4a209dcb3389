//! Every fused op against its composed twin (`OpsBackend::Composed`, the path every
//! non-CPU device takes): the same value and the same gradient for every input, in f64
//! and f32, with the tensor-parallel hooks on and off.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor, Var};
use common::{assert_close, tensor, to_f64, Rng};
use switchyard_ops::{linear_with, LinearOptions, OpsBackend, Reduce};

/// `f(backend, inputs)` for both backends, in f64 and f32: the values and the gradients
/// of `Σ y ⊙ r` for every input agree (1e-12 in f64, 1e-5 in f32, relative to the fused
/// result's largest element).
fn check(what: &str, shapes: &[&[usize]], f: &dyn Fn(OpsBackend, &[Tensor]) -> Tensor) {
    let vals: Vec<Vec<f64>> = shapes
        .iter()
        .enumerate()
        .map(|(i, s)| Rng::new(70 + i as u64).vec(s.iter().product(), 1.0))
        .collect();
    for (dtype, tol) in [(DType::F64, 1e-12), (DType::F32, 1e-5)] {
        let run = |backend: OpsBackend| -> Vec<Vec<f64>> {
            let vars: Vec<Var> = vals
                .iter()
                .zip(shapes)
                .map(|(v, s)| Var::from_tensor(&tensor(v, s, dtype)).unwrap())
                .collect();
            let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            let y = f(backend, &ts);
            let r = tensor(&Rng::new(99).vec(y.elem_count(), 1.0), y.dims(), dtype);
            let grads = (&y * r).unwrap().sum_all().unwrap().backward().unwrap();
            let mut out = vec![to_f64(&y)];
            for v in &vars {
                let g = grads.get(v.as_tensor());
                out.push(g.map(to_f64).unwrap_or_else(|| vec![0.0; v.elem_count()]));
            }
            out
        };
        let (fused, composed) = (run(OpsBackend::Fused), run(OpsBackend::Composed));
        for (i, (a, b)) in composed.iter().zip(&fused).enumerate() {
            let at = match i {
                0 => format!("{what} {dtype:?}: value"),
                _ => format!("{what} {dtype:?}: gradient of input {}", i - 1),
            };
            assert_close(&at, a, b, tol);
        }
    }
}

#[test]
fn gelu_and_layer_norm() {
    check("gelu", &[&[3, 17]], &|b, t| b.gelu(&t[0]).unwrap());
    check("layer_norm", &[&[2, 5, 7], &[7], &[7]], &|b, t| {
        b.layer_norm(&t[0], &t[1], &t[2], 1e-5).unwrap()
    });
}

#[test]
fn linear_with_gelu_bias_and_hooks() {
    let double: Reduce = Arc::new(|t: &Tensor| t.affine(2.0, 0.0));
    for (gelu, hooks, bias) in [
        (false, false, true),
        (true, false, true),
        (false, true, true),
        (true, true, false),
    ] {
        let what = format!("linear gelu {gelu} hooks {hooks} bias {bias}");
        check(&what, &[&[2, 9, 6], &[4, 6], &[4]], &|backend, t| {
            let opts = LinearOptions {
                gelu,
                reduce_output: hooks.then(|| double.clone()),
                reduce_input_grad: hooks.then(|| double.clone()),
                backend,
                ..LinearOptions::default()
            };
            linear_with(&t[0], &t[1], bias.then_some(&t[2]), &opts).unwrap()
        });
    }
}

#[test]
fn attention() {
    // T = 37 crosses the fused kernel's causal blocks.
    check("causal_attention_packed", &[&[2, 37, 18]], &|b, t| {
        b.causal_attention_packed(&t[0], 2).unwrap()
    });
    check(
        "causal_self_attention",
        &[&[2, 2, 11, 3], &[2, 2, 11, 3], &[2, 2, 11, 3]],
        &|b, t| b.causal_self_attention(&t[0], &t[1], &t[2]).unwrap(),
    );
}

#[test]
fn cross_entropy_and_its_parallel_slices() {
    let dev = Device::Cpu;
    let targets = Tensor::new(&[3u32, 0, 6, 2, 5], &dev).unwrap();
    check("cross_entropy", &[&[5, 7]], &|b, t| {
        b.cross_entropy(&t[0], &targets).unwrap()
    });
    // A slice of one rank (the collectives stand-ins that change the values, as the other
    // ranks would): the first slice of a vocabulary of 12, one that ends in padding, and
    // one of padding only.
    let max: Reduce = Arc::new(|t: &Tensor| t.maximum(0.5));
    let sum: Reduce = Arc::new(|t: &Tensor| t.affine(2.0, 1.0));
    for (start, vocab) in [(0, 12), (4, 7), (8, 7)] {
        let what = format!("cross_entropy_parallel start {start} vocab {vocab}");
        check(&what, &[&[5, 4]], &|b, t| {
            let targets = Tensor::new(&[4u32, 0, 6, 2, 5], &dev).unwrap(); // all < 7
            b.cross_entropy_parallel(&t[0], &targets, start, vocab, max.clone(), sum.clone())
                .unwrap()
        });
    }
}

#[test]
fn the_backend_names_parse_and_print() {
    for b in OpsBackend::ALL {
        assert_eq!(b.to_string().parse::<OpsBackend>(), Ok(b));
    }
    let e = "gpu".parse::<OpsBackend>().unwrap_err().to_string();
    assert!(e.contains("\"fused\" or \"composed\""), "{e}");
    assert_eq!(OpsBackend::default(), OpsBackend::Fused);
}
