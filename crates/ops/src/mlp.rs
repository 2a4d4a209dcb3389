//! A transformer's MLP, `m = gelu(x · w1ᵀ + b1) · w2ᵀ + b2`, as one op with a hand-written
//! backward, with the hooks of tensor parallelism (Megatron's column-then-row pair:
//! `f` on the input gradient, `g` on the output before `b2`).
//!
//! As two [`crate::linear_with`] ops, the `[N, hidden]` activation between them is a
//! tensor of candle's graph, so backward allocates a zeroed gradient for it and adds the
//! second op's gradient into that: 4 × the activation's bytes of memory traffic (16 MiB
//! at the reference workload's 4,096 tokens × 1,024) that does nothing. Here it stays
//! inside the op.
//!
//! Candle's custom ops take at most three inputs, so each bias travels as the last
//! column of its weight (`[w | b]`, built with `Tensor::cat`, whose backward hands the
//! two parts of the gradient back to the weight and the bias): parameter-sized copies,
//! against activation-sized savings.
//!
//! Forward: `pre = x·w1ᵀ + b1` (bias placed first, product accumulated onto it), `h =
//! gelu(pre)`, `m = h·w2ᵀ` (+ `g`) `+ b2`; keeps `pre` and `h`. Backward, from `G`:
//! `dw2 = Gᵀ·h`, `db2 = Σ_rows G`, `dh = G·w2`, `dpre = gelu′(pre) ⊙ dh`,
//! `dw1 = dpreᵀ·x`, `db1 = Σ_rows dpre`, `dx = dpre·w1` (+ `f`).

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor, D};

use crate::gelu::{gelu_backward_slice, gelu_forward_slice};
use crate::kernel::{self, matmul, slice, uninit, view, Float, Mat};
use crate::linear::{add_rows, column_sums, Reduce};
use crate::LinearOptions;

/// The collectives around [`mlp`] (tensor parallelism).
#[derive(Clone, Default)]
pub struct MlpOptions {
    /// Reduce `h · w2ᵀ` (before `b2`) with this collective: the row-parallel layer's `g`.
    /// Its backward pass is the identity.
    pub reduce_output: Option<Reduce>,
    /// Reduce the input gradient with this collective: the column-parallel layer's `f`.
    pub reduce_input_grad: Option<Reduce>,
}

/// `gelu(x · w1ᵀ + b1) · w2ᵀ + b2` for `x` `[.., d]` (rank 2 or 3), `w1` `[hidden, d]`,
/// `b1` `[hidden]`, `w2` `[out, hidden]`, `b2` `[out]` (PyTorch layouts; GELU is the tanh
/// approximation of [`crate::gelu`]). Returns `[.., out]`.
#[allow(clippy::too_many_arguments)]
pub fn mlp(
    x: &Tensor,
    w1: &Tensor,
    b1: Option<&Tensor>,
    w2: &Tensor,
    b2: Option<&Tensor>,
    opts: &MlpOptions,
) -> Result<Tensor> {
    let (hidden, d) = w1.dims2()?;
    let (out, h2) = w2.dims2()?;
    if h2 != hidden || !(2..=3).contains(&x.rank()) || x.dim(D::Minus1)? != d {
        bail!(
            "mlp: shapes must be x [.., d], w1 [hidden, d], w2 [out, hidden]; got x {:?}, w1 {:?}, w2 {:?}",
            x.dims(),
            w1.dims(),
            w2.dims()
        );
    }
    for (b, n, name) in [(b1, hidden, "b1"), (b2, out, "b2")] {
        if let Some(b) = b {
            if b.dims() != [n] {
                bail!("mlp: {name} must have shape [{n}], got {:?}", b.dims());
            }
        }
    }
    if !matches!(x.dtype(), DType::F32 | DType::F64) {
        // Other dtypes: the two linear ops.
        let first = LinearOptions {
            gelu: true,
            reduce_input_grad: opts.reduce_input_grad.clone(),
            ..LinearOptions::default()
        };
        let second = LinearOptions {
            reduce_output: opts.reduce_output.clone(),
            ..LinearOptions::default()
        };
        let h = crate::linear_with(x, w1, b1, &first)?;
        return crate::linear_with(&h, w2, b2, &second);
    }
    let with_bias = |w: &Tensor, b: Option<&Tensor>| match b {
        Some(b) => Tensor::cat(&[w, &b.unsqueeze(1)?], 1),
        None => w.contiguous(),
    };
    let op = Mlp {
        opts: opts.clone(),
        d,
        hidden,
        out,
        bias: [b1.is_some(), b2.is_some()],
        saved: OnceLock::new(),
    };
    x.contiguous()?
        .apply_op3(&with_bias(w1, b1)?, &with_bias(w2, b2)?, op)
}

