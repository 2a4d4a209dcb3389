//! The collectives of the MPI backend. Each one starts with [`MpiComm::agree`] (an
//! all-gather of every rank's descriptor, which fails with `Mismatch` on every rank when
//! they differ), then moves the data with non-blocking MPI collectives and reduces with
//! the crate's rank-ordered kernel.

use std::cmp::Ordering;
use std::ffi::{c_int, c_void};
use std::mem::{size_of, MaybeUninit};

use candle_core::{Device, Tensor, WithDType};
use mpi::ffi;

use super::comm::{count, MpiComm};
use super::runtime::Poll;
use super::wire::{self, Desc, Op, DESC_WORDS};
use crate::args;
use crate::reduce::{chunk, reduce_into, with_dtype, with_slices};
use crate::{CommError, ReduceOp, Result};

/// Words of data that may ride with a descriptor (1 KiB): all-reduces this small take
/// one round.
const INLINE_WORDS: usize = 128;
/// Words per rank in the descriptor exchange.
const STRIDE: usize = DESC_WORDS + INLINE_WORDS;

/// Below this many bytes gathered (world size × buffer), all-reduce all-gathers whole
/// buffers and reduces locally: one round instead of two.
const SMALL_ALL_REDUCE: usize = 64 << 10;

/// The MPI datatype that moves elements of `T` (as unsigned words of its size).
fn elem_type<T>() -> ffi::MPI_Datatype {
    // SAFETY: reading MPI's predefined datatype handles.
    unsafe {
        match size_of::<T>() {
            1 => ffi::RSMPI_UINT8_T,
            2 => ffi::RSMPI_UINT16_T,
            4 => ffi::RSMPI_UINT32_T,
            _ => ffi::RSMPI_UINT64_T,
        }
    }
}

pub(super) fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading MPI's predefined null request.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// A word buffer viewed as elements of `T` (every dtype the transport moves is plain
/// data aligned to at most 8 bytes).
fn elems<T: WithDType>(words: &mut [u64]) -> &mut [T] {
    let n = std::mem::size_of_val(words) / size_of::<T>();
    // SAFETY: see above; the length covers the same bytes.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<T>(), n) }
}

/// # Safety
/// Only for writing: the caller must not write uninitialised values through the result.
unsafe fn as_uninit<T>(xs: &mut [T]) -> &mut [MaybeUninit<T>] {
    &mut *(xs as *mut [T] as *mut [MaybeUninit<T>])
}

/// The number of elements before `dim` and from `dim` on.
fn outer_inner(dims: &[usize], dim: usize) -> (usize, usize) {
    (dims[..dim].iter().product(), dims[dim..].iter().product())
}

/// MPI counts and displacements from element counts.
pub(super) fn counts(
    op: &'static str,
    c: &MpiComm,
    xs: impl IntoIterator<Item = usize>,
) -> Result<Vec<c_int>> {
    xs.into_iter()
        .map(|x| count(x).map_err(|e| c.backend(op, e)))
        .collect()
}

/// Runs `$body` with `$T` bound to `$dtype`'s Rust type; an unsupported dtype is a
/// backend error of `$op`.
macro_rules! typed {
    ($self:ident, $op:expr, $dtype:expr, $T:ident => $body:expr) => {{
        let r: std::result::Result<Result<_>, String> = (|| with_dtype!($dtype, $T => Ok($body)))();
        r.map_err(|e| $self.backend($op, e))?
    }};
}

impl MpiComm {
    /// Exchanges descriptors; every rank returns `Mismatch` if any two differ.
    pub(super) fn agree(&self, desc: &Desc, poll: &Poll) -> Result<Vec<Desc>> {
        self.exchange(desc, None, poll).map(|(descs, _)| descs)
    }

