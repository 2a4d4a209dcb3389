//! The affine map `x · wᵀ + b` with PyTorch's `[out, in]` weight layout, as one fused op
//! with a hand-written backward, optionally followed by GELU, with hooks for tensor
//! parallelism.
//!
//! Forward: one matrix product that writes straight into the output (the bias is placed
//! in the output first and the product accumulates onto it: no zero-fill, no separate
//! bias pass), then GELU in place when asked. Backward: `dX = G·W`, `dW = Gᵀ·X` and
//! `db = Σ_rows G`, three passes over `G`, with `G` first multiplied by GELU's derivative
//! at the saved pre-activation. Candle sees one node instead of matmul, transposes,
//! reshapes, a broadcast add and GELU, so it allocates and accumulates one gradient per
//! input instead of one per intermediate.

use std::borrow::Cow;
use std::sync::{Arc, OnceLock};

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, D,
};
use rayon::prelude::*;

use half::bf16;

use crate::bf16::{grad_as, held_slice, keep, storage_as, widened, Held, HeldMat};
use crate::gelu::{gelu_backward, gelu_forward};
use crate::kernel::{self, matmul, simd, slice, view, Dst, Float, Mat, Uninit};

use crate::{composed, OpsBackend, Precision};

/// A collective that a fused op applies to a tensor it computes, e.g. an all-reduce (sum)
/// over a tensor-parallel group. Every rank of the group must call it in the same order.
pub type Reduce = Arc<dyn Fn(&Tensor) -> Result<Tensor> + Send + Sync>;

/// Produces, in a fused op's backward, the input its forward read (for instance by
/// all-gathering the slices it was gathered from), so that the input need not be kept.
/// Every rank of the group must call it in the same order.
pub type Regather = Arc<dyn Fn() -> Result<Tensor> + Send + Sync>;

/// What [`linear_with`] adds around the product.
#[derive(Clone, Default)]
pub struct LinearOptions {
    /// Apply GELU (tanh approximation) to the result: `gelu(x · wᵀ + b)`.
    pub gelu: bool,
    /// Reduce `x · wᵀ` (before the bias) with this collective: a row-parallel layer's
    /// `g`, fused with its bias. The backward pass is the identity, as for `g`.
    pub reduce_output: Option<Reduce>,
    /// Reduce the input gradient with this collective: a column-parallel layer's `f`.
    pub reduce_input_grad: Option<Reduce>,
    /// The fused kernel or its composed twin ([`OpsBackend`]).
    pub backend: OpsBackend,
    /// What the products multiply in ([`Precision`]); `Bf16` takes f32 tensors.
    pub precision: Precision,
}

/// `y = x · wᵀ + b` for `x` of shape `[.., in]` (rank 2 or 3, e.g. `[N, in]` or
/// `[B, T, in]`), `w` of shape `[out, in]` (PyTorch layout) and an optional bias `[out]`.
/// Returns `[.., out]`.
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    linear_with(x, w, b, &LinearOptions::default())
}

/// `gelu(x · wᵀ + b)` ([`crate::gelu`]'s tanh approximation) in one fused op: the MLP's
/// first layer. Shapes as [`linear`].
pub fn linear_gelu(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let opts = LinearOptions {
        gelu: true,
        ..LinearOptions::default()
    };
    linear_with(x, w, b, &opts)
}

/// [`linear`] with the options of [`LinearOptions`]: GELU after the bias, a collective on
/// the output, a collective on the input gradient.
pub fn linear_with(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    opts: &LinearOptions,
) -> Result<Tensor> {
    check_shapes("linear", x, w, b)?;
    check_precision("linear", opts.precision, x)?;
    let half = x.dtype() == DType::BF16 && opts.precision == Precision::Bf16;
    let fused = match half {
        true => opts.backend.fuses_bf16(x) && w.dtype() == DType::F32,
        false => opts.backend.fuses(x),
    };
    if !fused {
        if half && w.dtype() == DType::F32 {
            // bf16 activations on the composed twin: it multiplies f32 tensors.
            return composed::linear_with(&x.to_dtype(DType::F32)?, w, b, opts)?
                .to_dtype(DType::BF16);
        }
        return composed::linear_with(x, w, b, opts);
    }
    let op = Linear {
        opts: opts.clone(),
        pre: OnceLock::new(),
    };
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, op),
        None => x.apply_op2(&w, op),
    }
}

