//! Causal scaled-dot-product self-attention, differentiable in q, k and v.
//!
//! [`causal_attention_packed`] is the fused kernel: it reads q, k and v straight from a
//! fused qkv projection `[B, T, 3·H·hd]` and writes `[B, T, H·hd]`, so no transpose or
//! copy surrounds it. It works flash-style, one (batch, head) pair at a time in a `T × T`
//! scratch that stays in cache: the `(B, H, T, T)` scores and probabilities are never
//! stored. Forward keeps only each row's log-sum-exp; backward recomputes the
//! probabilities from it:
//!
//! * `S = q·kᵀ/√hd` (masked above the diagonal), `P = exp(S − lse)`, `O = P·v`;
//! * `dv = Pᵀ·dO`, `dP = dO·vᵀ`, `Dᵢ = Σ_d dOᵢ·Oᵢ`, `dS = P ⊙ (dP − D)`,
//!   `dq = dS·k/√hd`, `dk = dSᵀ·q/√hd`.

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

use crate::kernel::{self, max, simd, slice, sum, view, Float, Inherited, Mat, SharedMut, Uninit};
use crate::{composed, OpsBackend};
#[cfg(test)]
pub(crate) use pair::transpose_portable;
use pair::{backward_pair, forward_pair};

/// `softmax(q · kᵀ / √hd + M) · v` for `q`, `k`, `v` of shape `(B, H, T, hd)`, where the
/// additive causal mask `M` is 0 where the key position is at or before the query
/// position and −∞ after it. Returns `(B, H, T, hd)`.
///
/// The softmax subtracts the row maximum before `exp` (exact gradient, no overflow);
/// every row has at least its diagonal unmasked, so no row is all −∞. For `f32`/`f64` on
/// the CPU this packs q, k and v and runs [`causal_attention_packed`].
pub fn causal_self_attention(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    causal_self_attention_on(OpsBackend::Fused, q, k, v)
}

pub(crate) fn causal_self_attention_on(
    backend: OpsBackend,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> Result<Tensor> {
    let (b, h, t, hd) = q.dims4()?;
    if k.dims() != q.dims() || v.dims() != q.dims() {
        bail!(
            "causal_self_attention: q {:?}, k {:?} and v {:?} must all have shape (B, H, T, hd)",
            q.dims(),
            k.dims(),
            v.dims()
        );
    }
    if !backend.fuses(q) {
        return composed::causal_self_attention(q, k, v);
    }
    let pack = |x: &Tensor| x.transpose(1, 2)?.reshape((b, t, h * hd));
    let qkv = Tensor::cat(&[pack(q)?, pack(k)?, pack(v)?], 2)?;
    causal_attention_packed(&qkv, h)?
        .reshape((b, t, h, hd))?
        .transpose(1, 2)
}

/// Causal self-attention over a fused projection: `qkv` is `[B, T, 3·H·hd]` with columns
/// `q | k | v`, each made of `n_head` contiguous heads of `hd` (the layout of GPT's
/// `c_attn` output). Returns `[B, T, H·hd]`, head `h` in columns `h·hd..(h+1)·hd` (the
/// input layout of the output projection). The fused kernel for `f32` and `f64` on the
/// CPU; its composed twin elsewhere.
///
/// An empty sequence (`T = 0`) or batch (`B = 0`) gives an empty output `[B, T, H·hd]`
/// (and an empty gradient): there are no query positions to attend from. `head_dim`
/// must be at least 1.
pub fn causal_attention_packed(qkv: &Tensor, n_head: usize) -> Result<Tensor> {
    causal_attention_packed_on(OpsBackend::Fused, qkv, n_head)
}

pub(crate) fn causal_attention_packed_on(
    backend: OpsBackend,
    qkv: &Tensor,
    n_head: usize,
) -> Result<Tensor> {
    let (_, _, c) = qkv.dims3()?;
    if n_head == 0 || c == 0 || c % (3 * n_head) != 0 {
        bail!(
            "causal_attention_packed: the last dim of qkv {:?} must be 3 × n_head ({n_head}) × head_dim, with n_head and head_dim at least 1",
            qkv.dims()
        );
    }
    if !backend.fuses(qkv) {
        return composed::causal_attention_packed(qkv, n_head);
    }
    qkv.contiguous()?.apply_op1(Attention {
        n_head,
        lse: OnceLock::new(),
    })
}

struct Attention {
    n_head: usize,
    /// Per (batch, head, row): the log-sum-exp of the scaled scores.
    lse: OnceLock<CpuStorage>,
}

/// The geometry of one call.
#[derive(Clone, Copy)]
struct Geo {
    b: usize,
    t: usize,
    h: usize,
    hd: usize,
    scale: f64,
}

impl Geo {
    fn dl(&self) -> usize {
        self.h * self.hd
    }
    /// Offsets of q, k, v of pair `(bi, hi)` in the packed input (row stride `3·dl`).
    fn offsets(&self, bi: usize, hi: usize) -> [usize; 3] {
        let base = bi * self.t * 3 * self.dl() + hi * self.hd;
        [base, base + self.dl(), base + 2 * self.dl()]
    }
    /// q, k and v of pair `(bi, hi)` in the packed input `x`.
    fn qkv<'a, T>(&self, x: &'a [T], bi: usize, hi: usize) -> [Mat<'a, T>; 3] {
        self.offsets(bi, hi)
            .map(|o| Mat::rows(&x[o..], 3 * self.dl()))
    }
    /// That the packed input holds `len` elements: exactly `b·t` rows of `3·h·hd` (the
    /// output and the input gradient are written through raw pointers from this geometry,
    /// and must be written whole).
    fn check(&self, len: usize, what: &str) -> Result<()> {
        if self.hd == 0 || len != self.b * self.t * 3 * self.dl() {
            bail!(
                "switchyard-causal-attention: {what} of {len} elements for B = {}, T = {}, {} heads of {}",
                self.b,
                self.t,
                self.h,
                self.hd
            )
        }
        Ok(())
    }
    /// Offset of pair `(bi, hi)` in the output (row stride `dl`).
    fn out(&self, bi: usize, hi: usize) -> usize {
        bi * self.t * self.dl() + hi * self.hd
    }
}

