//! LayerNorm over the last dim, differentiable in the input, the weight and the bias: one
//! fused op forward (mean, variance and the affine map in one pass per row) and one
//! backward (the input, weight and bias gradients in one pass per row).
//!
//! With `x̂ = (x − μ)·r`, `r = 1/√(σ² + ε)` and `ĝ = g ⊙ w` per row of `d` elements:
//! `dx = r · (ĝ − mean(ĝ) − x̂ · mean(ĝ ⊙ x̂))`, `dw = Σ_rows g ⊙ x̂`, `db = Σ_rows g`.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType, D,
};
use rayon::prelude::*;

use half::bf16;

use crate::bf16::{half_slice, round_into, widen_into, Held};
use crate::gelu::written;
use crate::kernel::{self, dot, simd, slice, sum, sum_sq_dev, view, Float, Uninit};
use crate::{composed, OpsBackend};

/// LayerNorm over the last dim of `x`:
/// `y = (x − mean(x)) / sqrt(var(x) + eps) · weight + bias`, where `var` is the biased
/// (population) variance, as in PyTorch. `weight` and `bias` have shape `[d]`, `d` the
/// size of the last dim of `x`. GPT-2 uses `eps = 1e-5`.
///
/// Every input receives a gradient (candle-nn's `ops::layer_norm` has no backward).
pub fn layer_norm(x: &Tensor, weight: &Tensor, bias: &Tensor, eps: f64) -> Result<Tensor> {
    layer_norm_on(OpsBackend::Fused, x, weight, bias, eps)
}

pub(crate) fn layer_norm_on(
    backend: OpsBackend,
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    eps: f64,
) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    if weight.dims() != [d] || bias.dims() != [d] {
        bail!(
            "layer_norm: weight {:?} and bias {:?} must both have shape [{d}] (the last dim of x {:?})",
            weight.dims(),
            bias.dims(),
            x.dims()
        );
    }
    // A bf16 activation with f32 parameters (`Precision::Bf16`): statistics in f32, the
    // output bf16.
    let half = x.dtype() == DType::BF16 && weight.dtype() == DType::F32;
    if !(backend.fuses(x) || (half && backend.fuses_bf16(x))) {
        if half {
            let y = composed::layer_norm(&x.to_dtype(DType::F32)?, weight, bias, eps)?;
            return y.to_dtype(DType::BF16);
        }
        return composed::layer_norm(x, weight, bias, eps);
    }
    let op = LayerNorm {
        eps,
        stats: OnceLock::new(),
    };
    x.contiguous()?
        .apply_op3(&weight.contiguous()?, &bias.contiguous()?, op)
}

struct LayerNorm {
    eps: f64,
    /// Per row: the mean and `1/√(σ² + ε)`, interleaved.
    stats: OnceLock<CpuStorage>,
}

simd! {
    /// Normalises the `w.len()`-wide rows of `x` into `y` (writing every element of the
    /// rows of `x`), recording each row's mean and reciprocal standard deviation in
    /// `stats` (two per row).
    pub(crate) fn ln_rows<T>(x: &[T], w: &[T], b: &[T], eps: f64, y: &mut [MaybeUninit<T>], stats: &mut [MaybeUninit<T>]) {
        let d = w.len();
        let inv_d = T::from_f64(1.0 / d as f64);
        let eps = T::from_f64(eps);
        for ((xr, yr), st) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)).zip(stats.chunks_exact_mut(2)) {
            let mean = sum(xr) * inv_d;
            let var = sum_sq_dev(xr, mean) * inv_d;
            let r = T::one() / (var + eps).sqrt();
            for (((y, &x), &w), &b) in yr.iter_mut().zip(xr).zip(w).zip(b) {
                y.write((x - mean) * r * w + b);
            }
            st[0].write(mean);
            st[1].write(r);
        }
    }
}

simd! {
    /// The backward pass over rows: writes every element of `dx` (of the rows of `x`)
    /// and accumulates `dw`, `db`. `xh` and `gh` are scratch of one row each.
    pub(crate) fn ln_rows_bwd<T>(x: &[T], g: &[T], w: &[T], stats: &[T], dx: &mut [MaybeUninit<T>], dw: &mut [T], db: &mut [T], xh: &mut [T], gh: &mut [T]) {
        let d = w.len();
        let inv_d = T::from_f64(1.0 / d as f64);
        let rows = x.chunks_exact(d).zip(g.chunks_exact(d)).zip(dx.chunks_exact_mut(d));
        for (((xr, gr), dxr), st) in rows.zip(stats.chunks_exact(2)) {
            let (mean, r) = (st[0], st[1]);
            // xh = x̂; gh = ĝ = g ⊙ w
            for (t, &x) in xh.iter_mut().zip(xr) {
                *t = (x - mean) * r;
            }
            for ((o, &g), &w) in gh.iter_mut().zip(gr).zip(w) {
                *o = g * w;
            }
            let m1 = sum(gh) * inv_d;
            let m2 = dot(gh, xh) * inv_d;
            for ((o, &gv), &t) in dxr.iter_mut().zip(gh.iter()).zip(xh.iter()) {
                o.write(r * (gv - m1 - t * m2));
            }
            for (((dw, db), &g), &t) in dw.iter_mut().zip(db.iter_mut()).zip(gr).zip(xh.iter()) {
                *dw += g * t;
                *db += g;
            }
        }
    }
}

