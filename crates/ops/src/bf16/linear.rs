//! `y = x · wᵀ + b` in mixed precision: bf16 products with f32 sums, an f32 master
//! weight and bias, a bf16 output (the activation a bf16 model keeps).
//!
//! Forward: `x` (bf16, or f32 rounded while packing) times `w` (f32, rounded while
//! packing: no bf16 copy of the weight is kept), the bias added in f32, the sum rounded
//! to bf16 once. Backward, from the output's bf16 gradient `G`:
//! `dX = G · W` (bf16 products, f32 sums, returned in `x`'s dtype),
//! `dW = Gᵀ · X` (f32: the master weight's gradient) and `db = Σ_rows G` (f32).
//! The op keeps `x` (bf16: half the bytes of an f32 activation) and the weight it was
//! given, nothing else.
//!
//! Other devices, and `OpsBackend::Composed`, take the composed twin: candle's own bf16
//! matmul on the rounded operands.

use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Storage, Tensor,
};

use super::{gemm, to_bf16_vec, Bf16Kernel, Operand, ToBf16};
use crate::kernel::{slice, Dst, Mat, Uninit};
use crate::OpsBackend;

/// `x · wᵀ + b` with bf16 products and f32 sums, for `x` `[.., in]` (rank 2 or 3, bf16
/// or f32), `w` `[out, in]` and `b` `[out]` (f32 master copies): a bf16 `[.., out]`.
/// Gradients: `x`'s in `x`'s dtype, `w`'s and `b`'s in f32.
pub fn linear_bf16(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    linear_bf16_on(x, w, b, OpsBackend::Fused)
}

/// [`linear_bf16`] on a given backend: `Fused` runs the kernels of this module on CPU
/// tensors and the composed twin elsewhere; `Composed` runs the twin everywhere.
pub fn linear_bf16_on(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    backend: OpsBackend,
) -> Result<Tensor> {
    crate::linear::check_shapes("linear_bf16", x, w, b)?;
    if !matches!(x.dtype(), DType::BF16 | DType::F32) || w.dtype() != DType::F32 {
        bail!(
            "linear_bf16: a bf16 or f32 input and an f32 weight expected, got {:?} and {:?}",
            x.dtype(),
            w.dtype()
        );
    }
    if let Some(b) = b {
        if b.dtype() != DType::F32 {
            bail!("linear_bf16: the bias must be f32, got {:?}", b.dtype());
        }
    }
    if backend == OpsBackend::Composed || !x.device().is_cpu() {
        return composed(x, w, b);
    }
    let (x, w) = (x.contiguous()?, w.contiguous()?);
    match b {
        Some(b) => x.apply_op3(&w, &b.contiguous()?, LinearBf16),
        None => x.apply_op2(&w, LinearBf16),
    }
}

/// The twin: candle's differentiable ops on the rounded operands (bf16 matmul).
fn composed(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x
        .to_dtype(DType::BF16)?
        .broadcast_matmul(&w.to_dtype(DType::BF16)?.t()?)?;
    match b {
        Some(b) => y.broadcast_add(&b.to_dtype(DType::BF16)?),
        None => Ok(y),
    }
}

struct LinearBf16;

impl LinearBf16 {
    fn forward(
        &self,
        x: (&CpuStorage, &Layout),
        w: (&CpuStorage, &Layout),
        b: Option<(&CpuStorage, &Layout)>,
    ) -> Result<(CpuStorage, Shape)> {
        let (out_f, in_f) = w.1.shape().dims2()?;
        let rows = x.1.shape().elem_count() / in_f.max(1);
        let w = slice::<f32>(w.0, w.1, "linear_bf16")?;
        let mut y = Uninit::<f32>::new(rows * out_f)?;
        let kernel = Bf16Kernel::best();
        let wt = Mat::rows(w, in_f).t();
        macro_rules! go {
            ($v:expr) => {{
                let x = Mat::rows(&$v[x.1.start_offset()..][..rows * in_f], in_f);
                gemm(
                    kernel,
                    rows,
                    out_f,
                    in_f,
                    Dst::Uninit(y.as_mut()),
                    out_f,
                    x,
                    wt,
                )
            }};
        }
        match x.0 {
            CpuStorage::BF16(v) => go!(v),
            CpuStorage::F32(v) => go!(v),
            _ => bail!("linear_bf16: a bf16 or f32 input expected"),
        }
        // SAFETY: `gemm` wrote all `rows · out` elements (`Dst::Uninit`, row stride out).
        let mut y = unsafe { y.assume_init() };
        if let Some(b) = b {
            let b = slice::<f32>(b.0, b.1, "linear_bf16")?;
            for row in y.chunks_exact_mut(out_f) {
                row.iter_mut().zip(b).for_each(|(y, b)| *y += b);
            }
        }
        let y = to_bf16_vec(&y);
        let mut dims = x.1.shape().dims().to_vec();
        *dims.last_mut().expect("rank ≥ 2") = out_f;
        Ok((CpuStorage::BF16(y), Shape::from(dims)))
    }