/// The columns of row `i` that its block's products computed: the keys up to the end of
/// the row's block. The softmax loops run over all of them, whole vectors when `BLOCK`
/// and `T` are multiples of the vector width: the columns after the diagonal are first
/// set to −∞ (so `exp` and `max` ignore them) and zeroed afterwards, a few scalar stores
/// instead of a scalar tail.
fn width(i: usize, t: usize) -> usize {
    ((i / BLOCK + 1) * BLOCK).min(t)
}

simd! {
    /// One row of the causal softmax, portable: `live[j] = exp(scale·live[j] − m) / z` for
    /// `j < n`, 0 after; returns the log-sum-exp `m + ln z`.
    pub(crate) fn softmax_row_portable<T>(live: &mut [T], n: usize, scale: f64) -> T {
        let scale = T::from_f64(scale);
        live[n..].fill(T::NEG_INF);
        let m = max(live) * scale;
        for v in live.iter_mut() {
            *v = (*v * scale - m).exp();
        }
        live[n..].fill(T::zero());
        let z = sum(live);
        let inv = T::one() / z;
        for v in live.iter_mut() {
            *v *= inv;
        }
        m + z.ln()
    }
}

simd! {
    /// One row of the causal softmax's backward, portable: `row` holds the scores and
    /// becomes `P = exp(scale·s − lse)`, `drow` holds `dP` and becomes
    /// `dS = scale · P ⊙ (dP − D)`, for `j < n`; both 0 after.
    pub(crate) fn softmax_row_bwd_portable<T>(row: &mut [T], drow: &mut [T], n: usize, scale: f64, lse: T, dsum: T) {
        let scale = T::from_f64(scale);
        row[n..].fill(T::NEG_INF);
        for (p, d) in row.iter_mut().zip(drow.iter_mut()) {
            *p = (*p * scale - lse).exp();
            *d = *p * (*d - dsum) * scale;
        }
        row[n..].fill(T::zero());
        drow[n..].fill(T::zero());
    }
}

/// The causal softmax of the `t × t` scores `s` (row stride `ld`), row by row over each
/// row's [`width`]; records each row's log-sum-exp. Rows go through [`crate::avx512`]'s
/// kernel where it runs.
fn softmax_causal<T: Float>(
    s: &mut [T],
    t: usize,
    ld: usize,
    scale: f64,
    lse: &mut [MaybeUninit<T>],
) {
    for (i, row) in s.chunks_exact_mut(ld).take(t).enumerate() {
        let (live, dead) = row[..t].split_at_mut(width(i, t));
        let l = match kernel::avx512_f32_mut(live) {
            // SAFETY: `avx512_f32_mut` only answers on CPUs with AVX-512; 1 ≤ i + 1 ≤ width.
            #[cfg(target_arch = "x86_64")]
            Some(live) => {
                T::from_f64(unsafe { crate::avx512::softmax_row(live, i + 1, scale as f32) } as f64)
            }
            _ => softmax_row_portable(live, i + 1, scale),
        };
        lse[i].write(l);
        dead.fill(T::zero());
    }
}

