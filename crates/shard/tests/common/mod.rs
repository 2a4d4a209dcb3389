//! Shared test harness: running a tensor-parallel group, single-device reference math in
//! plain candle ops, and comparing parallel results (merged with `ShardSpec::merge`)
//! with the reference.
//!
//! Tolerance ("relative", per tensor, in the max norm):
//! `max|a − b| ≤ tol · max|b|`, with `tol` = 1e-5 in f32 and 1e-10 in f64.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Result, Tensor, Var, D};
use switchyard_comm::{local, Communicator};
use switchyard_shard::{Init, ParamSource, ParamStore, ShardSpec};

pub const SEED: u64 = 20240601;
pub const TPS: [usize; 3] = [1, 2, 4];
pub const DTYPES: [DType; 2] = [DType::F32, DType::F64];

/// Runs `f` on every rank of a tensor-parallel group of `tp` threads.
pub fn run_tp<T: Send>(tp: usize, f: impl Fn(Arc<dyn Communicator>) -> Result<T> + Sync) -> Vec<T> {
    local::launch(tp, f).unwrap_or_else(|e| panic!("tp = {tp}: {e}"))
}

pub fn tol(dtype: DType) -> f64 {
    match dtype {
        DType::F64 => 1e-10,
        _ => 1e-5,
    }
}

fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// `max|got − want| ≤ tol(dtype) · max|want|`, and equal shapes.
pub fn assert_close(what: &str, got: &Tensor, want: &Tensor, dtype: DType) {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    let (g, w) = (to_f64(got), to_f64(want));
    assert!(g.iter().all(|v| v.is_finite()), "{what}: non-finite values");
    let err = g
        .iter()
        .zip(&w)
        .fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
    let scale = w.iter().fold(0.0f64, |m, b| m.max(b.abs()));
    let tol = tol(dtype);
    assert!(
        err <= tol * scale,
        "{what} ({dtype:?}): max abs error {err:e} > {tol:e} × max|want| {scale:e}"
    );
}

