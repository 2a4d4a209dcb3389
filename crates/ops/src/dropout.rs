//! Dropout whose mask depends on where an element sits in the job, not on which worker
//! computes it: `y = a ⊙ m / (1 − p)`, and fused with a residual sum, `y = x + a ⊙ m / (1 − p)`
//! (Megatron's bias-dropout-add, without the bias).
//!
//! **The mask.** Element `(row, position, feature)` of dropout site `site` in a step is
//! kept when a hash of `(key, site, row, position, feature)` is at least `p · 2³²`, where
//! `key` comes from the run's seed and the step ([`DropoutMask::step_key`]), `row` is the
//! sample's row in the step's whole batch and `position` its position in the whole
//! sequence. A worker that holds a slice of the batch (data parallelism, microbatches) or
//! of the sequence (sequence parallelism) says where its slice starts
//! ([`DropoutMask::first_row`], [`DropoutMask::first_position`]) and draws exactly the
//! elements one device would have drawn for them, bit for bit. So every layout trains the
//! same model as one device with dropout on (up to the rounding of its sums, as without
//! it); and under tensor parallelism the ranks that replicate an activation drop the same
//! elements without exchanging a mask or any random state.
//! (Megatron-LM forks its CUDA RNG state per tensor-parallel region instead, so its masks
//! change with the layout.)
//!
//! The hash: three SplitMix64 rounds fold `(site, row, position)` into the step's key,
//! one per row of features, then each feature is `fmix32` (MurmurHash3's finaliser) of the
//! feature index times the golden ratio, xor the row's 32 bits. Both are bijections, so
//! the features of one row never share a draw.
//!
//! **No mask is stored.** The backward computes the mask again from the op's
//! coordinates (`dx = g`, `da = g ⊙ m / (1 − p)`), so a dropout keeps nothing for its
//! backward: fused with the residual sum it keeps what the sum alone keeps (its two
//! inputs), and costs one pass over the rows, as the sum did.
//!
//! The fused op runs on CPU f32 and f64 tensors ([`OpsBackend::Fused`]); otherwise the
//! mask is built as a tensor ([`DropoutMask::tensor`], the same draws) and multiplied in,
//! which runs on every candle device and keeps the mask for the backward.

use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Result};
use candle_core::{Shape, Tensor};
use rayon::prelude::*;

use std::mem::MaybeUninit;

use crate::kernel::{self, simd, slice, Float, Uninit};
use crate::OpsBackend;

/// Where a dropout's `[B, T, d]` tensor sits in the step, which fixes its mask.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropoutMask {
    /// The probability of dropping an element, in `[0, 1)`.
    pub p: f64,
    /// The step's key, [`DropoutMask::step_key`] of the run's seed and the step.
    pub key: u64,
    /// Which dropout of the model this is (for a GPT: 0 after the embeddings, `2l + 1`
    /// and `2l + 2` on block `l`'s two residual branches).
    pub site: u64,
    /// The row, in the step's whole batch, of the tensor's first row.
    pub first_row: u64,
    /// The position, in the whole sequence, of the tensor's first position.
    pub first_position: u64,
}

/// SplitMix64's finaliser: a bijection on `u64` that mixes every bit into every bit.
#[inline(always)]
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// MurmurHash3's 32-bit finaliser, also a bijection.
#[inline(always)]
fn fmix32(mut h: u32) -> u32 {
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^ (h >> 16)
}

/// Odd, so that multiplying by it permutes `u32`.
const GOLDEN: u32 = 0x9e37_79b9;

impl DropoutMask {
    /// The key of step `step` of a run seeded `seed`: every step draws other masks, and a
    /// resumed run draws the masks the uninterrupted run drew.
    pub fn step_key(seed: u64, step: u64) -> u64 {
        // "dropout" in ASCII, so that the key differs from other uses of the seed.
        mix64(mix64(seed ^ 0x0064_726f_706f_7574).wrapping_add(step))
    }