/// Recomputes `P` from the scores and the log-sum-exp, then turns `dp` into
/// `dS = scale · P ⊙ (dP − D)` and `s` into `P`, row by row as [`softmax_causal`].
fn softmax_causal_bwd<T: Float>(
    s: &mut [T],
    dp: &mut [T],
    t: usize,
    ld: usize,
    scale: f64,
    lse: &[T],
    dsum: &[T],
) {
    let rows = s.chunks_exact_mut(ld).zip(dp.chunks_exact_mut(ld)).take(t);
    for (i, (row, drow)) in rows.enumerate() {
        let w = width(i, t);
        let (live, dlive) = (&mut row[..w], &mut drow[..w]);
        match (kernel::avx512_f32_mut(live), kernel::avx512_f32_mut(dlive)) {
            #[cfg(target_arch = "x86_64")]
            (Some(live), Some(dlive)) => {
                let (l, d) = (lse[i].to_f64() as f32, dsum[i].to_f64() as f32);
                // SAFETY: as above; i + 1 ≤ width.
                unsafe { crate::avx512::softmax_row_bwd(live, dlive, i + 1, scale as f32, l, d) }
            }
            _ => softmax_row_bwd_portable(
                &mut row[..w],
                &mut drow[..w],
                i + 1,
                scale,
                lse[i],
                dsum[i],
            ),
        }
        row[w..t].fill(T::zero());
        drow[w..t].fill(T::zero());
    }
}

impl Attention {
    fn geo(&self, shape: &Shape) -> Result<Geo> {
        let (b, t, c) = shape.dims3()?;
        let hd = c / (3 * self.n_head);
        Ok(Geo {
            b,
            t,
            h: self.n_head,
            hd,
            scale: 1.0 / (hd as f64).sqrt(),
        })
    }

    fn forward<T: Float>(&self, qkv: &[T], g: Geo) -> Result<Vec<T>> {
        let (t, dl) = (g.t, g.dl());
        g.check(qkv.len(), "input")?;
        if g.b * t == 0 {
            // No positions: an empty output (and nothing for the backward to use).
            let _ = self.lse.set(T::to_cpu_storage_owned(Vec::new()));
            return Ok(Vec::new());
        }
        let mut y = Uninit::<T>::new(g.b * t * dl)?;
        let mut lse = Uninit::<T>::new(g.b * g.h * t)?;
        let (out, ceiling) = (SharedMut(y.as_mut_ptr()), Inherited::here());
        lse.as_mut()
            .par_chunks_mut(t)
            .enumerate()
            .with_min_len(pairs_per_task(g))
            .for_each_init(
                || vec![T::zero(); scratch_len(g, false)],
                |scratch, (pair, lse)| {
                    ceiling.run(|| forward_pair(qkv, g, pair, scratch, lse, out))
                },
            );
        // SAFETY: every pair wrote the log-sum-exp of each of its `t` rows, and its `t`
        // rows × `hd` columns of `y`: together every element of both.
        let (y, lse) = unsafe { (y.assume_init(), lse.assume_init()) };
        let _ = self.lse.set(T::to_cpu_storage_owned(lse));
        Ok(y)
    }

    fn backward<T: Float>(&self, qkv: &Tensor, y: &Tensor, grad: &Tensor) -> Result<Tensor> {
        let name = "switchyard-causal-attention";
        let grad = grad.contiguous()?;
        let (xv, yv, gv) = (view(qkv, name)?, view(y, name)?, view(&grad, name)?);
        let (x, o, d_o) = (xv.get::<T>()?, yv.get::<T>()?, gv.get::<T>()?);
        let dx = self.backward_slices(x, o, d_o, self.geo(qkv.shape())?)?;
        kernel::tensor(dx, qkv.shape().clone())
    }

