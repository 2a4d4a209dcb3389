//! [`LocalComm`]: one rank's handle on one group of the in-process backend, the
//! [`Communicator`] implementation.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{Device, Shape, Tensor};
use crossbeam_channel::select;

use super::group::{agree, Deposit, Group, Shared};
use super::launcher::World;
use crate::args;
use crate::reduce::{chunk, copy_into, reduce_into, with_dtype, with_slices, OutBuf, RawOut};
use crate::{CommError, Communicator, Peer, ReduceOp, Result, Tag};

/// One rank's handle on one group.
pub(crate) struct LocalComm {
    pub(crate) world: Arc<World>,
    pub(crate) group: Arc<Group>,
    pub(crate) me: usize,
}

impl LocalComm {
    fn global(&self) -> usize {
        self.group.members[self.me]
    }

    fn n(&self) -> usize {
        self.group.members.len()
    }

    fn invalid(&self, op: &'static str, reason: impl Into<String>) -> CommError {
        CommError::Invalid {
            op,
            rank: self.global(),
            reason: reason.into(),
        }
    }

    fn backend(&self, op: &'static str, reason: impl fmt::Display) -> CommError {
        CommError::Backend {
            op,
            rank: self.global(),
            reason: reason.to_string(),
        }
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        args::peer_in_range(peer, self.n(), &self.group.describe()).map_err(|r| self.invalid(op, r))
    }

    fn check_dim(&self, op: &'static str, t: &Tensor, dim: usize) -> Result<()> {
        args::dim_exists(t, dim).map_err(|r| self.invalid(op, r))
    }

    fn contiguous(&self, op: &'static str, t: &Tensor) -> Result<Tensor> {
        Ok(t.contiguous().map_err(|e| self.backend(op, e))?.detach())
    }

    /// `t` in host memory ([`crate::host`]).
    fn to_host(&self, op: &'static str, t: &Tensor) -> Result<Tensor> {
        crate::host::to_host(t).map_err(|e| self.backend(op, e))
    }

    /// A result back on the device of the input it came from ([`crate::host`]).
    fn to_device(&self, op: &'static str, t: Tensor, device: &Device) -> Result<Tensor> {
        crate::host::to_device(t, device).map_err(|e| self.backend(op, e))
    }

    fn deposit(&self, op: &'static str, desc: String) -> Deposit {
        Deposit {
            op,
            desc,
            ..Deposit::default()
        }
    }

    /// Rendezvous 1 allocates one output of `shape`; `fill` writes this rank's part of it
    /// from the deposits; rendezvous 2 turns the buffer into the shared result.
    fn fill_shared(
        &self,
        op: &'static str,
        dep: Deposit,
        shape: Shape,
        dtype: candle_core::DType,
        fill: impl FnOnce(&[Deposit], RawOut) -> std::result::Result<(), String>,
    ) -> Result<Tensor> {
        let (shared, deps) = self
            .group
            .rendezvous(&self.world, self.me, dep, |st, deps| {
                agree(deps)?;
                let out = OutBuf::new(dtype, shape)?;
                let raw = out.raw();
                st.out = Some(out);
                Ok(Shared::Buf(raw))
            })?;
        let Shared::Buf(raw) = shared else {
            unreachable!("rendezvous 1 shares a buffer")
        };
        fill(&deps, raw).map_err(|e| self.backend(op, e))?;
        let done = self.deposit(op, String::new());
        let (shared, _) = self.group.rendezvous(&self.world, self.me, done, |st, _| {
            let out = st.out.take().ok_or("internal: output buffer missing")?;
            out.finish().map(Shared::Tensor).map_err(|e| e.to_string())
        })?;
        let Shared::Tensor(t) = shared else {
            unreachable!("rendezvous 2 shares a tensor")
        };
        Ok(t)
    }
}

/// The number of elements before `dim` and from `dim` on.
fn outer_inner(dims: &[usize], dim: usize) -> (usize, usize) {
    (dims[..dim].iter().product(), dims[dim..].iter().product())
}

/// The collectives on host tensors: the in-process transport moves host memory.
impl LocalComm {
    fn send_host(&self, t: &Tensor, dst: usize, tag: Tag) -> Result<()> {
        const OP: &str = "send";
        self.check_peer(OP, dst)?;
        self.world.check(OP, self.global(), Peer::Rank(dst))?;
        let dst_global = self.group.members[dst];
        let (tx, _) = self
            .world
            .channel(dst_global, (self.group.ctx, self.global(), tag));
        tx.send(t.detach())
            .map_err(|_| self.backend(OP, "mailbox closed"))
    }