impl LayerNorm {
    /// The forward's plumbing, whatever the rows hold: checks that `x` is whole rows of
    /// `d`, runs `rows(x, y, stats)` on matching chunks of rows in parallel, and keeps
    /// the statistics (two per row) for the backward.
    fn forward_rows<X: Sync, Y: WithDType, S: WithDType>(
        &self,
        x: &[X],
        d: usize,
        bias: usize,
        rows: impl Fn(&[X], &mut [MaybeUninit<Y>], &mut [MaybeUninit<S>]) + Sync,
    ) -> Result<Vec<Y>> {
        let n = x.len() / d.max(1);
        if d == 0 || !x.len().is_multiple_of(d) || bias != d {
            bail!(
                "switchyard-layer-norm: {} inputs in rows of {d} (bias {bias})",
                x.len()
            )
        }
        let mut y = Uninit::<Y>::new(x.len())?;
        let mut stats = Uninit::<S>::new(2 * n)?;
        let per = kernel::rows_per_task(n);
        y.as_mut()
            .par_chunks_mut(per * d)
            .zip(
                x.par_chunks(per * d)
                    .zip(stats.as_mut().par_chunks_mut(per * 2)),
            )
            .for_each(|(y, (x, st))| rows(x, y, st));
        // SAFETY: `x` is `n` whole rows (checked above); the chunks of `y`, `x` and
        // `stats` pair up (`per` rows each) and every `rows` writes every row of its
        // chunk of `y` and both statistics of each row.
        let (y, stats) = unsafe { (y.assume_init(), stats.assume_init()) };
        let _ = self.stats.set(S::to_cpu_storage_owned(stats));
        Ok(y)
    }

    /// The backward's plumbing, whatever the rows hold: checks the lengths, runs
    /// `rows(x, g, stats, dx, dw, db)` on matching chunks of rows in parallel (`dw`, `db`
    /// zeroed sums of each chunk), and adds up the chunks' sums: `(dx, dw, db)`.
    #[allow(clippy::type_complexity)]
    fn backward_rows<X: Sync, Dx: WithDType, T: Float>(
        &self,
        (x, g): (&[X], &[X]),
        d: usize,
        rows: impl Fn(&[X], &[X], &[T], &mut [MaybeUninit<Dx>], &mut [T], &mut [T]) + Sync,
    ) -> Result<(Vec<Dx>, Vec<T>, Vec<T>)> {
        let name = "switchyard-layer-norm";
        let Some(stats) = self.stats.get() else {
            bail!("{name}: backward before forward")
        };
        let stats = T::cpu_storage_as_slice(stats)?;
        let n = x.len() / d.max(1);
        if d == 0 || !x.len().is_multiple_of(d) || g.len() != x.len() || stats.len() != 2 * n {
            bail!(
                "{name}: {} inputs, {} gradients in rows of {d}",
                x.len(),
                g.len()
            )
        }
        let per = kernel::rows_per_task(n);
        let mut dx = Uninit::<Dx>::new(x.len())?;
        let parts: Vec<(Vec<T>, Vec<T>)> = dx
            .as_mut()
            .par_chunks_mut(per * d)
            .zip(x.par_chunks(per * d).zip(g.par_chunks(per * d)))
            .zip(stats.par_chunks(per * 2))
            .map(|((dx, (x, g)), st)| {
                let (mut dw, mut db) = (vec![T::zero(); d], vec![T::zero(); d]);
                rows(x, g, st, dx, &mut dw, &mut db);
                (dw, db)
            })
            .collect();
        // SAFETY: whole rows (checked above); the chunks pair up and every `rows` writes
        // every row of its chunk of `dx`.
        let dx = unsafe { dx.assume_init() };
        let (mut dw, mut db) = (vec![T::zero(); d], vec![T::zero(); d]);
        for (pw, pb) in parts {
            dw.iter_mut().zip(pw).for_each(|(a, v)| *a += v);
            db.iter_mut().zip(pb).for_each(|(a, v)| *a += v);
        }
        Ok((dx, dw, db))
    }

    fn forward<T: Float>(&self, x: &[T], w: &[T], b: &[T]) -> Result<Vec<T>> {
        self.forward_rows(x, w.len(), b.len(), |x, y, st| {
            ln_rows(x, w, b, self.eps, y, st)
        })
    }