    /// The gradient of the packed input from the input `x`, the output `o` and the output
    /// gradient `d_o` (all contiguous), after [`Attention::forward`].
    fn backward_slices<T: Float>(&self, x: &[T], o: &[T], d_o: &[T], g: Geo) -> Result<Vec<T>> {
        let Some(lse) = self.lse.get() else {
            bail!("switchyard-causal-attention: backward before forward")
        };
        let lse = T::cpu_storage_as_slice(lse)?;
        g.check(x.len(), "input")?;
        if g.b * g.t == 0 {
            return Ok(Vec::new());
        }
        let mut dx = Uninit::<T>::new(x.len())?;
        let (dst, ceiling) = (SharedMut(dx.as_mut_ptr()), Inherited::here());
        (0..g.b * g.h)
            .into_par_iter()
            .with_min_len(pairs_per_task(g))
            .for_each_init(
                || vec![T::zero(); scratch_len(g, true)],
                |scratch, pair| {
                    ceiling.run(|| backward_pair(x, o, d_o, lse, g, pair, scratch, dst))
                },
            );
        // SAFETY: every pair wrote its q, k and v columns of each of its `t` rows:
        // together every element of `dx`.
        Ok(unsafe { dx.assume_init() })
    }
}

/// The fused attention driven by another op (the middle of [`crate::attention_block`]):
/// the forward pass over a packed `[B, T, 3·H·hd]` slice, keeping what the backward needs.
pub(crate) struct AttentionEpilogue(Attention);

impl AttentionEpilogue {
    pub(crate) fn new(n_head: usize) -> Self {
        AttentionEpilogue(Attention {
            n_head,
            lse: OnceLock::new(),
        })
    }

    /// `[B, T, H·hd]` from the packed `qkv` of shape `shape`, and that output shape.
    pub(crate) fn forward<T: Float>(&self, qkv: &[T], shape: &Shape) -> Result<(Vec<T>, Shape)> {
        let g = self.0.geo(shape)?;
        Ok((self.0.forward(qkv, g)?, Shape::from((g.b, g.t, g.dl()))))
    }

    /// The gradient of the packed input (shape `shape`) from the input, the output and
    /// the output gradient.
    pub(crate) fn backward<T: Float>(
        &self,
        qkv: &[T],
        o: &[T],
        d_o: &[T],
        shape: &Shape,
    ) -> Result<Vec<T>> {
        self.0.backward_slices(qkv, o, d_o, self.0.geo(shape)?)
    }
}

/// Rows (or columns) per block of the causal products: block `i` of queries sees key
/// blocks `0..=i` only, so about 9/16 of the full `T × T` work is done at T = 8 blocks.
const BLOCK: usize = 16;

/// `(start, end)` of each block of `t` rows.
fn blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(BLOCK)).map(move |i| (i * BLOCK, ((i + 1) * BLOCK).min(t)))
}

/// The (sequence, head) pairs one task of the pool takes at least: enough for about
/// [`kernel::PARALLEL_MIN`] multiply-adds (a pair's products are `2·T²·hd`), so that a
/// small attention runs whole on the calling thread instead of paying for tasks (and
/// giving other threads of the pool the matrix multiply's packing buffer) for microseconds
/// of work.
fn pairs_per_task(g: Geo) -> usize {
    // Under Miri each pair is a task: the pool's threads then write disjoint parts of one
    // output at once, which is what Miri is there to check.
    if cfg!(miri) {
        return 1;
    }
    let per_pair = (2 * g.t * g.t * g.hd).max(1);
    kernel::PARALLEL_MIN.div_ceil(per_pair).max(1)
}

/// Scratch of one task: scores (and score gradients, `T × T` each), row sums, and `kᵀ`
/// (and `vᵀ`, `hd × T` each).
fn scratch_len(g: Geo, backward: bool) -> usize {
    match backward {
        false => g.t * g.t + g.hd * g.t,
        true => 2 * g.t * g.t + g.t + 2 * g.hd * g.t,
    }
}

impl CustomOp1 for Attention {
    fn name(&self) -> &'static str {
        "switchyard-causal-attention"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = self.geo(l.shape())?;
        let n = self.name();
        let out = match s.dtype() {
            DType::F32 => CpuStorage::F32(self.forward::<f32>(slice(s, l, n)?, g)?),
            DType::F64 => CpuStorage::F64(self.forward::<f64>(slice(s, l, n)?, g)?),
            d => bail!("{n}: unsupported dtype {d:?}"),
        };
        Ok((out, Shape::from((g.b, g.t, g.dl()))))
    }

    fn bwd(&self, qkv: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let d = match qkv.dtype() {
            DType::F32 => self.backward::<f32>(qkv, res, grad)?,
            _ => self.backward::<f64>(qkv, res, grad)?,
        };
        Ok(Some(d))
    }
}

mod pair;
#[cfg(test)]
mod tests;
