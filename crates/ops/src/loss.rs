//! Mean cross-entropy over rows of logits, as one fused op: each row's maximum, sum of
//! exponentials and target logit in one pass forward; `(softmax − onehot) / N` in one
//! pass backward, from the saved log-sum-exp.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::bf16::{half_slice, to_bf16_vec, widen, Held};
use crate::kernel::{self, max, simd, slice, view, Float, Uninit};
use crate::{composed, OpsBackend, Reduce};

/// `mean_i (logsumexp(logits_i) − logits_i[targets_i])` for `logits` of shape `[N, V]`
/// and `targets` of shape `[N]` (dtype `u32`, each in `0..V`). Returns a scalar.
///
/// Numerically stable: the row maximum is subtracted before `exp`. The gradient with
/// respect to the logits is `(softmax(logits) − onehot(targets)) / N`.
pub fn cross_entropy(logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
    cross_entropy_on(OpsBackend::Fused, logits, targets)
}

pub(crate) fn cross_entropy_on(
    backend: OpsBackend,
    logits: &Tensor,
    targets: &Tensor,
) -> Result<Tensor> {
    let (n, v) = match logits.dims() {
        &[n, v] => (n, v),
        d => bail!("cross_entropy: logits must have shape [N, V], got {d:?}"),
    };
    if targets.dims() != [n] || targets.dtype() != DType::U32 {
        bail!(
            "cross_entropy: targets must be u32 of shape [{n}], got {:?} of shape {:?}",
            targets.dtype(),
            targets.dims()
        );
    }
    if n == 0 {
        bail!("cross_entropy: no rows (N = 0), the mean is undefined");
    }
    let tg = targets.to_vec1::<u32>()?;
    if let Some((row, t)) = tg.iter().enumerate().find(|&(_, &t)| t as usize >= v) {
        bail!("cross_entropy: target {t} of row {row} is out of range for {v} classes");
    }
    if !backend.fuses_bf16(logits) {
        return composed::cross_entropy(logits, targets);
    }
    apply(logits, tg, 0, None, None)
}

/// Cross-entropy over vocabulary-parallel logits: `local_logits` `[N, w]` holds the
/// classes `vocab_start..vocab_start + w` of the full `[N, V]` logits, where `V` is
/// `vocab_size`. `reduce_max` and `reduce_sum` are all-reduces (max, sum) over the group
/// that holds the other slices; each is called once forward, in that order, and nothing
/// communicates backward. The value is the full cross-entropy; the gradient is this slice
/// of the full gradient.
///
/// **Padding.** A vocabulary padded to `V_p = ⌈V/p⌉·p` classes (so that every rank holds
/// `w = V_p/p` columns) has columns whose class `vocab_start + j ≥ V`. Their logits count
/// as `−∞`: they are left out of the row maximum and of `Σ exp`, so the loss is the loss
/// over the `V` real classes, and their gradient is exactly 0. A slice may consist of
/// padding only.
///
/// `targets` are the full `[N]` class ids (u32), the same on every rank; the caller
/// checks that they are in `0..vocab_size`.
pub fn cross_entropy_parallel(
    local_logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    vocab_size: usize,
    reduce_max: Reduce,
    reduce_sum: Reduce,
) -> Result<Tensor> {
    cross_entropy_parallel_on(
        OpsBackend::Fused,
        local_logits,
        targets,
        vocab_start,
        vocab_size,
        reduce_max,
        reduce_sum,
    )
}

pub(crate) fn cross_entropy_parallel_on(
    backend: OpsBackend,
    local_logits: &Tensor,
    targets: &Tensor,
    vocab_start: usize,
    vocab_size: usize,
    reduce_max: Reduce,
    reduce_sum: Reduce,
) -> Result<Tensor> {
    let tg = targets.to_vec1::<u32>()?;
    if local_logits.rank() != 2 || local_logits.dim(0)? != tg.len() || tg.is_empty() {
        bail!(
            "cross_entropy_parallel: logits {:?} must be [N, V/p] with N = {} > 0 targets",
            local_logits.dims(),
            tg.len()
        );
    }
    if let Some((row, t)) = tg
        .iter()
        .enumerate()
        .find(|&(_, &t)| t as usize >= vocab_size)
    {
        bail!(
            "cross_entropy_parallel: target {t} of row {row} is out of range for {vocab_size} classes"
        );
    }
    if !backend.fuses_bf16(local_logits) {
        return composed::cross_entropy_parallel(
            local_logits,
            &tg,
            vocab_start,
            vocab_size,
            &reduce_max,
            &reduce_sum,
        );
    }
    apply(
        local_logits,
        tg,
        vocab_start,
        Some(vocab_size),
        Some((reduce_max, reduce_sum)),
    )
}

