//! What travels besides tensor data, and how tensors become words and back.
//!
//! Everything is sent in 64-bit words (`MPI_UINT64_T`): headers are words, and tensor
//! data is copied into word buffers padded to 8 bytes, so every payload starts aligned
//! for any dtype and MPI's `int` counts reach 16 GiB.
//!
//! * A **descriptor** ([`Desc`]) is what every rank brings to a collective: it is
//!   all-gathered first, so ranks that disagree fail with `Mismatch` before any data
//!   moves. [`Desc::call`] renders it as the local backend describes a call.
//! * A **message** (point-to-point) is `[MAGIC, tag, dtype, ndims, dims…, data…]`.
//! * A **part header** (all-to-all) is `[dtype, ndims, dims…]`, fixed size.

use candle_core::{DType, Device, Tensor};

use crate::reduce::{with_dtype, with_slices};
use crate::{ReduceOp, Tag};

/// The most dims of a tensor in a collective (descriptors and part headers are fixed-size).
pub(super) const MAX_DIMS: usize = 16;
/// Words in a descriptor.
pub(super) const DESC_WORDS: usize = 8 + MAX_DIMS;
/// Words in an all-to-all part header.
pub(super) const PART_WORDS: usize = 2 + MAX_DIMS;
/// The first word of every point-to-point message.
const MAGIC: u64 = 0x5357_5944_0001_0001;

/// A collective operation, as it is coded in descriptors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Op {
    AllReduce = 1,
    AllGather,
    ReduceScatter,
    Broadcast,
    AllToAll,
    Barrier,
    Split,
}

impl Op {
    const ALL: [Op; 7] = [
        Op::AllReduce,
        Op::AllGather,
        Op::ReduceScatter,
        Op::Broadcast,
        Op::AllToAll,
        Op::Barrier,
        Op::Split,
    ];

    /// The name the local backend gives the operation (used in every error).
    pub fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::AllToAll => "all_to_all",
            Op::Barrier => "barrier",
            Op::Split => "split",
        }
    }
}

/// Every candle dtype, so that descriptors can name any; the data path moves the first
/// seven (those of `crate::reduce::with_dtype`).
const DTYPES: [DType; 14] = [
    DType::F32,
    DType::F64,
    DType::BF16,
    DType::F16,
    DType::U8,
    DType::U32,
    DType::I64,
    DType::I16,
    DType::I32,
    DType::F8E4M3,
    DType::F6E2M3,
    DType::F6E3M2,
    DType::F4,
    DType::F8E8M0,
];
const REDUCE_OPS: [ReduceOp; 3] = [ReduceOp::Sum, ReduceOp::Mean, ReduceOp::Max];

/// The code of a dtype (never 0), or an error naming it.
pub(super) fn dtype_code(dtype: DType) -> Result<u64, String> {
    DTYPES
        .iter()
        .position(|&d| d == dtype)
        .map(|i| i as u64 + 1)
        .ok_or_else(|| format!("dtype {dtype:?} is not supported by the MPI transport"))
}

fn dtype_of(code: u64) -> Result<DType, String> {
    (code as usize)
        .checked_sub(1)
        .and_then(|i| DTYPES.get(i).copied())
        .ok_or_else(|| format!("unknown dtype code {code}"))
}

/// What one rank brings to a collective.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Desc {
    pub op: Op,
    pub dtype: Option<DType>,
    pub dims: Option<Vec<usize>>,
    pub reduce: Option<ReduceOp>,
    pub dim: Option<usize>,
    pub root: Option<usize>,
    pub color_key: (usize, usize),
}

impl Desc {
    pub fn new(op: Op) -> Desc {
        Desc {
            op,
            dtype: None,
            dims: None,
            reduce: None,
            dim: None,
            root: None,
            color_key: (0, 0),
        }
    }

    /// A descriptor that carries `t`'s dtype and shape.
    pub fn of(op: Op, t: &Tensor) -> Desc {
        Desc {
            dtype: Some(t.dtype()),
            dims: Some(t.dims().to_vec()),
            ..Desc::new(op)
        }
    }

    /// The fixed-size encoding. Fails for dtypes the backend does not move and for
    /// tensors of more than [`MAX_DIMS`] dims.
    pub fn encode(&self) -> Result<Vec<u64>, String> {
        let mut w = vec![0u64; DESC_WORDS];
        w[0] = self.op as u64;
        w[1] = self.dtype.map(dtype_code).transpose()?.unwrap_or(0);
        w[2] = self
            .reduce
            .map(|r| REDUCE_OPS.iter().position(|&o| o == r).unwrap() as u64 + 1)
            .unwrap_or(0);
        w[3] = self.dim.map(|d| d as u64 + 1).unwrap_or(0);
        w[4] = self.root.map(|r| r as u64 + 1).unwrap_or(0);
        w[5] = self.color_key.0 as u64;
        w[6] = self.color_key.1 as u64;
        if let Some(dims) = &self.dims {
            if dims.len() > MAX_DIMS {
                return Err(format!(
                    "the MPI transport's collectives take tensors of at most {MAX_DIMS} dims, \
                     got shape {dims:?}"
                ));
            }
            w[7] = dims.len() as u64 + 1;
            for (i, &d) in dims.iter().enumerate() {
                w[8 + i] = d as u64;
            }
        }
        Ok(w)
    }