    fn backward<T: Float>(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let name = "switchyard-layer-norm";
        let grad = grad.contiguous()?;
        let (xv, wv, gv) = (view(x, name)?, view(w, name)?, view(&grad, name)?);
        let (xs, ws, g) = (xv.get::<T>()?, wv.get::<T>()?, gv.get::<T>()?);
        let d = ws.len();
        let (dx, dw, db) = self.backward_rows((xs, g), d, |x, g, st, dx, dw, db| {
            let (mut xh, mut gh) = (vec![T::zero(); d], vec![T::zero(); d]);
            ln_rows_bwd(x, g, ws, st, dx, dw, db, &mut xh, &mut gh);
        })?;
        Ok((
            kernel::tensor(dx, x.shape().clone())?,
            kernel::tensor(dw, d)?,
            kernel::tensor(db, d)?,
        ))
    }

    /// The bf16 activations' LayerNorm ([`crate::bf16`]'s `act`): each row widened to
    /// f32, normalised in f32 with f32 statistics by the f32 kernel, and rounded to bf16
    /// once.
    fn forward_half(&self, x: &[bf16], w: &[f32], b: &[f32]) -> Result<Vec<bf16>> {
        let d = w.len();
        self.forward_rows(x, d, b.len(), |x, y, st| {
            let (mut xw, mut yw) = (vec![0f32; d], vec![MaybeUninit::<f32>::uninit(); d]);
            let rows = y.chunks_exact_mut(d).zip(x.chunks_exact(d));
            for ((yr, xr), st) in rows.zip(st.chunks_exact_mut(2)) {
                widen_into::<f32>(xr, &mut xw);
                ln_rows(&xw, w, b, self.eps, &mut yw, st);
                // SAFETY: `ln_rows` wrote the whole row `yw` (`d` elements).
                round_into::<f32>(unsafe { written(&yw, d) }, yr);
            }
        })
    }

    /// `(dx, dw, db)` for a bf16 input and output gradient: each row widened, the f32
    /// backward, `dx` rounded to bf16.
    fn backward_half(
        &self,
        x: &Tensor,
        w: &Tensor,
        grad: &Tensor,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let name = "switchyard-layer-norm";
        let grad = grad.contiguous()?;
        let (xv, wv, gv) = (view(x, name)?, view(w, name)?, view(&grad, name)?);
        let (Held::Half(xs), ws, Held::Half(g)) =
            (xv.held::<f32>()?, wv.get::<f32>()?, gv.held::<f32>()?)
        else {
            bail!("{name}: a bf16 input takes a bf16 gradient")
        };
        let d = ws.len();
        let (dx, dw, db) = self.backward_rows((xs, g), d, |x, g, st, dx, dw, db| {
            let [mut xh, mut gh, mut xw, mut gw] = [(); 4].map(|_| vec![0f32; d]);
            let mut dxw = vec![MaybeUninit::<f32>::uninit(); d];
            let rows = dx
                .chunks_exact_mut(d)
                .zip(x.chunks_exact(d))
                .zip(g.chunks_exact(d));
            for (((dxr, xr), gr), st) in rows.zip(st.chunks_exact(2)) {
                widen_into::<f32>(xr, &mut xw);
                widen_into::<f32>(gr, &mut gw);
                ln_rows_bwd(&xw, &gw, ws, st, &mut dxw, dw, db, &mut xh, &mut gh);
                // SAFETY: `ln_rows_bwd` wrote the whole row `dxw` (`d` elements).
                round_into::<f32>(unsafe { written(&dxw, d) }, dxr);
            }
        })?;
        Ok((
            Tensor::from_vec(dx, x.shape().clone(), x.device())?,
            kernel::tensor(dw, d)?,
            kernel::tensor(db, d)?,
        ))
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        "switchyard-layer-norm"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = self.name();
        let out = match s1.dtype() {
            DType::F32 => CpuStorage::F32(self.forward::<f32>(
                slice(s1, l1, n)?,
                slice(s2, l2, n)?,
                slice(s3, l3, n)?,
            )?),
            DType::F64 => CpuStorage::F64(self.forward::<f64>(
                slice(s1, l1, n)?,
                slice(s2, l2, n)?,
                slice(s3, l3, n)?,
            )?),
            DType::BF16 => {
                let Some(x) = half_slice(s1, l1, n)? else {
                    unreachable!("a bf16 storage")
                };
                CpuStorage::BF16(self.forward_half(x, slice(s2, l2, n)?, slice(s3, l3, n)?)?)
            }
            d => bail!("{n}: unsupported dtype {d:?}"),
        };
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, db) = match x.dtype() {
            DType::F32 => self.backward::<f32>(x, w, grad)?,
            DType::BF16 => self.backward_half(x, w, grad)?,
            _ => self.backward::<f64>(x, w, grad)?,
        };
        let dx = x.track_op().then_some(dx);
        Ok((dx, Some(dw), Some(db)))
    }
}