    /// [`MpiComm::agree`], with up to [`INLINE_WORDS`] words of `inline` data from every
    /// rank riding along: returns the descriptors and everything gathered (rank `r`'s
    /// data at `r * STRIDE + DESC_WORDS`). Every collective exchanges the same number of
    /// words here, whatever it is, so that ranks that disagree can tell.
    fn exchange(
        &self,
        desc: &Desc,
        inline: Option<&Tensor>,
        poll: &Poll,
    ) -> Result<(Vec<Desc>, Vec<u64>)> {
        let op = desc.op.name();
        self.rt.check(op, self.global(), self.group())?;
        let mut mine = desc.encode().map_err(|e| self.invalid(op, e))?;
        mine.resize(STRIDE, 0);
        if let Some(t) = inline {
            wire::write_data(t, &mut mine[DESC_WORDS..]).map_err(|e| self.backend(op, e))?;
        }
        let mut all: Vec<u64> = vec![0; self.n * STRIDE];
        let mut req = null_request();
        // SAFETY: both buffers are kept alive by `wait`.
        self.mpi(op, || unsafe {
            ffi::MPI_Iallgather(
                mine.as_ptr() as *const c_void,
                STRIDE as c_int,
                ffi::RSMPI_UINT64_T,
                all.as_mut_ptr() as *mut c_void,
                STRIDE as c_int,
                ffi::RSMPI_UINT64_T,
                self.comm.0,
                &mut req,
            )
        })?;
        let (_, all) = self.wait(op, self.group(), poll, vec![req], (mine, all))?;
        let descs = all
            .chunks(STRIDE)
            .map(|w| Desc::decode(&w[..DESC_WORDS]))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| self.backend(op, e))?;
        let first = descs[0].call();
        for (r, d) in descs.iter().enumerate().skip(1) {
            let call = d.call();
            if call != first {
                return Err(self.mismatch(
                    op,
                    format!("rank 0 called {first} but rank {r} called {call}"),
                ));
            }
        }
        Ok((descs, all))
    }

    pub(super) fn mismatch(&self, op: &'static str, reason: String) -> CommError {
        CommError::Mismatch {
            op,
            rank: self.global(),
            group: self.label.clone(),
            reason,
        }
    }

    /// The contiguous data of `x` as `&[T]`, borrowed for `f`.
    fn with_data<T: WithDType, R>(
        &self,
        op: &'static str,
        x: &Tensor,
        f: impl FnOnce(&[T]) -> Result<R>,
    ) -> Result<R> {
        with_slices::<T, _>(std::slice::from_ref(x), |xs| f(xs[0]))
            .map_err(|e| self.backend(op, e))?
    }

    fn tensor<T: WithDType>(&self, op: &'static str, v: Vec<T>, dims: &[usize]) -> Result<Tensor> {
        Tensor::from_vec(v, dims, &Device::Cpu).map_err(|e| self.backend(op, e))
    }

    /// A group of one only checks that this process has not failed.
    pub(super) fn alone(&self, op: &'static str) -> Result<bool> {
        self.rt.check(op, self.global(), self.group())?;
        Ok(self.n == 1)
    }

    pub(super) fn all_reduce_impl(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        let x = self.contiguous(OP, t)?;
        if self.alone(OP)? {
            return Ok(x);
        }
        let poll = Poll::new(self.rt.timeout);
        let desc = Desc {
            reduce: Some(op),
            ..Desc::of(Op::AllReduce, &x)
        };
        if wire::data_words(&x) <= INLINE_WORDS {
            // Small enough to ride with the descriptors: one round in all.
            let (_, all) = self.exchange(&desc, Some(&x), &poll)?;
            return typed!(self, OP, x.dtype(), T => {
                let v = self.reduce_inline::<T>(all, x.elem_count(), op);
                self.tensor(OP, v, x.dims())
            });
        }
        self.agree(&desc, &poll)?;
        typed!(self, OP, x.dtype(), T => {
            let v = self.all_reduce_t::<T>(&x, op, &poll);
            v.and_then(|v| self.tensor(OP, v, x.dims()))
        })
    }

    /// Reduces, in rank order, the `len` elements every rank sent with its descriptor.
    fn reduce_inline<T: WithDType>(&self, mut all: Vec<u64>, len: usize, op: ReduceOp) -> Vec<T> {
        let per = STRIDE * 8 / size_of::<T>();
        let at = DESC_WORDS * 8 / size_of::<T>();
        let view = elems::<T>(&mut all);
        let inputs: Vec<&[T]> = (0..self.n)
            .map(|r| &view[r * per + at..r * per + at + len])
            .collect();
        let mut out: Vec<T> = Vec::with_capacity(len);
        reduce_into(&inputs, 0, &mut out.spare_capacity_mut()[..len], op);
        // SAFETY: `reduce_into` wrote every element.
        unsafe { out.set_len(len) };
        out
    }

    fn all_reduce_t<T: WithDType>(&self, x: &Tensor, op: ReduceOp, poll: &Poll) -> Result<Vec<T>> {
        const OP: &str = "all_reduce";
        let (n, me, dt) = (self.n, self.me, elem_type::<T>());
        self.with_data::<T, _>(OP, x, |xs| {
            let len = xs.len();
            let mut out: Vec<T> = Vec::with_capacity(len);
            let mut req = null_request();
            if len * n * size_of::<T>() <= SMALL_ALL_REDUCE {
                // Everyone gets every input and reduces it all.
                let mut all: Vec<T> = Vec::with_capacity(n * len);
                let c = count(len).map_err(|e| self.backend(OP, e))?;
                // SAFETY: `xs` is borrowed for this call; `all` is kept alive by `wait`.
                self.mpi(OP, || unsafe {
                    ffi::MPI_Iallgather(
                        xs.as_ptr() as *const c_void,
                        c,
                        dt,
                        all.as_mut_ptr() as *mut c_void,
                        c,
                        dt,
                        self.comm.0,
                        &mut req,
                    )
                })?;
                let (mut all, _) =
                    self.wait(OP, self.group(), poll, vec![req], (all, x.clone()))?;
                // SAFETY: the all-gather wrote all `n * len` elements.
                unsafe { all.set_len(n * len) };
                let inputs: Vec<&[T]> = all.chunks(len).collect();
                reduce_into(&inputs, 0, &mut out.spare_capacity_mut()[..len], op);
                // SAFETY: `reduce_into` wrote every element.
                unsafe { out.set_len(len) };
                return Ok(out);
            }
            // Reduce-scatter: rank r receives the r-th chunk of every other input into
            // the group's scratch buffer...
            let bounds: Vec<(usize, usize)> =
                (0..n).map(|d| chunk(len, n, d, size_of::<T>())).collect();
            let sizes = counts(OP, self, bounds.iter().map(|&(s, e)| e - s))?;
            let starts = counts(OP, self, bounds.iter().map(|&(s, _)| s))?;
            let (s0, e0) = bounds[me];
            let m = e0 - s0;
            let others = |d: usize, k: usize| if d == me { 0 } else { k };
            let send_sizes = counts(
                OP,
                self,
                bounds
                    .iter()
                    .enumerate()
                    .map(|(d, &(s, e))| others(d, e - s)),
            )?;
            let recv_sizes = counts(OP, self, (0..n).map(|s| others(s, m)))?;
            let recv_starts = counts(OP, self, (0..n).map(|s| s * m))?;
            let mut scratch = self.take_scratch((n * m * size_of::<T>()).div_ceil(8));
            // SAFETY: every buffer and count array is kept alive by `wait`.
            self.mpi(OP, || unsafe {
                ffi::MPI_Ialltoallv(
                    xs.as_ptr() as *const c_void,
                    send_sizes.as_ptr(),
                    starts.as_ptr(),
                    dt,
                    scratch.as_mut_ptr() as *mut c_void,
                    recv_sizes.as_ptr(),
                    recv_starts.as_ptr(),
                    dt,
                    self.comm.0,
                    &mut req,
                )
            })?;
            let keep = (scratch, send_sizes, recv_sizes, recv_starts, x.clone());
            let (mut scratch, ..) = self.wait(OP, self.group(), poll, vec![req], keep)?;
            // ...reduces it with its own chunk, in rank order, into its own slot...
            let slots = &mut elems::<T>(&mut scratch)[..n * m];
            let (before, rest) = slots.split_at_mut(me * m);
            let (mine, after) = rest.split_at_mut(m);
            let inputs: Vec<&[T]> = (0..n)
                .map(|s| match s.cmp(&me) {
                    Ordering::Less => &before[s * m..(s + 1) * m],
                    Ordering::Equal => &xs[s0..e0],
                    Ordering::Greater => &after[(s - me - 1) * m..(s - me) * m],
                })
                .collect();
            // SAFETY: initialised `T`s viewed as possibly uninitialised ones.
            reduce_into(&inputs, 0, unsafe { as_uninit(mine) }, op);
            let mine = mine.as_ptr();
            // ...then every rank gathers every reduced chunk.
            let mut req = null_request();
            let c = count(m).map_err(|e| self.backend(OP, e))?;
            // SAFETY: every buffer and count array is kept alive by `wait`.
            self.mpi(OP, || unsafe {
                ffi::MPI_Iallgatherv(
                    mine as *const c_void,
                    c,
                    dt,
                    out.as_mut_ptr() as *mut c_void,
                    sizes.as_ptr(),
                    starts.as_ptr(),
                    dt,
                    self.comm.0,
                    &mut req,
                )
            })?;
            let keep = (out, scratch, sizes, starts);
            let (mut out, scratch, ..) = self.wait(OP, self.group(), poll, vec![req], keep)?;
            self.put_scratch(scratch);
            // SAFETY: the chunks cover 0..len.
            unsafe { out.set_len(len) };
            Ok(out)
        })
    }

    pub(super) fn all_gather_impl(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "all_gather";
        self.check_dim(OP, t, dim)?;
        let x = self.contiguous(OP, t)?;
        if self.alone(OP)? {
            return Ok(x);
        }
        let poll = Poll::new(self.rt.timeout);
        self.agree(
            &Desc {
                dim: Some(dim),
                ..Desc::of(Op::AllGather, &x)
            },
            &poll,
        )?;
        let mut dims = x.dims().to_vec();
        dims[dim] *= self.n;
        typed!(self, OP, x.dtype(), T => {
            let v = self.all_gather_t::<T>(&x, dim, &poll);
            v.and_then(|v| self.tensor(OP, v, &dims))
        })
    }

    fn all_gather_t<T: WithDType>(&self, x: &Tensor, dim: usize, poll: &Poll) -> Result<Vec<T>> {
        const OP: &str = "all_gather";
        let (n, dt) = (self.n, elem_type::<T>());
        let (outer, inner) = outer_inner(x.dims(), dim);
        self.with_data::<T, _>(OP, x, |xs| {
            let len = xs.len();
            if len == 0 {
                return Ok(Vec::new());
            }
            let c = count(len).map_err(|e| self.backend(OP, e))?;
            let mut all: Vec<T> = Vec::with_capacity(n * len);
            let mut req = null_request();
            // SAFETY: `xs` is borrowed for this call; `all` is kept alive by `wait`.
            self.mpi(OP, || unsafe {
                ffi::MPI_Iallgather(
                    xs.as_ptr() as *const c_void,
                    c,
                    dt,
                    all.as_mut_ptr() as *mut c_void,
                    c,
                    dt,
                    self.comm.0,
                    &mut req,
                )
            })?;
            let (mut all, _) = self.wait(OP, self.group(), poll, vec![req], (all, x.clone()))?;
            // SAFETY: the all-gather wrote `n * len` elements.
            unsafe { all.set_len(n * len) };
            if outer == 1 {
                return Ok(all);
            }
            // Rank-major blocks to the output's order: block (o, r) at (o * n + r) * inner.
            let mut out = Vec::with_capacity(n * len);
            for o in 0..outer {
                for r in 0..n {
                    out.extend_from_slice(&all[r * len + o * inner..r * len + (o + 1) * inner]);
                }
            }
            Ok(out)
        })
    }

    pub(super) fn reduce_scatter_impl(
        &self,
        t: &Tensor,
        dim: usize,
        op: ReduceOp,
    ) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        let n = self.n;
        args::splits_evenly(t, dim, n).map_err(|r| self.invalid(OP, r))?;
        let x = self.contiguous(OP, t)?;
        if self.alone(OP)? {
            return Ok(x);
        }
        let poll = Poll::new(self.rt.timeout);
        let desc = Desc {
            dim: Some(dim),
            reduce: Some(op),
            ..Desc::of(Op::ReduceScatter, &x)
        };
        self.agree(&desc, &poll)?;
        let mut dims = x.dims().to_vec();
        dims[dim] /= n;
        typed!(self, OP, x.dtype(), T => {
            let v = self.reduce_scatter_t::<T>(&x, dim, op, &poll);
            v.and_then(|v| self.tensor(OP, v, &dims))
        })
    }

    fn reduce_scatter_t<T: WithDType>(
        &self,
        x: &Tensor,
        dim: usize,
        op: ReduceOp,
        poll: &Poll,
    ) -> Result<Vec<T>> {
        const OP: &str = "reduce_scatter";
        let (n, me, dt) = (self.n, self.me, elem_type::<T>());
        let (outer, inner) = outer_inner(x.dims(), dim);
        let piece = inner / n;
        let block = outer * piece;
        self.with_data::<T, _>(OP, x, |xs| {
            if block == 0 {
                return Ok(Vec::new());
            }
            // What goes to rank d: piece d of every outer row (already in order if outer == 1).
            let packed: Vec<T> = if outer == 1 {
                Vec::new()
            } else {
                let mut p = Vec::with_capacity(xs.len());
                for d in 0..n {
                    for o in 0..outer {
                        p.extend_from_slice(
                            &xs[o * inner + d * piece..o * inner + (d + 1) * piece],
                        );
                    }
                }
                p
            };
            let send = if outer == 1 {
                xs.as_ptr()
            } else {
                packed.as_ptr()
            };
            // Every block but this rank's own goes through the group's scratch buffer.
            let others = |d: usize| if d == me { 0 } else { block };
            let sizes = counts(OP, self, (0..n).map(others))?;
            let starts = counts(OP, self, (0..n).map(|d| d * block))?;
            let mut scratch = self.take_scratch((n * block * size_of::<T>()).div_ceil(8));
            let mut req = null_request();
            // SAFETY: `xs` is borrowed for this call; the other buffers are kept alive by `wait`.
            self.mpi(OP, || unsafe {
                ffi::MPI_Ialltoallv(
                    send as *const c_void,
                    sizes.as_ptr(),
                    starts.as_ptr(),
                    dt,
                    scratch.as_mut_ptr() as *mut c_void,
                    sizes.as_ptr(),
                    starts.as_ptr(),
                    dt,
                    self.comm.0,
                    &mut req,
                )
            })?;
            let keep = (scratch, packed, sizes, starts, x.clone());
            let (mut scratch, packed, ..) = self.wait(OP, self.group(), poll, vec![req], keep)?;
            let own = if outer == 1 { xs } else { &packed[..] };
            let blocks = &elems::<T>(&mut scratch)[..n * block];
            let inputs: Vec<&[T]> = (0..n)
                .map(|s| {
                    let src = if s == me { own } else { blocks };
                    &src[s * block..(s + 1) * block]
                })
                .collect();
            let mut out: Vec<T> = Vec::with_capacity(block);
            let spare = out.spare_capacity_mut();
            for o in 0..outer {
                reduce_into(
                    &inputs,
                    o * piece,
                    &mut spare[o * piece..(o + 1) * piece],
                    op,
                );
            }
            self.put_scratch(scratch);
            // SAFETY: the loop wrote every element.
            unsafe { out.set_len(block) };
            Ok(out)
        })
    }

    pub(super) fn broadcast_impl(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        self.check_peer(OP, root)?;
        if self.alone(OP)? {
            return Ok(t.detach());
        }
        let x = if self.me == root {
            Some(self.contiguous(OP, t)?)
        } else {
            None
        };
        let desc = match &x {
            Some(x) => Desc {
                root: Some(root),
                ..Desc::of(Op::Broadcast, x)
            },
            None => Desc {
                root: Some(root),
                ..Desc::new(Op::Broadcast)
            },
        };
        let poll = Poll::new(self.rt.timeout);
        let descs = self.agree(&desc, &poll)?;
        let (Some(dtype), Some(dims)) = (descs[root].dtype, descs[root].dims.clone()) else {
            return Err(self.backend(OP, "the root sent no shape"));
        };
        typed!(self, OP, dtype, T => self.broadcast_t::<T>(x, &dims, root, &poll))
    }

    fn broadcast_t<T: WithDType>(
        &self,
        x: Option<Tensor>,
        dims: &[usize],
        root: usize,
        poll: &Poll,
    ) -> Result<Tensor> {
        const OP: &str = "broadcast";
        let len: usize = dims.iter().product();
        let c = count(len).map_err(|e| self.backend(OP, e))?;
        let dt = elem_type::<T>();
        let mut req = null_request();
        if let Some(x) = x {
            if len > 0 {
                self.with_data::<T, _>(OP, &x, |xs| {
                    // SAFETY: MPI only reads the root's buffer, borrowed for this call.
                    self.mpi(OP, || unsafe {
                        ffi::MPI_Ibcast(
                            xs.as_ptr() as *mut c_void,
                            c,
                            dt,
                            root as c_int,
                            self.comm.0,
                            &mut req,
                        )
                    })?;
                    self.wait(OP, self.group(), poll, vec![req], x.clone())
                        .map(drop)
                })?;
            }
            return Ok(x);
        }
        let mut buf: Vec<T> = Vec::with_capacity(len);
        if len > 0 {
            // SAFETY: `buf` is kept alive by `wait`.
            self.mpi(OP, || unsafe {
                ffi::MPI_Ibcast(
                    buf.as_mut_ptr() as *mut c_void,
                    c,
                    dt,
                    root as c_int,
                    self.comm.0,
                    &mut req,
                )
            })?;
            buf = self.wait(OP, self.group(), poll, vec![req], buf)?;
            // SAFETY: the broadcast wrote `len` elements.
            unsafe { buf.set_len(len) };
        }
        self.tensor(OP, buf, dims)
    }
}
