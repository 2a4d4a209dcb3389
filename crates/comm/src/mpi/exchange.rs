//! The collectives that move whole tensors of any shape or regroup ranks: all-to-all
//! (part headers first, then the data, each part padded to whole words), barrier (the
//! descriptor exchange alone) and split (checked colours and keys, then
//! `MPI_Comm_split`).

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use candle_core::Tensor;
use mpi::ffi;

use super::collective::{counts, null_request};
use super::comm::MpiComm;
use super::runtime::{Handle, Poll};
use super::wire::{self, Desc, Op, PART_WORDS};
use crate::args;
use crate::{Communicator, Result};

impl MpiComm {
    pub(super) fn all_to_all_impl(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all";
        let n = self.n;
        args::one_part_per_rank(parts.len(), n).map_err(|r| self.invalid(OP, r))?;
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