struct Mlp {
    opts: MlpOptions,
    d: usize,
    hidden: usize,
    out: usize,
    /// Whether `w1` and `w2` carry a bias column.
    bias: [bool; 2],
    /// `pre` and `h = gelu(pre)`, for the backward pass.
    saved: OnceLock<(CpuStorage, CpuStorage)>,
}

impl Mlp {
    const NAME: &'static str = "switchyard-mlp";

    /// Row strides of the two weight inputs: their width plus the bias column.
    fn lds(&self) -> (usize, usize) {
        (
            self.d + self.bias[0] as usize,
            self.hidden + self.bias[1] as usize,
        )
    }

    fn forward<T: Float>(
        &self,
        x: &[T],
        w1: &[T],
        w2: &[T],
        shape: &Shape,
    ) -> Result<(CpuStorage, Shape)> {
        let (d, hidden, out) = (self.d, self.hidden, self.out);
        let (ld1, ld2) = self.lds();
        let rows = x.len() / d.max(1);
        let bias = |w: &[T], n: usize, ld: usize| -> Vec<T> {
            (0..n).map(|i| w[i * ld + ld - 1]).collect()
        };
        let mut pre = uninit::<T>(rows * hidden)?;
        if self.bias[0] {
            let b1 = bias(w1, hidden, ld1);
            for row in pre.chunks_exact_mut(hidden) {
                row.copy_from_slice(&b1);
            }
        }
        let w1m = Mat::rows(w1, ld1);
        let w2m = Mat::rows(w2, ld2);
        matmul(
            rows,
            hidden,
            d,
            &mut pre,
            hidden,
            self.bias[0],
            Mat::rows(x, d),
            w1m.t(),
            true,
        );
        let mut h = uninit::<T>(pre.len())?;
        gelu_forward_slice(&pre, &mut h);
        let mut y = uninit::<T>(rows * out)?;
        let b2 = self.bias[1].then(|| bias(w2, out, ld2));
        match &self.opts.reduce_output {
            None => {
                if let Some(b2) = &b2 {
                    for row in y.chunks_exact_mut(out) {
                        row.copy_from_slice(b2);
                    }
                }
                matmul(
                    rows,
                    out,
                    hidden,
                    &mut y,
                    out,
                    b2.is_some(),
                    Mat::rows(&h, hidden),
                    w2m.t(),
                    true,
                );
            }
            Some(reduce) => {
                matmul(
                    rows,
                    out,
                    hidden,
                    &mut y,
                    out,
                    false,
                    Mat::rows(&h, hidden),
                    w2m.t(),
                    true,
                );
                let t = reduce(&kernel::tensor(y, (rows, out))?)?;
                y = t.flatten_all()?.to_vec1::<T>()?;
                if let Some(b2) = &b2 {
                    add_rows(&mut y, b2);
                }
            }
        }
        let _ = self
            .saved
            .set((T::to_cpu_storage_owned(pre), T::to_cpu_storage_owned(h)));
        let mut dims = shape.dims().to_vec();
        *dims.last_mut().expect("rank ≥ 2") = out;
        Ok((T::to_cpu_storage_owned(y), Shape::from(dims)))
    }

