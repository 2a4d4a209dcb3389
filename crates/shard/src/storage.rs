//! Freeing a tensor's storage in place and filling it again, for parameters that live
//! as shards between their uses (ZeRO stage 3, FSDP).
//!
//! A candle tensor shares its storage with every clone of it, including the ones an
//! autograd graph saved. [`free_in_place`] swaps that storage's values for an empty
//! vector: the memory goes back, every handle stays valid, and [`fill_in_place`] writes
//! the values back into the same storage before anything reads it again. Reading a
//! freed tensor is a bug of the caller; candle then fails an index check (a panic, not
//! undefined behaviour).

use candle_core::{CpuStorage, InplaceOp1, Layout, Result, Tensor};

/// A tensor whose storage holds exactly its own elements, contiguous from offset 0: the
/// only kind freed and filled in place (a view into a larger storage would free its
/// neighbours too).
fn check_whole(what: &str, t: &Tensor) -> Result<()> {
    let l = t.layout();
    if !t.device().is_cpu() {
        candle_core::bail!(
            "{what}: tensors are freed and filled in place on the CPU only, this one is on {:?}",
            t.device().location()
        );
    }
    if !l.is_contiguous() || l.start_offset() != 0 {
        candle_core::bail!(
            "{what}: only a contiguous tensor that owns its storage can be freed in place"
        );
    }
    Ok(())
}

/// Whether [`free_in_place`] takes `t`: a contiguous CPU tensor from offset 0 of its
/// storage.
pub fn can_free_in_place(t: &Tensor) -> bool {
    check_whole("free in place", t).is_ok()
}

/// Frees the values of `t` (and of every tensor that shares its storage), keeping the
/// tensor: its storage becomes empty until [`fill_in_place`].
pub fn free_in_place(t: &Tensor) -> Result<()> {
    check_whole("free in place", t)?;
    t.inplace_op1(&Free)
}

/// Writes `values` (as many elements as `t`, of its dtype, any layout) into the storage
/// of `t`, which may have been freed by [`free_in_place`].
pub fn fill_in_place(t: &Tensor, values: &Tensor) -> Result<()> {
    check_whole("fill in place", t)?;
    if values.elem_count() != t.elem_count() || values.dtype() != t.dtype() {
        candle_core::bail!(
            "fill in place: {:?} {:?} into a tensor of {:?} {:?}",
            values.dtype(),
            values.dims(),
            t.dtype(),
            t.dims()
        );
    }
    let flat = values.flatten_all()?;
    let data = match t.dtype() {
        candle_core::DType::F32 => CpuStorage::F32(flat.to_vec1()?),
        candle_core::DType::F64 => CpuStorage::F64(flat.to_vec1()?),
        dt => candle_core::bail!("fill in place: {dt:?} tensors are not supported"),
    };
    t.inplace_op1(&Fill(std::sync::Mutex::new(Some(data))))
}

/// Writes `t`'s values (f32) in place with `f`, which gets a buffer of its element count
/// to fill (row-major): the one new allocation is the storage itself.
pub fn fill_f32_with(t: &Tensor, f: impl FnOnce(&mut [f32]) -> Result<()>) -> Result<()> {
    check_whole("fill in place", t)?;
    if t.dtype() != candle_core::DType::F32 {
        candle_core::bail!("fill in place: an f32 tensor expected, got {:?}", t.dtype());
    }
    let mut data = vec![0f32; t.elem_count()];
    f(&mut data)?;
    t.inplace_op1(&Fill(std::sync::Mutex::new(Some(CpuStorage::F32(data)))))
}

/// Runs `f` on the f32 values of `t` (flattened) when it is a contiguous f32 CPU tensor
/// (without a copy), else on a copy of them. `f` may fail with any error a candle error
/// converts into.
pub fn with_f32_values<R, E: From<candle_core::Error>>(
    t: &Tensor,
    f: impl FnOnce(&[f32]) -> std::result::Result<R, E>,
) -> std::result::Result<R, E> {
    {
        let (s, l) = t.storage_and_layout();
        if let (candle_core::Storage::Cpu(CpuStorage::F32(v)), true) = (&*s, l.is_contiguous()) {
            let a = l.start_offset();
            return f(&v[a..a + l.shape().elem_count()]);
        }
    }
    let copy = t
        .to_dtype(candle_core::DType::F32)?
        .to_device(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    f(&copy)
}

/// Whether the storage of `t` is empty (freed).
pub fn is_freed(t: &Tensor) -> bool {
    let (s, _) = t.storage_and_layout();
    let empty = match &*s {
        candle_core::Storage::Cpu(CpuStorage::F32(v)) => v.is_empty(),
        candle_core::Storage::Cpu(CpuStorage::F64(v)) => v.is_empty(),
        _ => false,
    };
    empty && t.elem_count() > 0
}

struct Free;

impl InplaceOp1 for Free {
    fn name(&self) -> &'static str {
        "free-in-place"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> Result<()> {
        *s = match s {
            CpuStorage::F32(_) => CpuStorage::F32(Vec::new()),
            CpuStorage::F64(_) => CpuStorage::F64(Vec::new()),
            _ => candle_core::bail!("free in place: only f32 and f64 tensors are supported"),
        };
        Ok(())
    }
}

struct Fill(std::sync::Mutex<Option<CpuStorage>>);

impl InplaceOp1 for Fill {
    fn name(&self) -> &'static str {
        "fill-in-place"
    }
    fn cpu_fwd(&self, s: &mut CpuStorage, _: &Layout) -> Result<()> {
        let mut data = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match data.take() {
            Some(d) => *s = d,
            None => candle_core::bail!("fill in place: applied twice"),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn a_freed_tensor_keeps_its_handles_and_is_filled_back_in_place() {
        let v = Var::new(&[[1f32, 2.], [3., 4.]], &Device::Cpu).unwrap();
        let saved = v.as_tensor().clone(); // what a graph would keep
        free_in_place(v.as_tensor()).unwrap();
        assert!(is_freed(&saved));
        let back = Tensor::new(&[[5f32, 6.], [7., 8.]], &Device::Cpu).unwrap();
        fill_in_place(v.as_tensor(), &back).unwrap();
        assert!(!is_freed(&saved));
        assert_eq!(saved.to_vec2::<f32>().unwrap(), [[5., 6.], [7., 8.]]);
        // The wrong size or a view are refused.
        assert!(fill_in_place(v.as_tensor(), &back.narrow(0, 0, 1).unwrap()).is_err());
        assert!(free_in_place(&saved.narrow(0, 1, 1).unwrap()).is_err());
    }
}