    /// The 32 bits every feature of one (row, position) is hashed with.
    #[inline(always)]
    fn row_bits(&self, row: u64, position: u64) -> u32 {
        let k = mix64(self.key.wrapping_add(self.site));
        let k = mix64(k.wrapping_add(row));
        let k = mix64(k.wrapping_add(position));
        (k ^ (k >> 32)) as u32
    }

    /// Features at or above this draw are kept: `P(keep) = 1 − p` to within `2⁻³²`.
    #[inline(always)]
    fn threshold(&self) -> u32 {
        (self.p * 4_294_967_296.0).min(u32::MAX as f64) as u32
    }

    /// What a kept element is multiplied by.
    #[inline(always)]
    fn scale(&self) -> f64 {
        1.0 / (1.0 - self.p)
    }

    /// Whether element `(row, position, feature)` of the tensor is kept (rows and
    /// positions counted from the tensor's first).
    pub fn keeps(&self, row: usize, position: usize, feature: usize) -> bool {
        let bits = self.row_bits(
            self.first_row + row as u64,
            self.first_position + position as u64,
        );
        keep(bits, feature as u32, self.threshold())
    }

    /// The mask of a `[b, t, d]` tensor as a tensor of `dtype` on `device`: `1 / (1 − p)`
    /// where an element is kept, 0 where it is dropped.
    pub fn tensor(
        &self,
        dims: (usize, usize, usize),
        dtype: DType,
        dev: &Device,
    ) -> Result<Tensor> {
        let (b, t, d) = dims;
        let (threshold, scale) = (self.threshold(), self.scale());
        let mut m = Vec::with_capacity(b * t * d);
        for r in 0..b * t {
            let bits = self.row_bits(
                self.first_row + (r / t) as u64,
                self.first_position + (r % t) as u64,
            );
            m.extend((0..d).map(|j| match keep(bits, j as u32, threshold) {
                true => scale,
                false => 0.0,
            }));
        }
        Tensor::from_vec(m, (b, t, d), &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(dev)
    }

    fn check(&self, what: &str, a: &Tensor) -> Result<(usize, usize, usize)> {
        if !(0.0..1.0).contains(&self.p) {
            bail!(
                "{what}: the dropout probability must be in [0, 1), got {}",
                self.p
            );
        }
        match a.dims() {
            &[b, t, d] => Ok((b, t, d)),
            dims => bail!("{what}: expected a [B, T, d] tensor, got {dims:?}"),
        }
    }
}

#[inline(always)]
fn keep(bits: u32, feature: u32, threshold: u32) -> bool {
    fmix32(feature.wrapping_mul(GOLDEN) ^ bits) >= threshold
}

simd! {
    /// Rows `first..` of a `[·, t, d]` tensor, as many as `y` holds: `y = x + a ⊙ m · s`
    /// (`x` absent: `y = a ⊙ m · s`), writing every element of `y` (as long as `a`).
    fn drop_rows<T>(
        m: &DropoutMask,
        t: usize,
        d: usize,
        first: usize,
        x: Option<&[T]>,
        a: &[T],
        y: &mut [MaybeUninit<T>],
    ) {
        let (threshold, scale, zero) = (m.threshold(), T::from_f64(m.scale()), T::from_f64(0.0));
        for (i, (yr, ar)) in y.chunks_mut(d).zip(a.chunks(d)).enumerate() {
            let r = first + i;
            let bits = m.row_bits(
                m.first_row + (r / t) as u64,
                m.first_position + (r % t) as u64,
            );
            let factor = |j: usize| match keep(bits, j as u32, threshold) {
                true => scale,
                false => zero,
            };
            match x {
                Some(x) => {
                    let xr = &x[i * d..(i + 1) * d];
                    for (j, ((o, &v), &u)) in yr.iter_mut().zip(ar).zip(xr).enumerate() {
                        o.write(u + v * factor(j));
                    }
                }
                None => {
                    for (j, (o, &v)) in yr.iter_mut().zip(ar).enumerate() {
                        o.write(v * factor(j));
                    }
                }
            }
        }
    }
}

/// `y = x + a ⊙ m / (1 − p)` (`x` absent: `y = a ⊙ m / (1 − p)`) for contiguous
/// `[b, t, d]` inputs, the rows split over the pool's threads.
fn forward<T: Float>(
    m: &DropoutMask,
    (b, t, d): (usize, usize, usize),
    x: Option<&[T]>,
    a: &[T],
) -> Result<Vec<T>> {
    let n = b * t * d;
    if a.len() != n || x.is_some_and(|x| x.len() != n) {
        bail!("dropout: {} elements for a [{b}, {t}, {d}] tensor", a.len());
    }
    let mut y = Uninit::<T>::new(n)?;
    let rows = kernel::rows_per_task(b * t);
    let per = (rows * d).max(1);
    y.as_mut()
        .par_chunks_mut(per)
        .enumerate()
        .for_each(|(k, y)| {
            let at = k * per..k * per + y.len();
            let x = x.map(|x| &x[at.clone()]);
            drop_rows(m, t, d, k * rows, x, &a[at], y);
        });
    // SAFETY: the tasks' chunks cover `y`, each whole rows of `d` (`per` is a multiple
    // of `d`), and `drop_rows` writes every element of its chunk, as long as its `a`.
    Ok(unsafe { y.assume_init() })
}

/// `a ⊙ m / (1 − p)` for `a` `[B, T, d]`: the fused op on CPU f32 and f64 tensors
/// ([`OpsBackend::Fused`]), the mask as a tensor multiplied in otherwise. With `p` = 0
/// it returns `a`.
pub fn dropout(a: &Tensor, mask: &DropoutMask, backend: OpsBackend) -> Result<Tensor> {
    let dims = mask.check("dropout", a)?;
    if mask.p == 0.0 {
        return Ok(a.clone());
    }
    match fused(backend, &[a]) {
        true => a.contiguous()?.apply_op1(Dropout(*mask)),
        false => a * mask.tensor(dims, a.dtype(), a.device())?,
    }
}

/// `x + a ⊙ m / (1 − p)` for `x` and `a` `[B, T, d]`: a residual sum with dropout on its
/// branch, in one pass where [`dropout`] fuses (and keeping nothing more than the sum).
pub fn dropout_add(
    x: &Tensor,
    a: &Tensor,
    mask: &DropoutMask,
    backend: OpsBackend,
) -> Result<Tensor> {
    let dims = mask.check("dropout_add", a)?;
    if x.dims() != a.dims() {
        bail!("dropout_add: x {:?} and a {:?} differ", x.dims(), a.dims());
    }
    if mask.p == 0.0 {
        return x + a;
    }
    match fused(backend, &[x, a]) {
        true => x
            .contiguous()?
            .apply_op2(&a.contiguous()?, DropoutAdd(*mask)),
        false => x + (a * mask.tensor(dims, a.dtype(), a.device())?)?,
    }
}

fn fused(backend: OpsBackend, ts: &[&Tensor]) -> bool {
    backend == OpsBackend::Fused
        && ts
            .iter()
            .all(|t| t.device().is_cpu() && t.dtype() == ts[0].dtype())
        && matches!(ts[0].dtype(), DType::F32 | DType::F64)
}

/// `a ⊙ m / (1 − p)`; its backward is itself on the gradient.
#[derive(Clone)]
struct Dropout(DropoutMask);

/// `x + a ⊙ m / (1 − p)`.
struct DropoutAdd(DropoutMask);

/// The fused forward on CPU storage: `x` (if any) and `a` each with its layout.
fn run(
    m: &DropoutMask,
    name: &str,
    x: Option<(&CpuStorage, &Layout)>,
    (a, l): (&CpuStorage, &Layout),
) -> Result<CpuStorage> {
    let dims = match l.dims() {
        &[b, t, d] => (b, t, d),
        dims => bail!("{name}: expected a [B, T, d] tensor, got {dims:?}"),
    };
    if let Some((_, lx)) = x {
        if lx.dims() != l.dims() {
            bail!("{name}: shapes {:?} and {:?} differ", lx.dims(), l.dims());
        }
    }
    fn go<T: Float>(
        m: &DropoutMask,
        name: &str,
        dims: (usize, usize, usize),
        x: Option<(&CpuStorage, &Layout)>,
        (a, l): (&CpuStorage, &Layout),
    ) -> Result<Vec<T>> {
        let x = x.map(|(x, lx)| slice::<T>(x, lx, name)).transpose()?;
        forward::<T>(m, dims, x, slice::<T>(a, l, name)?)
    }
    Ok(match a.dtype() {
        DType::F32 => CpuStorage::F32(go::<f32>(m, name, dims, x, (a, l))?),
        DType::F64 => CpuStorage::F64(go::<f64>(m, name, dims, x, (a, l))?),
        d => bail!("{name}: unsupported dtype {d:?}"),
    })
}

impl CustomOp1 for Dropout {
    fn name(&self) -> &'static str {
        "switchyard-dropout"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        Ok((run(&self.0, self.name(), None, (s, l))?, l.shape().clone()))
    }

