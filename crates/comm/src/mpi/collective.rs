//! The collectives of the MPI backend. Each one starts with [`MpiComm::agree`] (an
//! all-gather of every rank's descriptor, which fails with `Mismatch` on every rank when
//! they differ), then moves the data with non-blocking MPI collectives and reduces with
//! the crate's rank-ordered kernel.

use std::ffi::{c_int, c_void};
use std::mem::size_of;
use std::sync::Arc;

use candle_core::{Device, Tensor, WithDType};
use mpi::ffi;

use super::comm::{count, MpiComm};
use super::runtime::{Handle, Poll};
use super::wire::{self, Desc, Op, DESC_WORDS, PART_WORDS};
use crate::reduce::{chunk, reduce_into, with_dtype, with_slices};
use crate::{CommError, Communicator, ReduceOp, Result};

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

fn null_request() -> ffi::MPI_Request {
    // SAFETY: reading MPI's predefined null request.
    unsafe { ffi::RSMPI_REQUEST_NULL }
}

/// The number of elements before `dim` and from `dim` on.
fn outer_inner(dims: &[usize], dim: usize) -> (usize, usize) {
    (dims[..dim].iter().product(), dims[dim..].iter().product())
}

/// MPI counts and displacements from element counts.
fn counts(
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
    fn agree(&self, desc: &Desc, poll: &Poll) -> Result<Vec<Desc>> {
        let op = desc.op.name();
        self.rt.check(op, self.global(), self.group())?;
        let mine = desc.encode().map_err(|e| self.invalid(op, e))?;
        let mut all: Vec<u64> = vec![0; self.n * DESC_WORDS];
        let mut req = null_request();
        // SAFETY: both buffers are kept alive by `wait`.
        self.mpi(op, || unsafe {
            ffi::MPI_Iallgather(
                mine.as_ptr() as *const c_void,
                DESC_WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                all.as_mut_ptr() as *mut c_void,
                DESC_WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                self.comm.0,
                &mut req,
            )
        })?;
        let (_, all) = self.wait(op, self.group(), poll, vec![req], (mine, all))?;
        let descs = all
            .chunks(DESC_WORDS)
            .map(Desc::decode)
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
        Ok(descs)
    }

    fn mismatch(&self, op: &'static str, reason: String) -> CommError {
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
    fn alone(&self, op: &'static str) -> Result<bool> {
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
        self.agree(
            &Desc {
                reduce: Some(op),
                ..Desc::of(Op::AllReduce, &x)
            },
            &poll,
        )?;
        if x.elem_count() == 0 {
            return Ok(x);
        }
        let out = typed!(self, OP, x.dtype(), T => self.all_reduce_t::<T>(&x, op, &poll).and_then(|v| self.tensor(OP, v, x.dims())));
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
            // Reduce-scatter: rank r receives the r-th chunk of every input...
            let bounds: Vec<(usize, usize)> =
                (0..n).map(|d| chunk(len, n, d, size_of::<T>())).collect();
            let sizes = counts(OP, self, bounds.iter().map(|&(s, e)| e - s))?;
            let starts = counts(OP, self, bounds.iter().map(|&(s, _)| s))?;
            let (s0, e0) = bounds[me];
            let m = e0 - s0;
            let recv_sizes = counts(OP, self, (0..n).map(|_| m))?;
            let recv_starts = counts(OP, self, (0..n).map(|s| s * m))?;
            let mut recv: Vec<T> = Vec::with_capacity(n * m);
            // SAFETY: every buffer and count array is kept alive by `wait`.
            self.mpi(OP, || unsafe {
                ffi::MPI_Ialltoallv(
                    xs.as_ptr() as *const c_void,
                    sizes.as_ptr(),
                    starts.as_ptr(),
                    dt,
                    recv.as_mut_ptr() as *mut c_void,
                    recv_sizes.as_ptr(),
                    recv_starts.as_ptr(),
                    dt,
                    self.comm.0,
                    &mut req,
                )
            })?;
            let (mut recv, ..) = self.wait(
                OP,
                self.group(),
                poll,
                vec![req],
                (recv, recv_sizes, recv_starts, x.clone()),
            )?;
            // SAFETY: the all-to-all wrote `m` elements from each of the `n` ranks.
            unsafe { recv.set_len(n * m) };
            // ...and reduces it in rank order,
            let inputs: Vec<&[T]> = (0..n).map(|s| &recv[s * m..(s + 1) * m]).collect();
            let mut mine: Vec<T> = Vec::with_capacity(m);
            reduce_into(&inputs, 0, &mut mine.spare_capacity_mut()[..m], op);
            // SAFETY: `reduce_into` wrote every element.
            unsafe { mine.set_len(m) };
            // then every rank gathers every reduced chunk.
            let mut req = null_request();
            let c = count(m).map_err(|e| self.backend(OP, e))?;
            // SAFETY: every buffer and count array is kept alive by `wait`.
            self.mpi(OP, || unsafe {
                ffi::MPI_Iallgatherv(
                    mine.as_ptr() as *const c_void,
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
            let (mut out, ..) = self.wait(
                OP,
                self.group(),
                poll,
                vec![req],
                (out, mine, sizes, starts),
            )?;
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
        let out = typed!(self, OP, x.dtype(), T => self.all_gather_t::<T>(&x, dim, &poll).and_then(|v| self.tensor(OP, v, &dims)));
        out
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
        self.check_dim(OP, t, dim)?;
        let n = self.n;
        if t.dims()[dim] % n != 0 {
            return Err(self.invalid(
                OP,
                format!(
                    "dim {dim} of shape {:?} does not split into {n} equal parts",
                    t.dims()
                ),
            ));
        }
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
        let out = typed!(self, OP, x.dtype(), T => self.reduce_scatter_t::<T>(&x, dim, op, &poll).and_then(|v| self.tensor(OP, v, &dims)));
        out
    }

    fn reduce_scatter_t<T: WithDType>(
        &self,
        x: &Tensor,
        dim: usize,
        op: ReduceOp,
        poll: &Poll,
    ) -> Result<Vec<T>> {
        const OP: &str = "reduce_scatter";
        let (n, dt) = (self.n, elem_type::<T>());
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
            let c = count(block).map_err(|e| self.backend(OP, e))?;
            let mut recv: Vec<T> = Vec::with_capacity(n * block);
            let mut req = null_request();
            // SAFETY: `xs` is borrowed for this call; the other buffers are kept alive by `wait`.
            self.mpi(OP, || unsafe {
                ffi::MPI_Ialltoall(
                    send as *const c_void,
                    c,
                    dt,
                    recv.as_mut_ptr() as *mut c_void,
                    c,
                    dt,
                    self.comm.0,
                    &mut req,
                )
            })?;
            let (mut recv, ..) =
                self.wait(OP, self.group(), poll, vec![req], (recv, packed, x.clone()))?;
            // SAFETY: the all-to-all wrote `block` elements from each rank.
            unsafe { recv.set_len(n * block) };
            let inputs: Vec<&[T]> = recv.chunks(block).collect();
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

    pub(super) fn all_to_all_impl(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all";
        let n = self.n;
        if parts.len() != n {
            return Err(self.invalid(
                OP,
                format!("{} parts given for a group of size {n}", parts.len()),
            ));
        }
        let parts = parts
            .iter()
            .map(|p| self.contiguous(OP, p))
            .collect::<Result<Vec<_>>>()?;
        let mut headers: Vec<u64> = Vec::with_capacity(n * PART_WORDS);
        for p in &parts {
            headers.extend(wire::part_header(p).map_err(|e| self.invalid(OP, e))?);
        }
        if self.alone(OP)? {
            return Ok(parts);
        }
        let poll = Poll::new(self.rt.timeout);
        self.agree(&Desc::new(Op::AllToAll), &poll)?;
        // Shapes first, so that every receiver can size its buffers.
        let mut theirs: Vec<u64> = vec![0; n * PART_WORDS];
        let mut req = null_request();
        // SAFETY: both buffers are kept alive by `wait`.
        self.mpi(OP, || unsafe {
            ffi::MPI_Ialltoall(
                headers.as_ptr() as *const c_void,
                PART_WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                theirs.as_mut_ptr() as *mut c_void,
                PART_WORDS as c_int,
                ffi::RSMPI_UINT64_T,
                self.comm.0,
                &mut req,
            )
        })?;
        let (_, theirs) = self.wait(OP, self.group(), &poll, vec![req], (headers, theirs))?;
        let incoming = theirs
            .chunks(PART_WORDS)
            .map(wire::read_part_header)
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| self.backend(OP, e))?;
        // Then the data, every part padded to whole words.
        let send_words: Vec<usize> = parts.iter().map(wire::data_words).collect();
        let recv_words: Vec<usize> = incoming.iter().map(|p| p.2).collect();
        let offsets = |w: &[usize]| {
            w.iter()
                .scan(0, |acc, &x| {
                    let s = *acc;
                    *acc += x;
                    Some(s)
                })
                .collect::<Vec<_>>()
        };
        let (send_at, recv_at) = (offsets(&send_words), offsets(&recv_words));
        let mut send: Vec<u64> = vec![0; send_words.iter().sum()];
        for (p, (&at, &w)) in parts.iter().zip(send_at.iter().zip(&send_words)) {
            wire::write_data(p, &mut send[at..at + w]).map_err(|e| self.backend(OP, e))?;
        }
        let mut recv: Vec<u64> = vec![0; recv_words.iter().sum()];
        let arrays = [
            counts(OP, self, send_words.iter().copied())?,
            counts(OP, self, send_at.iter().copied())?,
            counts(OP, self, recv_words.iter().copied())?,
            counts(OP, self, recv_at.iter().copied())?,
        ];
        let mut req = null_request();
        // SAFETY: every buffer and count array is kept alive by `wait`.
        self.mpi(OP, || unsafe {
            ffi::MPI_Ialltoallv(
                send.as_ptr() as *const c_void,
                arrays[0].as_ptr(),
                arrays[1].as_ptr(),
                ffi::RSMPI_UINT64_T,
                recv.as_mut_ptr() as *mut c_void,
                arrays[2].as_ptr(),
                arrays[3].as_ptr(),
                ffi::RSMPI_UINT64_T,
                self.comm.0,
                &mut req,
            )
        })?;
        let (_, recv, _) = self.wait(OP, self.group(), &poll, vec![req], (send, recv, arrays))?;
        incoming
            .iter()
            .zip(recv_at)
            .map(|((dtype, dims, w), at)| {
                wire::read_data(&recv[at..at + w], *dtype, dims).map_err(|e| self.backend(OP, e))
            })
            .collect()
    }

    pub(super) fn barrier_impl(&self) -> Result<()> {
        if self.alone("barrier")? {
            return Ok(());
        }
        self.agree(&Desc::new(Op::Barrier), &Poll::new(self.rt.timeout))
            .map(drop)
    }

    pub(super) fn split_impl(
        &self,
        color: usize,
        key: usize,
        name: &str,
    ) -> Result<Arc<dyn Communicator>> {
        const OP: &str = "split";
        let desc = Desc {
            color_key: (color, key),
            ..Desc::new(Op::Split)
        };
        let descs = if self.n == 1 {
            self.rt.check(OP, self.global(), self.group())?;
            vec![desc]
        } else {
            self.agree(&desc, &Poll::new(self.rt.timeout))?
        };
        // Every rank sees every (colour, key), so every rank finds the same problem.
        let mut colors: Vec<usize> = descs.iter().map(|d| d.color_key.0).collect();
        colors.sort_unstable();
        colors.dedup();
        for &c in &colors {
            let mut ranks: Vec<(usize, usize)> = descs
                .iter()
                .enumerate()
                .filter(|(_, d)| d.color_key.0 == c)
                .map(|(r, d)| (d.color_key.1, r))
                .collect();
            ranks.sort_unstable();
            if let Some(w) = ranks.windows(2).find(|w| w[0].0 == w[1].0) {
                return Err(self.mismatch(
                    OP,
                    format!(
                        "ranks {} and {} both asked for key {} in colour {c}",
                        w[0].1, w[1].1, w[0].0
                    ),
                ));
            }
        }
        let mut mine: Vec<(usize, usize)> = descs
            .iter()
            .enumerate()
            .filter(|(_, d)| d.color_key.0 == color)
            .map(|(r, d)| (d.color_key.1, r))
            .collect();
        mine.sort_unstable();
        let me = mine
            .iter()
            .position(|&(_, r)| r == self.me)
            .expect("a rank is in its own colour");
        let members: Vec<usize> = mine.iter().map(|&(_, r)| self.members()[r]).collect();
        // Dense colours and keys: MPI wants non-negative ints and orders by (key, rank).
        let c = colors.binary_search(&color).expect("own colour") as c_int;
        // SAFETY: reading MPI's predefined null communicator.
        let mut new = Handle(unsafe { ffi::RSMPI_COMM_NULL });
        // SAFETY: every rank of the group has passed `agree`, so all of them call split.
        self.mpi(OP, || unsafe {
            ffi::MPI_Comm_split(self.comm.0, c, me as c_int, &mut new.0)
        })?;
        if let Ok(cname) = std::ffi::CString::new(name) {
            // SAFETY: a valid communicator and NUL-terminated name; MPI copies it.
            let _ = self
                .rt
                .call(|| unsafe { ffi::MPI_Comm_set_name(new.0, cname.as_ptr()) });
        }
        Ok(Arc::new(MpiComm::new(
            self.rt.clone(),
            new,
            true,
            me,
            members,
            name.to_string(),
        )))
    }
}