/// `(out, in)` of a linear layer's weight `w` `[out, in]`, after checking that `x` is
/// `[N, in]` or `[B, T, in]` and the bias `[out]`; errors name `op`.
pub(crate) fn check_shapes(
    op: &str,
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
) -> Result<(usize, usize)> {
    let (out_f, in_f) = match w.dims() {
        &[o, i] => (o, i),
        d => bail!("{op}: the weight must have shape [out, in], got {d:?}"),
    };
    if !(2..=3).contains(&x.rank()) || x.dim(D::Minus1)? != in_f {
        bail!(
            "{op}: the input must have shape [N, {in_f}] or [B, T, {in_f}] for a weight [{out_f}, {in_f}], got {:?}",
            x.dims()
        );
    }
    if let Some(b) = b {
        if b.dims() != [out_f] {
            bail!(
                "{op}: the bias must have shape [{out_f}], got {:?}",
                b.dims()
            );
        }
    }
    Ok((out_f, in_f))
}

/// Refuses [`Precision::Bf16`] for anything but f32 tensors or bf16 activations
/// ([`crate::bf16`]'s `act`); errors name `op`.
pub(crate) fn check_precision(op: &str, precision: Precision, x: &Tensor) -> Result<()> {
    if precision == Precision::Bf16 && !matches!(x.dtype(), DType::F32 | DType::BF16) {
        bail!(
            "{op}: bf16 precision multiplies f32 tensors or bf16 activations (f32 master weights), got {:?}",
            x.dtype()
        );
    }
    Ok(())
}

/// `dst = (Add ? dst : 0) + a · b` at `prec`: the f32 (or f64) product of
/// [`kernel::matmul`], or bf16 products with f32 sums ([`crate::bf16`]).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product<'a, T: Float>(
    prec: Precision,
    m: usize,
    n: usize,
    k: usize,
    dst: Dst<T>,
    ld: usize,
    a: impl Into<HeldMat<'a, T>>,
    b: impl Into<HeldMat<'a, T>>,
) {
    match (prec, a.into(), b.into()) {
        (Precision::F32, HeldMat::Full(a), HeldMat::Full(b)) => {
            matmul(m, n, k, dst, ld, a, b, true)
        }
        (Precision::F32, _, _) => {
            unreachable!("operands are held as bf16 only at bf16 precision")
        }
        (Precision::Bf16, a, b) => T::product_bf16(m, n, k, dst, ld, a, b),
    }
}

/// `x` rounded to bf16 once at [`Precision::Bf16`] (f32), for the products that read
/// it (see [`Held`]); `None` otherwise.
pub(crate) fn halve_at<T: Float>(prec: Precision, x: &[T]) -> Option<Vec<bf16>> {
    match prec {
        Precision::Bf16 => T::halve(x),
        Precision::F32 => None,
    }
}

/// [`halve_at`] of an operand held in its own type; `None` for one held as bf16 already
/// (which the products read as it is): with [`Held::or_half`], the operand as the
/// products read it.
pub(crate) fn halve_held<T: Float>(prec: Precision, x: Held<T>) -> Option<Vec<bf16>> {
    match x {
        Held::Full(x) => halve_at(prec, x),
        Held::Half(_) => None,
    }
}

/// At [`Precision::Bf16`] (f32), `x` rounded to bf16 in place and the same values as
/// bf16 (what the op keeps), in one pass; `None`, `x` left alone, otherwise.
pub(crate) fn round_at<T: Float>(prec: Precision, x: &mut [T]) -> Option<Vec<bf16>> {
    match prec {
        Precision::Bf16 => T::round_halve(x),
        Precision::F32 => None,
    }
}