fn apply(
    logits: &Tensor,
    targets: Vec<u32>,
    start: usize,
    vocab_size: Option<usize>,
    reduce: Option<(Reduce, Reduce)>,
) -> Result<Tensor> {
    logits.contiguous()?.apply_op1(CrossEntropy {
        targets,
        start,
        vocab_size,
        reduce,
        lse: OnceLock::new(),
    })
}

struct CrossEntropy {
    targets: Vec<u32>,
    /// The first class of the local slice.
    start: usize,
    /// The number of real classes, when the slice may end in padding (classes `≥ V`,
    /// whose logits count as `−∞`); `None`: every column is real.
    vocab_size: Option<usize>,
    reduce: Option<(Reduce, Reduce)>,
    /// Per row: the log-sum-exp over the full vocabulary.
    lse: OnceLock<CpuStorage>,
}

impl CrossEntropy {
    /// How many leading columns of a local slice of `width` are real classes; the rest
    /// is padding.
    fn valid(&self, width: usize) -> usize {
        match self.vocab_size {
            Some(v) => v.saturating_sub(self.start).min(width),
            None => width,
        }
    }

    /// The local column of row `r`'s target, if this slice holds it.
    fn local_target(&self, r: usize, width: usize) -> Option<usize> {
        let t = self.targets[r] as usize;
        (self.start..self.start + width)
            .contains(&t)
            .then(|| t - self.start)
    }
}

simd! {
    /// `Σ_j exp(z_j − m_r)` over the first `valid` columns of each row `r` of `z` (the
    /// others are padding).
    pub(crate) fn sum_exp<T>(z: &[T], width: usize, valid: usize, m: &[T], out: &mut [MaybeUninit<T>]) {
        for ((row, &m), o) in z.chunks_exact(width).zip(m).zip(out.iter_mut()) {
            let row = &row[..valid];
            let mut acc = [T::zero(); 16];
            let mut chunks = row.chunks_exact(16);
            for c in &mut chunks {
                for i in 0..16 {
                    acc[i] += (c[i] - m).exp();
                }
            }
            let mut s = T::zero();
            for &v in chunks.remainder() {
                s += (v - m).exp();
            }
            for a in acc {
                s += a;
            }
            o.write(s);
        }
    }
}

simd! {
    /// `dz = exp(z − lse_r) · scale` over the first `valid` columns of the rows of `z`;
    /// 0 in the others (padding, whose logits count as `−∞`).
    pub(crate) fn softmax_scaled<T>(z: &[T], width: usize, valid: usize, lse: &[T], scale: T, dz: &mut [MaybeUninit<T>]) {
        for ((row, &l), drow) in z.chunks_exact(width).zip(lse).zip(dz.chunks_exact_mut(width)) {
            let (real, pad) = drow.split_at_mut(valid);
            for (d, &v) in real.iter_mut().zip(row) {
                d.write((v - l).exp() * scale);
            }
            for d in pad {
                d.write(T::zero());
            }
        }
    }
}