    pub fn decode(w: &[u64]) -> Result<Desc, String> {
        let opt = |x: u64| (x as usize).checked_sub(1);
        let op = opt(w[0])
            .and_then(|i| Op::ALL.get(i).copied())
            .ok_or_else(|| format!("unknown operation code {}", w[0]))?;
        let dtype = match w[1] {
            0 => None,
            c => Some(dtype_of(c)?),
        };
        let reduce = match w[2] {
            0 => None,
            c => Some(
                *REDUCE_OPS
                    .get(c as usize - 1)
                    .ok_or_else(|| format!("unknown reduce op code {c}"))?,
            ),
        };
        let dims = match opt(w[7]) {
            None => None,
            Some(n) if n <= MAX_DIMS => Some(w[8..8 + n].iter().map(|&d| d as usize).collect()),
            Some(n) => return Err(format!("descriptor with {n} dims")),
        };
        Ok(Desc {
            op,
            dtype,
            dims,
            reduce,
            dim: opt(w[3]),
            root: opt(w[4]),
            color_key: (w[5] as usize, w[6] as usize),
        })
    }

    /// The call as the local backend describes it, e.g.
    /// `all_reduce(shape [4, 8], F32, Sum)`. Ranks agree when these strings are equal.
    pub fn call(&self) -> String {
        let shape = format!("shape {:?}", self.dims.as_deref().unwrap_or(&[]));
        let dtype = self.dtype.map(|d| format!("{d:?}")).unwrap_or_default();
        let args = match self.op {
            Op::AllReduce => format!(
                "{shape}, {dtype}, {:?}",
                self.reduce.unwrap_or(ReduceOp::Sum)
            ),
            Op::AllGather => format!("{shape}, {dtype}, dim {}", self.dim.unwrap_or(0)),
            Op::ReduceScatter => format!(
                "{shape}, {dtype}, dim {}, {:?}",
                self.dim.unwrap_or(0),
                self.reduce.unwrap_or(ReduceOp::Sum)
            ),
            Op::Broadcast => format!("root {}", self.root.unwrap_or(0)),
            Op::AllToAll | Op::Barrier | Op::Split => String::new(),
        };
        format!("{}({args})", self.op.name())
    }
}

/// Words needed for `bytes` bytes of data.
fn words_for(bytes: usize) -> usize {
    bytes.div_ceil(8)
}

/// The number of words of `t`'s data.
pub(super) fn data_words(t: &Tensor) -> usize {
    words_for(t.elem_count() * t.dtype().size_in_bytes())
}

/// Copies the data of the contiguous CPU tensor `t` into `dst` (at least
/// [`data_words`] long).
pub(super) fn write_data(t: &Tensor, dst: &mut [u64]) -> Result<(), String> {
    with_dtype!(t.dtype(), T => with_slices::<T, _>(std::slice::from_ref(t), |xs| {
        let bytes = std::mem::size_of_val(xs[0]);
        assert!(bytes <= dst.len() * 8, "word buffer too small");
        // SAFETY: `dst` holds at least `bytes` bytes and does not overlap the tensor.
        unsafe {
            let (from, to) = (xs[0].as_ptr().cast::<u8>(), dst.as_mut_ptr().cast::<u8>());
            std::ptr::copy_nonoverlapping(from, to, bytes)
        }
    }))
}

/// A tensor of `dtype` and `dims` from the data at the start of `src`.
pub(super) fn read_data(src: &[u64], dtype: DType, dims: &[usize]) -> Result<Tensor, String> {
    let n: usize = dims.iter().product();
    if words_for(n * dtype.size_in_bytes()) > src.len() {
        return Err(format!(
            "{} words of data for a tensor of shape {dims:?} {dtype:?}",
            src.len()
        ));
    }
    with_dtype!(dtype, T => {
        let mut v: Vec<T> = Vec::with_capacity(n);
        // SAFETY: `src` holds the `n` elements (checked above); every bit pattern is a
        // valid value of the dtypes the transport moves.
        unsafe {
            let (from, to) = (src.as_ptr().cast::<u8>(), v.as_mut_ptr().cast::<u8>());
            std::ptr::copy_nonoverlapping(from, to, n * std::mem::size_of::<T>());
            v.set_len(n);
        }
        Tensor::from_vec(v, dims, &Device::Cpu).map_err(|e| e.to_string())
    })
}