    fn bwd(&self, _a: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(grad.contiguous()?.apply_op1_no_bwd(self)?))
    }
}

impl CustomOp2 for DropoutAdd {
    fn name(&self) -> &'static str {
        "switchyard-dropout-add"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let y = run(&self.0, self.name(), Some((s1, l1)), (s2, l2))?;
        Ok((y, l2.shape().clone()))
    }

    fn bwd(
        &self,
        _x: &Tensor,
        _a: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let g = grad.contiguous()?;
        let ga = g.apply_op1_no_bwd(&Dropout(self.0))?;
        Ok((Some(g), Some(ga)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;

    fn mask(p: f64) -> DropoutMask {
        DropoutMask {
            p,
            key: DropoutMask::step_key(7, 3),
            site: 5,
            first_row: 0,
            first_position: 0,
        }
    }

    /// The kept fraction is `1 − p` (a fixed hash: the count is the same every run,
    /// and within 4 standard deviations of its mean for these 2¹⁸ draws).
    #[test]
    #[cfg_attr(
        miri,
        ignore = "safe arithmetic on many draws: slow under Miri, nothing for it to check"
    )]
    fn keeps_one_minus_p_of_the_elements() {
        for p in [0.1, 0.5, 0.9] {
            let m = mask(p);
            let (rows, t, d) = (16, 64, 256);
            let kept = (0..rows * t * d)
                .filter(|&i| m.keeps(i / (t * d), (i / d) % t, i % d))
                .count() as f64;
            let n = (rows * t * d) as f64;
            let sd = (n * p * (1.0 - p)).sqrt();
            assert!(
                (kept - n * (1.0 - p)).abs() < 4.0 * sd,
                "p {p}: kept {kept} of {n}"
            );
        }
        assert!((0..1000).all(|j| mask(0.0).keeps(1, 2, j)));
    }

    /// What makes every layout train the same model: the mask of a slice of the batch
    /// or of the sequence, told where it starts, is that slice of the whole tensor's.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "safe arithmetic on many draws: slow under Miri, nothing for it to check"
    )]
    fn a_slice_draws_the_mask_of_its_place_in_the_whole() {
        let whole = mask(0.3);
        let (b, t, d) = (4, 6, 10);
        for (row0, pos0) in [(1, 0), (2, 3), (3, 5)] {
            let part = DropoutMask {
                first_row: row0 as u64,
                first_position: pos0 as u64,
                ..whole
            };
            for (r, p, f) in (0..b - row0)
                .flat_map(|r| (0..t - pos0).flat_map(move |p| (0..d).map(move |f| (r, p, f))))
            {
                assert_eq!(part.keeps(r, p, f), whole.keeps(row0 + r, pos0 + p, f));
            }
        }
    }

    /// Another step, site, row or position draws another mask: the two agree on about
    /// `p² + (1 − p)²` of the elements, as independent draws would.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "safe arithmetic on many draws: slow under Miri, nothing for it to check"
    )]
    fn other_coordinates_draw_other_masks() {
        let m = mask(0.5);
        let others = [
            DropoutMask {
                key: DropoutMask::step_key(7, 4),
                ..m
            },
            DropoutMask {
                key: DropoutMask::step_key(8, 3),
                ..m
            },
            DropoutMask { site: 6, ..m },
            DropoutMask { first_row: 1, ..m },
            DropoutMask {
                first_position: 1,
                ..m
            },
        ];
        let n = 64 * 512;
        for o in others {
            let same = (0..n)
                .filter(|&i| m.keeps(0, i / 512, i % 512) == o.keeps(0, i / 512, i % 512))
                .count() as f64;
            let sd = (n as f64 * 0.25).sqrt();
            assert!(
                (same - n as f64 * 0.5).abs() < 4.0 * sd,
                "{o:?}: {same} of {n} agree"
            );
        }
    }

    /// The fused forward on slices, on two threads (also under Miri): each element is
    /// `x + a · 1/(1 − p)` where kept and `x` where dropped, in every task's chunk.
    #[test]
    fn the_forward_drops_and_scales_every_element() {
        let (b, t, d) = (3, 5, 7);
        let n = b * t * d;
        let a = kernel::test_data(n, 1, 2.0);
        let x = kernel::test_data(n, 2, 1.0);
        let m = mask(0.25);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let y = pool
            .install(|| forward::<f64>(&m, (b, t, d), Some(&x), &a))
            .unwrap();
        let z = pool
            .install(|| forward::<f64>(&m, (b, t, d), None, &a))
            .unwrap();
        let mut dropped = 0;
        for i in 0..n {
            let keep = m.keeps(i / (t * d), (i / d) % t, i % d);
            let v = if keep { a[i] * (1.0 / 0.75) } else { 0.0 };
            dropped += usize::from(!keep);
            assert_eq!(z[i], v, "element {i}");
            assert_eq!(y[i], x[i] + v, "element {i}");
        }
        assert!(dropped > 0 && dropped < n, "{dropped} of {n} dropped");
        assert!(forward::<f64>(&m, (b, t, d), None, &a[1..]).is_err());
    }

    /// The fused ops against the mask tensor multiplied in (the composed path): the same
    /// values and gradients, bit for bit, in f32 and f64.
    #[test]
    #[cfg_attr(miri, ignore = "candle's tensors read /sys")]
    fn the_fused_ops_match_the_mask_tensor() -> Result<()> {
        let dev = Device::Cpu;
        let m = DropoutMask {
            first_row: 9,
            first_position: 4,
            ..mask(0.2)
        };
        for dtype in [DType::F32, DType::F64] {
            let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 3, 8), &dev)?.to_dtype(dtype)?)?;
            let a = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 3, 8), &dev)?.to_dtype(dtype)?)?;
            let w = Tensor::randn(0f32, 1.0, (2, 3, 8), &dev)?.to_dtype(dtype)?;
            let run = |backend, add: bool| -> Result<Vec<Vec<f64>>> {
                let y = match add {
                    true => dropout_add(x.as_tensor(), a.as_tensor(), &m, backend)?,
                    false => dropout(a.as_tensor(), &m, backend)?,
                };
                let g = (&y * &w)?.sum_all()?.backward()?;
                let flat = |t: &Tensor| -> Result<Vec<f64>> {
                    t.to_dtype(DType::F64)?.flatten_all()?.to_vec1()
                };
                let mut out = vec![flat(&y)?, flat(g.get(a.as_tensor()).unwrap())?];
                if add {
                    out.push(flat(g.get(x.as_tensor()).unwrap())?);
                }
                Ok(out)
            };
            for add in [false, true] {
                let fused = run(OpsBackend::Fused, add)?;
                assert_eq!(
                    fused,
                    run(OpsBackend::Composed, add)?,
                    "{dtype:?}, add {add}"
                );
                // Some of `a`'s gradient is dropped.
                assert!(fused[1].contains(&0.0));
            }
        }
        let bad = DropoutMask { p: 1.0, ..m };
        let t = Tensor::zeros((1, 2, 3), DType::F32, &dev)?;
        assert!(dropout(&t, &bad, OpsBackend::Fused).is_err());
        assert!(dropout(&t.flatten_all()?, &m, OpsBackend::Fused).is_err());
        assert!(dropout_add(&t, &t.reshape((2, 1, 3))?, &m, OpsBackend::Fused).is_err());
        Ok(())
    }
}