    /// `(dx, d[w1 | b1], d[w2 | b2])`; `dx` only when `x` tracks gradients.
    fn backward<T: Float>(
        &self,
        x: &Tensor,
        w1: &Tensor,
        w2: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Tensor, Tensor)> {
        let (d, hidden, out) = (self.d, self.hidden, self.out);
        let (ld1, ld2) = self.lds();
        let Some((pre, h)) = self.saved.get() else {
            bail!("{}: backward before forward", Self::NAME)
        };
        let (pre, h) = (T::cpu_storage_as_slice(pre)?, T::cpu_storage_as_slice(h)?);
        let grad = grad.contiguous()?;
        let n = Self::NAME;
        let (xv, w1v, w2v, gv) = (view(x, n)?, view(w1, n)?, view(w2, n)?, view(&grad, n)?);
        let (xs, w1s, w2s, g) = (
            xv.get::<T>()?,
            w1v.get::<T>()?,
            w2v.get::<T>()?,
            gv.get::<T>()?,
        );
        let rows = xs.len() / d;
        // d[w2 | b2]: Gᵀ·h into the first `hidden` columns, Σ_rows G into the last.
        let mut dw2 = uninit::<T>(out * ld2)?;
        matmul(
            out,
            hidden,
            rows,
            &mut dw2,
            ld2,
            false,
            Mat::rows(g, out).t(),
            Mat::rows(h, hidden),
            true,
        );
        if self.bias[1] {
            for (i, v) in column_sums(g, out).into_iter().enumerate() {
                dw2[i * ld2 + hidden] = v;
            }
        }
        // dh = G·w2, then dpre = gelu′(pre) ⊙ dh.
        let mut dh = uninit::<T>(rows * hidden)?;
        matmul(
            rows,
            hidden,
            out,
            &mut dh,
            hidden,
            false,
            Mat::rows(g, out),
            Mat::rows(w2s, ld2),
            true,
        );
        let mut dpre = uninit::<T>(dh.len())?;
        gelu_backward_slice(pre, &dh, &mut dpre);
        drop(dh);
        let mut dw1 = uninit::<T>(hidden * ld1)?;
        matmul(
            hidden,
            d,
            rows,
            &mut dw1,
            ld1,
            false,
            Mat::rows(&dpre, hidden).t(),
            Mat::rows(xs, d),
            true,
        );
        if self.bias[0] {
            for (i, v) in column_sums(&dpre, hidden).into_iter().enumerate() {
                dw1[i * ld1 + d] = v;
            }
        }
        let dx = match x.track_op() {
            true => {
                let mut dx = uninit::<T>(rows * d)?;
                matmul(
                    rows,
                    d,
                    hidden,
                    &mut dx,
                    d,
                    false,
                    Mat::rows(&dpre, hidden),
                    Mat::rows(w1s, ld1),
                    true,
                );
                let dx = kernel::tensor(dx, x.shape().clone())?;
                Some(match &self.opts.reduce_input_grad {
                    Some(reduce) => reduce(&dx)?,
                    None => dx,
                })
            }
            false => None,
        };
        Ok((
            dx,
            kernel::tensor(dw1, (hidden, ld1))?,
            kernel::tensor(dw2, (out, ld2))?,
        ))
    }
}

impl CustomOp3 for Mlp {
    fn name(&self) -> &'static str {
        Self::NAME
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
        let n = Self::NAME;
        match s1.dtype() {
            DType::F32 => self.forward::<f32>(
                slice(s1, l1, n)?,
                slice(s2, l2, n)?,
                slice(s3, l3, n)?,
                l1.shape(),
            ),
            DType::F64 => self.forward::<f64>(
                slice(s1, l1, n)?,
                slice(s2, l2, n)?,
                slice(s3, l3, n)?,
                l1.shape(),
            ),
            d => bail!("{n}: unsupported dtype {d:?}"),
        }
    }

    fn bwd(
        &self,
        x: &Tensor,
        w1: &Tensor,
        w2: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw1, dw2) = match x.dtype() {
            DType::F32 => self.backward::<f32>(x, w1, w2, grad)?,
            _ => self.backward::<f64>(x, w1, w2, grad)?,
        };
        Ok((dx, Some(dw1), Some(dw2)))
    }
}