/// A deterministic random tensor (xorshift, independent of the crate's generator),
/// uniform in [-scale, scale), made in f64 and converted to `dtype`.
pub fn rand_tensor(seed: u64, shape: &[usize], scale: f64, dtype: DType) -> Tensor {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let n: usize = shape.iter().product();
    let v: Vec<f64> = (0..n)
        .map(|_| {
            s ^= s >> 12;
            s ^= s << 25;
            s ^= s >> 27;
            let bits = s.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11;
            ((bits as f64) / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

pub fn var(t: &Tensor) -> Var {
    Var::from_tensor(t).unwrap()
}

pub fn store(comm: &Arc<dyn Communicator>, dtype: DType) -> ParamStore {
    ParamStore::for_group(comm.as_ref(), dtype, ParamSource::Init { seed: SEED }).unwrap()
}

// ------------------------------------------------------------------ parallel side

/// One rank's results: the output, the input gradient, and every parameter's local
/// gradient with its spec.
pub struct RankOut {
    pub y: Tensor,
    pub dx: Option<Tensor>,
    pub grads: BTreeMap<String, (ShardSpec, Tensor)>,
}

/// Every parameter of `store` must have a gradient in `grads`.
pub fn param_grads(store: &ParamStore, grads: &GradStore) -> BTreeMap<String, (ShardSpec, Tensor)> {
    store
        .params()
        .into_iter()
        .map(|p| {
            let g = grads
                .get(p.var.as_tensor())
                .unwrap_or_else(|| panic!("no gradient for parameter {}", p.name))
                .clone();
            (p.name, (p.spec, g))
        })
        .collect()
}

/// Runs one forward and backward per rank: `f` builds the layer(s) from the rank's
/// store and returns the output and (optionally) the input Var; the loss is
/// `Σ y ⊙ r_local`, where `r_local` is `out_spec`'s shard of `r`.
pub fn run_parallel(
    tp: usize,
    dtype: DType,
    out_spec: ShardSpec,
    r: &Tensor,
    f: impl Fn(&Arc<dyn Communicator>, &ParamStore) -> Result<(Tensor, Option<Var>)> + Sync,
) -> Vec<RankOut> {
    run_tp(tp, |comm| {
        let store = store(&comm, dtype);
        let (y, x) = f(&comm, &store)?;
        let r_local = out_spec.shard(&r.to_dtype(dtype)?, comm.rank(), tp)?;
        let grads = (&y * r_local)?.sum_all()?.backward()?;
        let dx = x.map(|x| grads.get(x.as_tensor()).expect("no input gradient").clone());
        Ok(RankOut {
            y,
            dx,
            grads: param_grads(&store, &grads),
        })
    })
}

/// Merges per-rank pieces with `spec`; for `Replicated` also checks that every rank
/// holds the same value.
pub fn merge(what: &str, spec: ShardSpec, parts: &[Tensor], dtype: DType) -> Tensor {
    if spec == ShardSpec::Replicated {
        for (r, p) in parts.iter().enumerate() {
            assert_close(&format!("{what} (rank {r} vs rank 0)"), p, &parts[0], dtype);
        }
    }
    spec.merge(parts).unwrap()
}

/// Compares the merged parallel output, input gradient and parameter gradients with the
/// single-device reference.
pub fn check_parity(
    case: &str,
    dtype: DType,
    ranks: &[RankOut],
    out_spec: ShardSpec,
    reference: &Reference,
    dx_spec: ShardSpec,
) {
    let tp = ranks.len();
    let case = format!("{case} tp={tp}");
    let ys: Vec<Tensor> = ranks.iter().map(|r| r.y.clone()).collect();
    let y = merge(&format!("{case} output"), out_spec, &ys, dtype);
    assert_close(&format!("{case} output"), &y, &reference.y, dtype);
    if let Some(dx_ref) = &reference.dx {
        let dxs: Vec<Tensor> = ranks.iter().map(|r| r.dx.clone().expect("dx")).collect();
        let dx = merge(&format!("{case} input grad"), dx_spec, &dxs, dtype);
        assert_close(&format!("{case} input grad"), &dx, dx_ref, dtype);
    }
    let names: Vec<&String> = ranks[0].grads.keys().collect();
    let ref_names: Vec<&String> = reference.grads.keys().collect();
    assert_eq!(names, ref_names, "{case}: parameter names");
    for (name, (spec, _)) in &ranks[0].grads {
        let parts: Vec<Tensor> = ranks.iter().map(|r| r.grads[name].1.clone()).collect();
        let what = format!("{case} grad of {name}");
        let g = merge(&what, *spec, &parts, dtype);
        assert_close(&what, &g, &reference.grads[name], dtype);
    }
}

// ------------------------------------------------------------------ reference side

/// Full single-device weights, generated from the same `(SEED, name, Init)` as the
/// parallel stores, as plain Vars.
pub struct RefParams {
    pub dtype: DType,
    pub vars: BTreeMap<String, Var>,
}

impl RefParams {
    pub fn new(dtype: DType) -> Self {
        RefParams {
            dtype,
            vars: BTreeMap::new(),
        }
    }

    pub fn p(&mut self, name: &str, shape: &[usize], init: Init) -> Tensor {
        let t = init.full_tensor(SEED, name, shape, self.dtype).unwrap();
        let v = var(&t);
        self.vars.insert(name.to_string(), v.clone());
        v.as_tensor().clone()
    }
}

/// The reference results: output, input gradient, and full parameter gradients.
pub struct Reference {
    pub y: Tensor,
    pub dx: Option<Tensor>,
    pub grads: BTreeMap<String, Tensor>,
}

/// Backward of `Σ y ⊙ r` on the reference.
pub fn reference(params: &RefParams, y: Tensor, x: Option<&Var>, r: &Tensor) -> Reference {
    let grads = (&y * r.to_dtype(params.dtype).unwrap())
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    Reference {
        dx: x.map(|x| grads.get(x.as_tensor()).unwrap().clone()),
        grads: params
            .vars
            .iter()
            .map(|(n, v)| (n.clone(), grads.get(v.as_tensor()).unwrap().clone()))
            .collect(),
        y,
    }
}

/// `x · wᵀ + b`, plain candle.
pub fn ref_linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Tensor {
    let y = x.broadcast_matmul(&w.t().unwrap()).unwrap();
    match b {
        Some(b) => y.broadcast_add(b).unwrap(),
        None => y,
    }
}

/// GELU, tanh approximation, from primitives.
pub fn ref_gelu(x: &Tensor) -> Tensor {
    let c = (2.0 / std::f64::consts::PI).sqrt();
    let cube = x.sqr().unwrap().mul(x).unwrap();
    let inner = ((cube * 0.044715).unwrap() + x).unwrap();
    let t = (inner * c).unwrap().tanh().unwrap();
    ((t + 1.0).unwrap() * x).unwrap().affine(0.5, 0.0).unwrap()
}

/// LayerNorm over the last dim, from primitives.
pub fn ref_layer_norm(x: &Tensor, w: &Tensor, b: &Tensor) -> Tensor {
    let mean = x.mean_keepdim(D::Minus1).unwrap();
    let xc = x.broadcast_sub(&mean).unwrap();
    let var = xc.sqr().unwrap().mean_keepdim(D::Minus1).unwrap();
    let denom = (var + 1e-5).unwrap().sqrt().unwrap();
    xc.broadcast_div(&denom)
        .unwrap()
        .broadcast_mul(w)
        .unwrap()
        .broadcast_add(b)
        .unwrap()
}

/// GPT attention on the full weights: qkv rows q | k | v, `n_head` heads, causal.
pub fn ref_attention(
    x: &Tensor,
    w_attn: &Tensor,
    b_attn: &Tensor,
    w_proj: &Tensor,
    b_proj: &Tensor,
    n_head: usize,
) -> Tensor {
    let (b, t, d) = x.dims3().unwrap();
    let hd = d / n_head;
    let qkv = ref_linear(x, w_attn, Some(b_attn));
    let heads = |k: usize| {
        qkv.narrow(2, k * d, d)
            .unwrap()
            .reshape((b, t, n_head, hd))
            .unwrap()
            .transpose(1, 2)
            .unwrap()
            .contiguous()
            .unwrap()
    };
    let (q, k, v) = (heads(0), heads(1), heads(2));
    let att = (q.matmul(&k.t().unwrap()).unwrap() / (hd as f64).sqrt()).unwrap();
    let mask: Vec<f64> = (0..t)
        .flat_map(|i| (0..t).map(move |j| if j > i { f64::NEG_INFINITY } else { 0.0 }))
        .collect();
    let mask = Tensor::from_vec(mask, (t, t), &Device::Cpu)
        .unwrap()
        .to_dtype(x.dtype())
        .unwrap();
    let att = att.broadcast_add(&mask).unwrap();
    let e = att
        .broadcast_sub(&att.max_keepdim(D::Minus1).unwrap())
        .unwrap()
        .exp()
        .unwrap();
    let p = e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap();
    let y = p
        .matmul(&v)
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((b, t, d))
        .unwrap();
    ref_linear(&y, w_proj, Some(b_proj))
}

/// Full-tensor map of the reference weights (for `ParamSource::Full`).
pub fn full_map(params: &RefParams) -> HashMap<String, Tensor> {
    params
        .vars
        .iter()
        .map(|(n, v)| (n.clone(), v.as_detached_tensor()))
        .collect()
}