struct Linear {
    opts: LinearOptions,
    /// The pre-activation, kept for GELU's derivative.
    pre: OnceLock<CpuStorage>,
}

simd! {
    /// Adds `b` to every `b.len()`-wide row of `y`.
    pub(crate) fn add_rows<T>(y: &mut [T], b: &[T]) {
        for row in y.chunks_exact_mut(b.len()) {
            for (v, &c) in row.iter_mut().zip(b) {
                *v += c;
            }
        }
    }
}

simd! {
    /// `acc[j] += Σ_rows g[row, j]` over the `acc.len()`-wide rows of `g`.
    pub(crate) fn col_sums<T>(g: &[T], acc: &mut [T]) {
        for row in g.chunks_exact(acc.len()) {
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += v;
            }
        }
    }
}

/// `Σ_rows g` of a `[rows, width]` matrix, split over the pool's threads.
pub(crate) fn column_sums<T: Float>(g: &[T], width: usize) -> Vec<T> {
    let rows = g.len() / width.max(1);
    let per = kernel::rows_per_task(rows) * width;
    let parts: Vec<Vec<T>> = g
        .par_chunks(per.max(1))
        .map(|chunk| {
            let mut acc = vec![T::zero(); width];
            col_sums(chunk, &mut acc);
            acc
        })
        .collect();
    let mut total = vec![T::zero(); width];
    for p in parts {
        for (t, v) in total.iter_mut().zip(p) {
            *t += v;
        }
    }
    total
}

/// `y = x · wᵀ + b` on raw rows, the forward pass of every affine map here: `x` is
/// `[rows, in]`, `w` `[out, in]` with row stride `ldw` (≥ in; [`crate::mlp`] keeps the
/// bias in column `in`). Without `reduce` the bias is placed first and the product
/// accumulates onto it; with it (a row-parallel `g`), the partial product is reduced
/// and the bias added after.
#[allow(clippy::too_many_arguments)]
pub(crate) fn affine_forward<T: Float>(
    x: Held<T>,
    in_f: usize,
    w: &[T],
    ldw: usize,
    b: Option<&[T]>,
    out: usize,
    reduce: Option<&Reduce>,
    prec: Precision,
) -> Result<Vec<T>> {
    let rows = x.len() / in_f.max(1);
    let mut y = Uninit::<T>::new(rows * out)?;
    let (xm, wm) = (x.rows(in_f), Mat::rows(w, ldw));
    let mut y = match (b, reduce) {
        // At bf16 the product adds the bias block by block (f64 never runs at bf16: its
        // `product_bf16_bias` declines and it goes on to the next arm).
        (Some(b), None)
            if prec == Precision::Bf16
                && T::product_bf16_bias(rows, out, in_f, y.as_mut(), xm, wm.t().into(), b) =>
        {
            // SAFETY: the product wrote all `rows × out` elements (row stride `out`).
            unsafe { y.assume_init() }
        }
        (Some(b), None) => {
            // The bias first, then the product accumulated onto it.
            for row in y.as_mut().chunks_exact_mut(out) {
                for (d, &v) in row.iter_mut().zip(b) {
                    d.write(v);
                }
            }
            // SAFETY: each of the `rows` rows of `out` elements now holds the bias.
            let mut y = unsafe { y.assume_init() };
            product(prec, rows, out, in_f, Dst::Add(&mut y), out, xm, wm.t());
            y
        }
        _ => {
            product(
                prec,
                rows,
                out,
                in_f,
                Dst::Uninit(y.as_mut()),
                out,
                xm,
                wm.t(),
            );
            // SAFETY: the product wrote all `rows × out` elements (row stride `out`).
            unsafe { y.assume_init() }
        }
    };
    if let Some(reduce) = reduce {
        let t = reduce(&kernel::tensor(y, (rows, out))?)?;
        y = t.flatten_all()?.to_vec1::<T>()?;
        if let Some(b) = b {
            add_rows(&mut y, b);
        }
    }
    Ok(y)
}