/// One point-to-point message: header, then data.
pub(super) fn encode_message(tag: Tag, t: &Tensor) -> Result<Vec<u64>, String> {
    let head = 4 + t.rank();
    let mut w = vec![0u64; head + data_words(t)];
    w[0] = MAGIC;
    w[1] = tag;
    w[2] = dtype_code(t.dtype())?;
    w[3] = t.rank() as u64;
    for (i, &d) in t.dims().iter().enumerate() {
        w[4 + i] = d as u64;
    }
    write_data(t, &mut w[head..])?;
    Ok(w)
}

/// The full tag and the tensor of a message made by [`encode_message`].
pub(super) fn decode_message(w: &[u64]) -> Result<(Tag, Tensor), String> {
    if w.len() < 4 || w[0] != MAGIC {
        return Err("received a message that is not a switchyard tensor".into());
    }
    let rank = w[3] as usize;
    let head = 4usize
        .checked_add(rank)
        .filter(|&h| h <= w.len())
        .ok_or("received a truncated message")?;
    let dims: Vec<usize> = w[4..head].iter().map(|&d| d as usize).collect();
    let t = read_data(&w[head..], dtype_of(w[2])?, &dims)?;
    Ok((w[1], t))
}

/// The fixed-size header of one all-to-all part.
pub(super) fn part_header(t: &Tensor) -> Result<[u64; PART_WORDS], String> {
    if t.rank() > MAX_DIMS {
        return Err(format!(
            "the MPI transport's collectives take tensors of at most {MAX_DIMS} dims, \
             got shape {:?}",
            t.dims()
        ));
    }
    let mut w = [0u64; PART_WORDS];
    w[0] = dtype_code(t.dtype())?;
    w[1] = t.rank() as u64;
    for (i, &d) in t.dims().iter().enumerate() {
        w[2 + i] = d as u64;
    }
    Ok(w)
}

/// The dtype, dims and data words of the part described by `w`.
pub(super) fn read_part_header(w: &[u64]) -> Result<(DType, Vec<usize>, usize), String> {
    let dtype = dtype_of(w[0])?;
    let rank = w[1] as usize;
    if rank > MAX_DIMS {
        return Err(format!("part header with {rank} dims"));
    }
    let dims: Vec<usize> = w[2..2 + rank].iter().map(|&d| d as usize).collect();
    let n: usize = dims.iter().product();
    Ok((dtype, dims, words_for(n * dtype.size_in_bytes())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptors_round_trip_and_describe_calls_like_the_local_backend() {
        let t = Tensor::zeros((4, 8), DType::F32, &Device::Cpu).unwrap();
        let d = Desc {
            reduce: Some(ReduceOp::Mean),
            ..Desc::of(Op::AllReduce, &t)
        };
        let back = Desc::decode(&d.encode().unwrap()).unwrap();
        assert_eq!(back, d);
        assert_eq!(d.call(), "all_reduce(shape [4, 8], F32, Mean)");
        let b = Desc {
            root: Some(3),
            ..Desc::of(Op::Broadcast, &t)
        };
        assert_eq!(
            Desc::decode(&b.encode().unwrap()).unwrap().call(),
            "broadcast(root 3)"
        );
        let s = Desc {
            color_key: (7, 2),
            ..Desc::new(Op::Split)
        };
        assert_eq!(Desc::decode(&s.encode().unwrap()).unwrap(), s);
    }

    #[test]
    fn messages_round_trip_every_dtype_and_odd_sizes() {
        for dtype in &DTYPES[..7] {
            let dtype = *dtype;
            for len in [0usize, 1, 3, 9] {
                let t = Tensor::arange(0u32, len as u32, &Device::Cpu)
                    .and_then(|t| t.to_dtype(dtype))
                    .and_then(|t| t.reshape((1, len)))
                    .unwrap();
                let (tag, back) =
                    decode_message(&encode_message(u64::MAX - 1, &t).unwrap()).unwrap();
                assert_eq!(tag, u64::MAX - 1);
                assert_eq!(back.dims(), t.dims());
                assert_eq!(back.dtype(), dtype);
                let v = |t: &Tensor| {
                    t.to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap()
                };
                assert_eq!(v(&back), v(&t));
            }
        }
    }

    #[test]
    fn too_many_dims_are_refused() {
        let t = Tensor::zeros(vec![1usize; MAX_DIMS + 1], DType::F32, &Device::Cpu).unwrap();
        assert!(Desc::of(Op::AllGather, &t).encode().is_err());
        assert!(part_header(&t).is_err());
        assert!(
            encode_message(0, &t).is_ok(),
            "point-to-point has no dims limit"
        );
    }
}