    fn recv_host(&self, src: usize, tag: Tag) -> Result<Tensor> {
        const OP: &str = "recv";
        self.check_peer(OP, src)?;
        let me = self.global();
        self.world.check(OP, me, Peer::Rank(src))?;
        let src_global = self.group.members[src];
        let (_, rx) = self.world.channel(me, (self.group.ctx, src_global, tag));
        let deadline = Instant::now() + self.world.timeout;
        select! {
            recv(rx) -> m => m.map_err(|_| self.backend(OP, "mailbox closed")),
            recv(self.world.abort_rx) -> _ => Err(self.world.peer_failed(OP, me, Peer::Rank(src))),
            recv(self.world.exit_rx[src_global]) -> _ => rx.try_recv().map_err(|_| {
                CommError::PeerFailed {
                    op: OP,
                    rank: me,
                    peer: Peer::Rank(src),
                    failed_rank: src_global,
                    cause: format!("it returned without sending tag {tag}"),
                }
            }),
            default(deadline.saturating_duration_since(Instant::now())) => {
                let err = CommError::Timeout {
                    op: OP,
                    rank: me,
                    peer: Peer::Rank(src),
                    after: self.world.timeout,
                };
                self.world.fail_with(me, &err);
                Err(err)
            }
        }
    }

    fn all_reduce_host(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "all_reduce";
        let x = self.contiguous(OP, t)?;
        if self.n() == 1 {
            self.world
                .check(OP, self.global(), Peer::Group(self.group.describe()))?;
            return Ok(x);
        }
        let (n, me, dtype) = (self.n(), self.me, x.dtype());
        let mut dep = self.deposit(OP, format!("shape {:?}, {dtype:?}, {op:?}", x.dims()));
        dep.tensor = Some(x.clone());
        let len = x.elem_count();
        self.fill_shared(OP, dep, x.shape().clone(), dtype, |deps, raw| {
            let inputs: Vec<Tensor> = deps.iter().map(|d| d.tensor.clone().unwrap()).collect();
            with_dtype!(dtype, T => with_slices::<T, _>(&inputs, |xs| {
                let (s, e) = chunk(len, n, me, std::mem::size_of::<T>());
                // SAFETY: rank `me` alone writes `s..e` before the second rendezvous.
                let out = unsafe { raw.range::<T>(s, e) };
                reduce_into(xs, s, out, op);
            }))
        })
    }

    fn all_gather_host(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        const OP: &str = "all_gather";
        self.check_dim(OP, t, dim)?;
        let x = self.contiguous(OP, t)?;
        if self.n() == 1 {
            self.world
                .check(OP, self.global(), Peer::Group(self.group.describe()))?;
            return Ok(x);
        }
        let (n, me, dtype) = (self.n(), self.me, x.dtype());
        let mut out_dims = x.dims().to_vec();
        out_dims[dim] *= n;
        let (outer, inner) = outer_inner(x.dims(), dim);
        let dep = self.deposit(OP, format!("shape {:?}, {dtype:?}, dim {dim}", x.dims()));
        self.fill_shared(OP, dep, Shape::from(out_dims), dtype, |_, raw| {
            with_dtype!(dtype, T => with_slices::<T, _>(std::slice::from_ref(&x), |xs| {
                for o in 0..outer {
                    let s = (o * n + me) * inner;
                    // SAFETY: rank `me` alone writes its blocks before the second rendezvous.
                    let out = unsafe { raw.range::<T>(s, s + inner) };
                    copy_into(&xs[0][o * inner..(o + 1) * inner], out);
                }
            }))
        })
    }

    fn reduce_scatter_host(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        const OP: &str = "reduce_scatter";
        let n = self.n();
        args::splits_evenly(t, dim, n).map_err(|r| self.invalid(OP, r))?;
        let x = self.contiguous(OP, t)?;
        if n == 1 {
            self.world
                .check(OP, self.global(), Peer::Group(self.group.describe()))?;
            return Ok(x);
        }
        let (me, dtype) = (self.me, x.dtype());
        let mut dep = self.deposit(
            OP,
            format!("shape {:?}, {dtype:?}, dim {dim}, {op:?}", x.dims()),
        );
        dep.tensor = Some(x.clone());
        let (_, deps) = self
            .group
            .rendezvous(&self.world, self.me, dep, |_, deps| {
                agree(deps).map(|_| Shared::None)
            })?;
        let mut out_dims = x.dims().to_vec();
        out_dims[dim] /= n;
        let (outer, inner) = outer_inner(x.dims(), dim);
        let piece = inner / n;
        let out_shape = Shape::from(out_dims);
        let inputs: Vec<Tensor> = deps.iter().map(|d| d.tensor.clone().unwrap()).collect();
        let result = (|| {
            let out = OutBuf::new(dtype, out_shape)?;
            let raw = out.raw();
            with_dtype!(dtype, T => with_slices::<T, _>(&inputs, |xs| {
                for o in 0..outer {
                    // SAFETY: this buffer is private to this rank.
                    let dst = unsafe { raw.range::<T>(o * piece, (o + 1) * piece) };
                    reduce_into(xs, o * inner + me * piece, dst, op);
                }
            }))?;
            out.finish().map_err(|e| e.to_string())
        })();
        result.map_err(|e| self.backend(OP, e))
    }

