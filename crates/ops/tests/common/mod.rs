//! Test harness: plain-Rust reference math, central finite differences and tolerances.
//! Nothing here calls the crate under test.

#![allow(dead_code)]

use candle_core::{DType, Device, Result, Tensor, Var};

/// A tiny deterministic generator (xorshift64*), independent of any crate.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let bits = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
        (bits as f64 / (1u64 << 53) as f64) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f64) -> Vec<f64> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

pub fn tensor(v: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(v.to_vec(), shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

pub fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

pub fn max_abs(v: &[f64]) -> f64 {
    v.iter().fold(0.0, |m, x| m.max(x.abs()))
}

/// Asserts `max|got − want| ≤ rel · max|want|` (the relative error of the tensor as a
/// whole, in the max norm).
pub fn assert_close(what: &str, got: &[f64], want: &[f64], rel: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    assert!(
        got.iter().all(|x| x.is_finite()),
        "{what}: non-finite values {got:?}"
    );
    let err = got
        .iter()
        .zip(want)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    let scale = max_abs(want);
    assert!(
        err <= rel * scale,
        "{what}: max abs error {err:e} > {rel:e} × max|want| {scale:e}\n got  {got:?}\n want {want:?}"
    );
}

/// Central finite differences of the scalar `f` with respect to every element of
/// `inputs[which]`.
pub fn fd_grad(f: &dyn Fn(&[Vec<f64>]) -> f64, inputs: &[Vec<f64>], which: usize) -> Vec<f64> {
    let h = 1e-5;
    let mut x = inputs.to_vec();
    (0..inputs[which].len())
        .map(|i| {
            let orig = x[which][i];
            x[which][i] = orig + h;
            let fp = f(&x);
            x[which][i] = orig - h;
            let fm = f(&x);
            x[which][i] = orig;
            (fp - fm) / (2.0 * h)
        })
        .collect()
}

/// One differentiable input of a case: values, shape and a name for messages.
pub struct Input {
    pub name: &'static str,
    pub values: Vec<f64>,
    pub shape: Vec<usize>,
}

pub type CandleFn<'a> = &'a dyn Fn(&[Tensor]) -> Result<Tensor>;
pub type RefFn<'a> = &'a dyn Fn(&[Vec<f64>]) -> Vec<f64>;
/// Exact gradients of `Σ_k y_k · r_k` for every input, given the inputs and `r`.
pub type RefGradFn<'a> = &'a dyn Fn(&[Vec<f64>], &[f64]) -> Vec<Vec<f64>>;

/// Checks `op` against `reference` in f64 and f32: the output values, and the gradient
/// of `L = Σ y·r` (r random) with respect to every input, against central finite
/// differences of the reference and, when given, against hand-derived gradients.
/// Also asserts that every input receives a non-zero gradient.
pub fn check(
    case: &str,
    inputs: &[Input],
    op: CandleFn,
    reference: RefFn,
    exact_grad: Option<RefGradFn>,
) {
    let vals: Vec<Vec<f64>> = inputs.iter().map(|i| i.values.clone()).collect();
    let y_ref = reference(&vals);
    let r = Rng::new(99).vec(y_ref.len(), 1.0);
    let loss = |xs: &[Vec<f64>]| -> f64 { reference(xs).iter().zip(&r).map(|(a, b)| a * b).sum() };
    let fd: Vec<Vec<f64>> = (0..inputs.len())
        .map(|i| fd_grad(&loss, &vals, i))
        .collect();
    let exact = exact_grad.map(|g| g(&vals, &r));

    for (dtype, tol_val, tol_fd, tol_exact) in [
        (DType::F64, 1e-12, 1e-7, 1e-11),
        (DType::F32, 1e-5, 1e-5, 1e-5),
    ] {
        let vars: Vec<Var> = inputs
            .iter()
            .map(|i| Var::from_tensor(&tensor(&i.values, &i.shape, dtype)).unwrap())
            .collect();
        let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
        let y = op(&ts).unwrap();
        assert_eq!(y.dtype(), dtype, "{case}: output dtype");
        assert_eq!(y.elem_count(), y_ref.len(), "{case}: output size");
        assert_close(
            &format!("{case} {dtype:?} value"),
            &to_f64(&y),
            &y_ref,
            tol_val,
        );
        let rt = tensor(&r, y.dims(), dtype);
        let grads = (y * rt).unwrap().sum_all().unwrap().backward().unwrap();
        for (i, input) in inputs.iter().enumerate() {
            let g = grads
                .get(vars[i].as_tensor())
                .unwrap_or_else(|| panic!("{case} {dtype:?}: no gradient for {}", input.name));
            assert_eq!(
                g.dims(),
                input.shape.as_slice(),
                "{case}: grad shape of {}",
                input.name
            );
            let g = to_f64(g);
            assert!(
                max_abs(&g) > 0.0,
                "{case} {dtype:?}: zero gradient for {}",
                input.name
            );
            let what = format!("{case} {dtype:?} d/d{} vs finite differences", input.name);
            assert_close(&what, &g, &fd[i], tol_fd);
            if let Some(exact) = &exact {
                let what = format!("{case} {dtype:?} d/d{} vs exact formula", input.name);
                assert_close(&what, &g, &exact[i], tol_exact);
            }
        }
    }
}

/// An input of `shape` with seeded values of magnitude up to `scale`.
pub fn input(name: &'static str, shape: &[usize], seed: u64, scale: f64) -> Input {
    let n = shape.iter().product();
    Input {
        name,
        values: Rng::new(seed).vec(n, scale),
        shape: shape.to_vec(),
    }
}