impl CrossEntropy {
    fn forward<T: Float>(&self, z: &[T], width: usize) -> Result<T> {
        let n = self.targets.len();
        if width == 0 || z.len() != n * width {
            bail!(
                "switchyard-cross-entropy: {} logits for {n} rows of {width}",
                z.len()
            )
        }
        let valid = self.valid(width);
        let mut m: Vec<T> = z.par_chunks(width).map(|row| max(&row[..valid])).collect();
        if let Some((reduce_max, _)) = &self.reduce {
            m = reduce_max(&kernel::tensor(m, n)?)?.to_vec1::<T>()?;
        }
        if m.len() != n {
            bail!(
                "switchyard-cross-entropy: the max reduction gave {} values for {n} rows",
                m.len()
            )
        }
        let mut s = Uninit::<T>::new(n)?;
        let per = kernel::rows_per_task(n);
        s.as_mut()
            .par_chunks_mut(per)
            .zip(z.par_chunks(per * width).zip(m.par_chunks(per)))
            .for_each(|(s, (z, m))| sum_exp(z, width, valid, m, s));
        // SAFETY: `z` is `n` whole rows and `m` has `n` maxima (both checked); the chunks
        // pair up (`per` rows each) and `sum_exp` writes one sum per row.
        let mut s = unsafe { s.assume_init() };
        let mut picked: Vec<T> = (0..n)
            .map(|r| match self.local_target(r, width) {
                Some(j) => z[r * width + j] - m[r],
                None => T::zero(),
            })
            .collect();
        if let Some((_, reduce_sum)) = &self.reduce {
            let both: Vec<T> = s.iter().zip(&picked).flat_map(|(&a, &b)| [a, b]).collect();
            let both = reduce_sum(&kernel::tensor(both, (n, 2))?)?.flatten_all()?;
            let both = both.to_vec1::<T>()?;
            for (r, pair) in both.chunks_exact(2).enumerate() {
                s[r] = pair[0];
                picked[r] = pair[1];
            }
        }
        let mut total = 0.0f64;
        let lse: Vec<T> = (0..n)
            .map(|r| {
                let ls = s[r].ln();
                total += (ls - picked[r]).to_f64();
                m[r] + ls
            })
            .collect();
        let _ = self.lse.set(T::to_cpu_storage_owned(lse));
        Ok(T::from_f64(total / n as f64))
    }

    /// `dz` of the `[n, width]` logits `zs`.
    fn backward<T: Float>(
        &self,
        zs: &[T],
        (n, width): (usize, usize),
        grad: &Tensor,
    ) -> Result<Vec<T>> {
        let name = "switchyard-cross-entropy";
        let g = grad.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        let scale = T::from_f64(g / n as f64);
        let Some(lse) = self.lse.get() else {
            bail!("{name}: backward before forward")
        };
        let lse = T::cpu_storage_as_slice(lse)?;
        if width == 0 || zs.len() != n * width || lse.len() != n {
            bail!("{name}: {} logits for {n} rows of {width}", zs.len())
        }
        let valid = self.valid(width);
        let mut dz = Uninit::<T>::new(zs.len())?;
        let per = kernel::rows_per_task(n);
        dz.as_mut()
            .par_chunks_mut(per * width)
            .zip(zs.par_chunks(per * width).zip(lse.par_chunks(per)))
            .for_each(|(d, (z, l))| softmax_scaled(z, width, valid, l, scale, d));
        // SAFETY: whole rows with one log-sum-exp each (checked above); the chunks pair
        // up and `softmax_scaled` writes every element of its rows (`valid ≤ width`).
        let mut dz = unsafe { dz.assume_init() };
        for r in 0..n {
            if let Some(j) = self.local_target(r, width) {
                dz[r * width + j] -= scale;
            }
        }
        Ok(dz)
    }
}

impl CustomOp1 for CrossEntropy {
    fn name(&self) -> &'static str {
        "switchyard-cross-entropy"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (_, width) = l.shape().dims2()?;
        let n = self.name();
        let out = match s.dtype() {
            DType::F32 => CpuStorage::F32(vec![self.forward::<f32>(slice(s, l, n)?, width)?]),
            DType::F64 => CpuStorage::F64(vec![self.forward::<f64>(slice(s, l, n)?, width)?]),
            // bf16 logits (`Precision::Bf16`): widened, the loss and softmax in f32.
            DType::BF16 => match half_slice(s, l, n)? {
                Some(z) => CpuStorage::F32(vec![self.forward::<f32>(&widen(z), width)?]),
                None => unreachable!("a bf16 storage"),
            },
            d => bail!("{n}: unsupported dtype {d:?}"),
        };
        Ok((out, Shape::from(())))
    }

    fn bwd(&self, z: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let dims = z.dims2()?;
        let zv = view(z, self.name())?;
        let d = match (z.dtype(), zv.held::<f32>()) {
            // bf16 logits: the gradient in f32 from the widened logits, rounded once.
            (DType::BF16, Ok(Held::Half(h))) => {
                let dz = self.backward::<f32>(&widen(h), dims, grad)?;
                Tensor::from_vec(to_bf16_vec(&dz), dims, z.device())?
            }
            (DType::F32, Ok(Held::Full(zs))) => {
                kernel::tensor(self.backward::<f32>(zs, dims, grad)?, dims)?
            }
            _ => kernel::tensor(self.backward::<f64>(zv.get::<f64>()?, dims, grad)?, dims)?,
        };
        Ok(Some(d))
    }
}