    /// `dX = G·W`, `dW = Gᵀ·X`, `db = Σ_rows G`, read straight from the storages: `G`
    /// (the output's gradient, bf16) may have any strides whose leading dims merge into
    /// rows, a broadcast one included; otherwise it is copied once.
    #[allow(clippy::type_complexity)]
    fn backward(
        &self,
        x: &Tensor,
        w: &Tensor,
        bias: bool,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (out_f, in_f) = w.dims2()?;
        let rows = x.elem_count() / in_f.max(1);
        let grad = match rows_strides(grad.layout()) {
            Some(_) => grad.clone(),
            None => grad.contiguous()?,
        };
        let (gs, gl) = grad.storage_and_layout();
        let (rs, cs) = rows_strides(gl).expect("contiguous");
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (Storage::Cpu(gs), Storage::Cpu(xs), Storage::Cpu(ws)) = (&*gs, &*xs, &*ws) else {
            bail!("linear_bf16: CPU tensors expected in the backward");
        };
        let w = slice::<f32>(ws, wl, "linear_bf16")?;
        let g = Operand::of(gs, gl.start_offset())?;
        let xo = Operand::of(xs, xl.start_offset())?;
        let kernel = Bf16Kernel::best();
        let mut dx = Uninit::<f32>::new(rows * in_f)?;
        let mut dw = Uninit::<f32>::new(out_f * in_f)?;
        let mut db = vec![0f32; if bias { out_f } else { 0 }];
        macro_rules! go {
            ($g:expr, $x:expr) => {{
                let g = Mat { data: $g, rs, cs };
                // dX [rows × in] = G [rows × out] · W [out × in].
                gemm(
                    kernel,
                    rows,
                    in_f,
                    out_f,
                    Dst::Uninit(dx.as_mut()),
                    in_f,
                    g,
                    Mat::rows(w, in_f),
                );
                // dW [out × in] = Gᵀ [out × rows] · X [rows × in].
                let x = Mat::rows(&$x[..rows * in_f], in_f);
                gemm(
                    kernel,
                    out_f,
                    in_f,
                    rows,
                    Dst::Uninit(dw.as_mut()),
                    in_f,
                    g.t(),
                    x,
                );
                if bias {
                    for r in 0..rows {
                        for (j, acc) in db.iter_mut().enumerate() {
                            *acc += g.data[r * rs + j * cs].f32();
                        }
                    }
                }
            }};
        }
        match (g, xo) {
            (Operand::Bf16(g), Operand::Bf16(x)) => go!(g, x),
            (Operand::Bf16(g), Operand::F32(x)) => go!(g, x),
            (Operand::F32(g), Operand::Bf16(x)) => go!(g, x),
            (Operand::F32(g), Operand::F32(x)) => go!(g, x),
        }
        // SAFETY: the two products wrote every element of `dx` and `dw` (`Dst::Uninit`,
        // row stride `in`).
        let (dx, dw) = unsafe { (dx.assume_init(), dw.assume_init()) };
        let dx = match x.dtype() {
            DType::BF16 => Tensor::from_vec(to_bf16_vec(&dx), x.shape(), x.device())?,
            _ => Tensor::from_vec(dx, x.shape(), x.device())?,
        };
        let dw = Tensor::from_vec(dw, (out_f, in_f), x.device())?;
        let db = match bias {
            true => Some(Tensor::from_vec(db, out_f, x.device())?),
            false => None,
        };
        Ok((Some(dx), Some(dw), db))
    }
}

/// The row and column strides of a rank-2 or rank-3 layout `[.., n]` whose leading dims
/// merge into one dim of rows (any strides, broadcast ones included); `None` otherwise.
fn rows_strides(l: &Layout) -> Option<(usize, usize)> {
    match (l.dims(), l.stride()) {
        (&[_, _], &[rs, cs]) => Some((rs, cs)),
        (&[b, t, _], &[s0, s1, cs]) if b == 1 || s0 == t * s1 => Some((s1, cs)),
        _ => None,
    }
}

impl CustomOp3 for LinearBf16 {
    fn name(&self) -> &'static str {
        "linear-bf16"
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
        self.forward((s1, l1), (s2, l2), Some((s3, l3)))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        self.backward(x, w, true, grad)
    }
}

impl CustomOp2 for LinearBf16 {
    fn name(&self) -> &'static str {
        "linear-bf16"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.forward((s1, l1), (s2, l2), None)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (dx, dw, _) = self.backward(x, w, false, grad)?;
        Ok((dx, dw))
    }
}