/// The input gradient of [`affine_forward`]: `dx = G · w` (`G` `[rows, out]`, `w` as
/// there), `[rows, in]`.
pub(crate) fn affine_input_grad<T: Float>(
    g: Held<T>,
    w: &[T],
    ldw: usize,
    in_f: usize,
    out: usize,
    prec: Precision,
) -> Result<Vec<T>> {
    let rows = g.len() / out.max(1);
    let mut dx = Uninit::<T>::new(rows * in_f)?;
    let (gm, wm) = (g.rows(out), Mat::rows(w, ldw));
    product(
        prec,
        rows,
        in_f,
        out,
        Dst::Uninit(dx.as_mut()),
        in_f,
        gm,
        wm,
    );
    // SAFETY: the product wrote all `rows × in` elements (row stride `in`).
    Ok(unsafe { dx.assume_init() })
}

/// The gradient of the op's input `x` from [`affine_input_grad`], as a tensor of `x`'s
/// shape reduced by `reduce` (a column-parallel `f`); `None` when `x` needs none.
#[allow(clippy::too_many_arguments)]
pub(crate) fn input_grad<T: Float>(
    x: &Tensor,
    g: Held<T>,
    w: &[T],
    ldw: usize,
    in_f: usize,
    out: usize,
    reduce: Option<&Reduce>,
    prec: Precision,
) -> Result<Option<Tensor>> {
    if !x.track_op() {
        return Ok(None);
    }
    let dx = affine_input_grad(g, w, ldw, in_f, out, prec)?;
    let dx = kernel::tensor(dx, x.shape().clone())?;
    let dx = match reduce {
        Some(reduce) => reduce(&dx)?,
        None => dx,
    };
    // Summed in f32, then in the input's dtype (rounded once for a bf16 activation).
    Ok(Some(grad_as(dx, x.dtype())?))
}

/// The weight gradient of [`affine_forward`] as `[out, ld]` rows: `Gᵀ · x` in the first
/// `in` columns and, with `bias` (`Σ_rows G`, [`column_sums`]; `ld = in + 1`), the bias's
/// gradient in the last.
pub(crate) fn affine_weight_grad<T: Float>(
    g: Held<T>,
    x: Held<T>,
    in_f: usize,
    out: usize,
    ld: usize,
    bias: Option<Vec<T>>,
    prec: Precision,
) -> Result<Vec<T>> {
    let rows = x.len() / in_f.max(1);
    let bias_column = bias.is_some();
    if ld != in_f + bias_column as usize {
        bail!("affine_weight_grad: row stride {ld} for {in_f} inputs (bias column {bias_column})")
    }
    let mut dw = Uninit::<T>::new(out * ld)?;
    let (gm, xm) = (g.rows(out), x.rows(in_f));
    product(
        prec,
        out,
        in_f,
        rows,
        Dst::Uninit(dw.as_mut()),
        ld,
        gm.t(),
        xm,
    );
    if let Some(sums) = bias {
        let dw = dw.as_mut();
        for (i, v) in sums.into_iter().enumerate() {
            dw[i * ld + in_f].write(v);
        }
    }
    // SAFETY: the product wrote columns 0..in of each of the `out` rows and, with a
    // bias column (`ld = in + 1`, checked above), the loop wrote column `in`.
    Ok(unsafe { dw.assume_init() })
}