    fn broadcast_host(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        const OP: &str = "broadcast";
        self.check_peer(OP, root)?;
        if self.n() == 1 {
            self.world
                .check(OP, self.global(), Peer::Group(self.group.describe()))?;
            return Ok(t.detach());
        }
        let mut dep = self.deposit(OP, format!("root {root}"));
        if self.me == root {
            dep.tensor = Some(self.contiguous(OP, t)?);
        }
        let (_, deps) = self
            .group
            .rendezvous(&self.world, self.me, dep, |_, deps| {
                agree(deps).map(|_| Shared::None)
            })?;
        Ok(deps[root]
            .tensor
            .clone()
            .expect("the root deposited its tensor"))
    }

    fn all_to_all_host(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        const OP: &str = "all_to_all";
        let n = self.n();
        args::one_part_per_rank(parts.len(), n).map_err(|r| self.invalid(OP, r))?;
        let parts = parts
            .iter()
            .map(|p| self.contiguous(OP, p))
            .collect::<Result<Vec<_>>>()?;
        let mut dep = self.deposit(OP, String::new());
        dep.parts = parts;
        let (_, deps) = self
            .group
            .rendezvous(&self.world, self.me, dep, |_, deps| {
                agree(deps).map(|_| Shared::None)
            })?;
        Ok(deps.iter().map(|d| d.parts[self.me].clone()).collect())
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.me
    }

    fn world_size(&self) -> usize {
        self.n()
    }

    fn members(&self) -> Vec<usize> {
        self.group.members.clone()
    }

    fn name(&self) -> String {
        self.group.name.clone()
    }

    // A tensor on another device moves to the host here, inside the communicator, and a
    // result back to the device of its input: the rest of switchyard never copies to the
    // host for communication (a device-aware backend, NCCL, would not copy at all).
    // `recv` cannot know the receiver's device: it returns a host tensor.
    fn send(&self, t: &Tensor, dst: usize, tag: Tag) -> Result<()> {
        self.send_host(&self.to_host("send", t)?, dst, tag)
    }

    fn recv(&self, src: usize, tag: Tag) -> Result<Tensor> {
        self.recv_host(src, tag)
    }

    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor> {
        let r = self.all_reduce_host(&self.to_host("all_reduce", t)?, op)?;
        self.to_device("all_reduce", r, t.device())
    }

    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor> {
        let r = self.all_gather_host(&self.to_host("all_gather", t)?, dim)?;
        self.to_device("all_gather", r, t.device())
    }

    fn reduce_scatter(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor> {
        let r = self.reduce_scatter_host(&self.to_host("reduce_scatter", t)?, dim, op)?;
        self.to_device("reduce_scatter", r, t.device())
    }

    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor> {
        let r = self.broadcast_host(&self.to_host("broadcast", t)?, root)?;
        self.to_device("broadcast", r, t.device())
    }

    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>> {
        let device = parts.first().map(|p| p.device().clone());
        let parts = parts
            .iter()
            .map(|p| self.to_host("all_to_all", p))
            .collect::<Result<Vec<_>>>()?;
        let out = self.all_to_all_host(parts)?;
        match device {
            Some(d) => out
                .into_iter()
                .map(|t| self.to_device("all_to_all", t, &d))
                .collect(),
            None => Ok(out),
        }
    }

    fn barrier(&self) -> Result<()> {
        let dep = self.deposit("barrier", String::new());
        self.group
            .rendezvous(&self.world, self.me, dep, |_, deps| {
                agree(deps).map(|_| Shared::None)
            })?;
        Ok(())
    }

    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>> {
        const OP: &str = "split";
        let mut dep = self.deposit(OP, String::new());
        dep.color_key = (color, key);
        let members = &self.group.members;
        let world = &self.world;
        let name = name.to_string();
        let (shared, _) = self
            .group
            .rendezvous(&self.world, self.me, dep, |_, deps| {
                agree(deps)?;
                let mut by_color: HashMap<usize, Vec<(usize, usize)>> = HashMap::new();
                for (r, d) in deps.iter().enumerate() {
                    by_color
                        .entry(d.color_key.0)
                        .or_default()
                        .push((d.color_key.1, r));
                }
                let mut groups = HashMap::new();
                for (c, mut ranks) in by_color {
                    ranks.sort();
                    if let Some(w) = ranks.windows(2).find(|w| w[0].0 == w[1].0) {
                        return Err(format!(
                            "ranks {} and {} both asked for key {} in colour {c}",
                            w[0].1, w[1].1, w[0].0
                        ));
                    }
                    let globals = ranks.iter().map(|&(_, r)| members[r]).collect();
                    groups.insert(c, world.new_group(name.clone(), globals));
                }
                Ok(Shared::Groups(Arc::new(groups)))
            })?;
        let Shared::Groups(groups) = shared else {
            unreachable!("split shares groups")
        };
        let group = groups[&color].clone();
        let me = group
            .members
            .iter()
            .position(|&g| g == self.global())
            .expect("a rank belongs to the group of its colour");
        Ok(Arc::new(LocalComm {
            world: self.world.clone(),
            group,
            me,
        }))
    }
}
