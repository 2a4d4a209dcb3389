//! Element kernels shared by the backends: dtype dispatch, read access to a tensor's
//! contiguous CPU data, output buffers written in place by several threads, and the
//! rank-ordered reduction.

use std::mem::MaybeUninit;

use candle_core::{DType, Device, Shape, Storage, Tensor, WithDType};

use crate::ReduceOp;

/// Runs `$body` with `$T` bound to the Rust type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $T = f64;
                $body
            }
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            candle_core::DType::U8 => {
                type $T = u8;
                $body
            }
            candle_core::DType::U32 => {
                type $T = u32;
                $body
            }
            candle_core::DType::I64 => {
                type $T = i64;
                $body
            }
            other => {
                return Err(format!("dtype {other:?} is not supported by the transport"));
            }
        }
    };
}
pub(crate) use with_dtype;

/// The contiguous CPU data of `t` (after `t.contiguous()`), borrowed for `f`.
pub(crate) fn with_slices<T: WithDType, R>(
    ts: &[Tensor],
    f: impl FnOnce(&[&[T]]) -> R,
) -> Result<R, String> {
    let guards: Vec<_> = ts.iter().map(|t| t.storage_and_layout()).collect();
    let mut slices = Vec::with_capacity(ts.len());
    for (storage, layout) in guards.iter() {
        if !layout.is_contiguous() {
            return Err("internal: tensor not contiguous".into());
        }
        let all = match &**storage {
            Storage::Cpu(cpu) => cpu.as_slice::<T>().map_err(|e| e.to_string())?,
            _ => return Err("the in-process transport only moves CPU tensors".into()),
        };
        let start = layout.start_offset();
        slices.push(&all[start..start + layout.shape().elem_count()]);
    }
    Ok(f(&slices))
}

/// An output buffer that several threads fill in disjoint ranges, then turn into a tensor.
pub(crate) struct OutBuf {
    ptr: usize,
    len: usize,
    finish: Box<dyn FnOnce() -> candle_core::Result<Tensor> + Send>,
}

impl OutBuf {
    pub(crate) fn new(dtype: DType, shape: Shape) -> Result<OutBuf, String> {
        with_dtype!(dtype, T => Ok(Self::typed::<T>(shape)))
    }

    fn typed<T: WithDType>(shape: Shape) -> OutBuf {
        let len = shape.elem_count();
        let mut v: Vec<T> = Vec::with_capacity(len);
        let ptr = v.as_mut_ptr() as usize;
        let finish = Box::new(move || {
            // SAFETY: every element in 0..len was written by exactly one rank before the
            // barrier that runs `finish` (see the callers).
            unsafe { v.set_len(len) };
            Tensor::from_vec(v, shape, &Device::Cpu)
        });
        OutBuf { ptr, len, finish }
    }

    /// A handle for writing into the buffer from other threads.
    pub(crate) fn raw(&self) -> RawOut {
        RawOut {
            ptr: self.ptr,
            len: self.len,
        }
    }

    pub(crate) fn finish(self) -> candle_core::Result<Tensor> {
        (self.finish)()
    }
}

#[derive(Clone, Copy)]
pub(crate) struct RawOut {
    ptr: usize,
    len: usize,
}

impl RawOut {
    /// The elements `start..end` of the buffer.
    ///
    /// # Safety
    /// The buffer must hold `T`s, still be alive, and no other thread may access
    /// `start..end` until the next barrier.
    pub(crate) unsafe fn range<'a, T>(&self, start: usize, end: usize) -> &'a mut [MaybeUninit<T>] {
        assert!(start <= end && end <= self.len);
        std::slice::from_raw_parts_mut((self.ptr as *mut MaybeUninit<T>).add(start), end - start)
    }
}

/// The `r`-th of `n` near-equal pieces of `0..len`, with boundaries on 64-byte lines.
pub(crate) fn chunk(len: usize, n: usize, r: usize, elem_bytes: usize) -> (usize, usize) {
    let align = (64 / elem_bytes.max(1)).max(1);
    let edge = |i: usize| {
        if i >= n {
            len
        } else {
            (len * i / n) / align * align
        }
    };
    (edge(r), edge(r + 1))
}

/// `out[i] = op(inputs[0][off + i], inputs[1][off + i], …)`, reduced in rank order.
pub(crate) fn reduce_into<T: WithDType>(
    inputs: &[&[T]],
    off: usize,
    out: &mut [MaybeUninit<T>],
    op: ReduceOp,
) {
    let len = out.len();
    if inputs.len() == 1 {
        copy_into(&inputs[0][off..off + len], out);
        return;
    }
    // SAFETY: the first pass below writes every element before any is read.
    let out: &mut [T] = unsafe { &mut *(out as *mut [MaybeUninit<T>] as *mut [T]) };
    // Blocks small enough that the output block stays in L1 across the passes.
    const BLOCK: usize = 4096;
    let combine = |a: T, b: T| match op {
        ReduceOp::Sum | ReduceOp::Mean => a + b,
        ReduceOp::Max => {
            if b > a || b.to_f64().is_nan() {
                b
            } else {
                a
            }
        }
    };
    let mut start = 0;
    while start < len {
        let end = (start + BLOCK).min(len);
        let o = &mut out[start..end];
        let x0 = &inputs[0][off + start..off + end];
        let x1 = &inputs[1][off + start..off + end];
        for ((o, &a), &b) in o.iter_mut().zip(x0).zip(x1) {
            *o = combine(a, b);
        }
        for x in &inputs[2..] {
            for (o, &b) in o.iter_mut().zip(&x[off + start..off + end]) {
                *o = combine(*o, b);
            }
        }
        if op == ReduceOp::Mean {
            let d = T::from_f64(inputs.len() as f64);
            for o in o.iter_mut() {
                *o /= d;
            }
        }
        start = end;
    }
}

/// Copies `src` into `dst` (same length).
pub(crate) fn copy_into<T: Copy>(src: &[T], dst: &mut [MaybeUninit<T>]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        d.write(s);
    }
}