impl Linear {
    fn name(&self) -> &'static str {
        if self.opts.gelu {
            "switchyard-linear-gelu"
        } else {
            "switchyard-linear"
        }
    }

    fn forward<T: Float>(
        &self,
        x: Held<T>,
        w: &[T],
        b: Option<&[T]>,
        shape: &Shape,
        w_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (out_f, in_f) = w_layout.shape().dims2()?;
        let reduce = self.opts.reduce_output.as_ref();
        let prec = self.opts.precision;
        // A bf16 activation in, a bf16 activation out (rounded once, after any sum).
        let half_out = matches!(x, Held::Half(_));
        let mut y = affine_forward(x, in_f, w, in_f, b, out_f, reduce, prec)?;
        let mut out_dims = shape.dims().to_vec();
        *out_dims.last_mut().expect("rank ≥ 2") = out_f;
        if !self.opts.gelu {
            return Ok((storage_as(y, half_out)?, Shape::from(out_dims)));
        }
        // At bf16 GELU and the backward see the same (bf16) values.
        let half = round_at(prec, &mut y);
        let out = gelu_forward(&y)?;
        let _ = self.pre.set(keep(y, half));
        Ok((storage_as(out, half_out)?, Shape::from(out_dims)))
    }

    /// `(dx, dw, db)`; `dx` only when `need_dx`.
    #[allow(clippy::type_complexity)]
    fn backward<T: Float>(
        &self,
        x: &Tensor,
        w: &Tensor,
        has_bias: bool,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Tensor, Option<Tensor>)> {
        let name = self.name();
        let (out_f, in_f) = w.dims2()?;
        let grad = grad.contiguous()?;
        let (xv, wv, gv) = (view(x, name)?, view(w, name)?, view(&grad, name)?);
        let (xs, ws, g_in) = (xv.held::<T>()?, wv.get::<T>()?, gv.held::<T>()?);
        let g: Cow<[T]> = if self.opts.gelu {
            let Some(pre) = self.pre.get() else {
                bail!("{name}: backward before forward")
            };
            Cow::Owned(gelu_backward(&T::kept(pre)?, &widened(g_in)?)?)
        } else {
            widened(g_in)?
        };
        let reduce = self.opts.reduce_input_grad.as_ref();
        let prec = self.opts.precision;
        let db = match has_bias {
            true => Some(kernel::tensor(column_sums(&g, out_f), out_f)?),
            false => None,
        };
        // Both products read `G`: at bf16 it is rounded once, not packed from f32 twice
        // (a bf16 `G`, the gradient of a bf16 output, is read as it is).
        let g_in = match self.opts.gelu {
            true => Held::Full(&g[..]),
            false => g_in,
        };
        let half = halve_held(prec, g_in);
        let gh = g_in.or_half(half.as_deref());
        let dx = input_grad(x, gh, ws, in_f, in_f, out_f, reduce, prec)?;
        let dw = affine_weight_grad(gh, xs, in_f, out_f, in_f, None, prec)?;
        let dw = kernel::tensor(dw, (out_f, in_f))?;
        Ok((dx, dw, db))
    }
}

impl CustomOp3 for Linear {
    fn name(&self) -> &'static str {
        Linear::name(self)
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
        let n = Linear::name(self);
        match s1.dtype() {
            DType::F32 | DType::BF16 => self.forward::<f32>(
                held_slice(s1, l1, n)?,
                slice(s2, l2, n)?,
                Some(slice(s3, l3, n)?),
                l1.shape(),
                l2,
            ),
            DType::F64 => self.forward::<f64>(
                held_slice(s1, l1, n)?,
                slice(s2, l2, n)?,
                Some(slice(s3, l3, n)?),
                l1.shape(),
                l2,
            ),
            d => bail!("{n}: unsupported dtype {d:?}"),
        }
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
            DType::F32 | DType::BF16 => self.backward::<f32>(x, w, true, grad)?,
            _ => self.backward::<f64>(x, w, true, grad)?,
        };
        Ok((dx, Some(dw), db))
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        Linear::name(self)
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let n = Linear::name(self);
        match s1.dtype() {
            DType::F32 | DType::BF16 => {
                let x = held_slice(s1, l1, n)?;
                self.forward::<f32>(x, slice(s2, l2, n)?, None, l1.shape(), l2)
            }
            DType::F64 => {
                let x = held_slice(s1, l1, n)?;
                self.forward::<f64>(x, slice(s2, l2, n)?, None, l1.shape(), l2)
            }
            d => bail!("{n}: unsupported dtype {d:?}"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = match x.dtype() {
            DType::F32 | DType::BF16 => self.backward::<f32>(x, w, false, grad)?,
            _ => self.backward::<f64>(x, w, false, grad)?,
        };
        Ok((dx, Some(dw)))
    }
}
