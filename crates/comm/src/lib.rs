//! # switchyard-comm: the transport every parallelism strategy talks through
//!
//! This is the bottom crate of switchyard. It holds one core trait, [`Communicator`], and
//! knows nothing about models, schedules or optimizers.
//!
//! ## Design
//!
//! * **Explicit, never global.** A communicator is a value (`Arc<dyn Communicator>`) that
//!   is passed to whoever needs it. There is no process group registry and no "default
//!   group"; sub-groups are made with [`Communicator::split`], as with `MPI_Comm_split`.
//! * **Tensors in, tensors out.** Every operation takes and returns candle [`Tensor`]s.
//!   Point-to-point messages carry their own shape and dtype, so stages may send tensors
//!   whose shape varies from one microbatch to the next.
//! * **Eager sends.** [`Communicator::send`] never waits for the matching receive; only
//!   receives and collectives block. (Pipeline programs are additionally lowered so that
//!   they would not deadlock even with rendezvous sends; see `switchyard-schedule`.)
//! * **Deterministic reductions.** Every backend reduces in rank order
//!   `((x_0 + x_1) + x_2) + …`, so the same inputs give bit-identical results run after
//!   run, whatever the thread timing.
//! * **No hangs.** Every blocking operation returns an error naming the operation, the
//!   rank and the peer or group when another rank fails or when its timeout expires.
//! * **Misuse is an error, never a panic**: a destination out of range, ranks that
//!   disagree on a collective's shape, dtype or root, ambiguous split keys.
//!
//! The [`Mesh`] derives the data-, pipeline- and tensor-parallel groups of a
//! `dp × pp × tp` job from one world communicator, with tensor parallelism fastest-varying
//! as in Megatron-LM.
//!
//! ## Backends
//!
//! * [`local`]: one thread per rank in this process (the default). Point-to-point moves a
//!   tensor by reference (no copy); collectives are bandwidth-optimal in shared memory.
//! * [`mpi`]: one process per rank under `mpirun` (cargo feature `mpi`; without it,
//!   [`mpi::init`] returns [`CommError::Unavailable`]).
//!
//! ## Example
//!
//! ```
//! use candle_core::{Device, Tensor};
//! use switchyard_comm::{local, Communicator, ReduceOp};
//!
//! let sums = local::launch(4, |comm| {
//!     let x = Tensor::new(&[comm.rank() as f32, 1.0], &Device::Cpu)?;
//!     let y = comm.all_reduce(&x, ReduceOp::Sum)?;
//!     y.to_vec1::<f32>()
//! })
//! .unwrap();
//! assert_eq!(sums, vec![vec![6.0, 4.0]; 4]);
//! ```
//!
//! ## Tutorials
//!
//! * [Chapter 4, "Putting it together: dp × pp × tp"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/04-3d-parallelism.md):
//!   the mesh, its rank order and its groups (example `layout_3d`).
//! * [Chapter 8, "Many machines with MPI"](https://github.com/switchyard-rs/switchyard/blob/main/docs/tutorial/08-mpi.md): the MPI backend.

use std::sync::Arc;

use candle_core::Tensor;

mod args;
pub mod conformance;
mod counting;
mod error;
mod host;
mod latency;
pub mod local;
mod mesh;
pub mod mpi;
mod reduce;
pub mod threads;
mod timed;

pub use counting::{Counting, Counts, Traffic};
pub use error::{CommError, Peer, Result};
pub use latency::Latency;
pub use mesh::{Mesh, MeshCoord, MeshShape};
pub use timed::{Span, Spans, Timed};

/// A message tag. Messages between the same pair of ranks are matched by tag, so
/// several exchanges (for example activations and gradients of different microbatches)
/// may be in flight at once.
pub type Tag = u64;

/// How [`Communicator::all_reduce`] and [`Communicator::reduce_scatter`] combine values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum, in rank order.
    Sum,
    /// Element-wise sum in rank order, then multiplied by `1 / world_size`.
    Mean,
    /// Element-wise maximum.
    Max,
}

/// A group of ranks that exchange tensors.
///
/// The trait is object safe and always used through `Arc<dyn Communicator>`, passed
/// explicitly. Ranks are numbered `0..world_size()` within the group.
///
/// Collectives must be called by every rank of the group in the same order, as in MPI.
/// Results of collectives may share storage with other ranks' results (the local backend
/// hands every rank the same buffer); tensors are immutable, so this is invisible unless
/// a caller writes through a `Var` built without copying.
pub trait Communicator: Send + Sync {
    /// This rank's index in the group, in `0..world_size()`.
    fn rank(&self) -> usize;
    /// The number of ranks in the group.
    fn world_size(&self) -> usize;
    /// The global (world) rank of each member, in group order; used in messages.
    fn members(&self) -> Vec<usize>;
    /// A short name such as `"world"` or `"tp"`, used in error messages.
    fn name(&self) -> String;

    /// Sends `t` to `dst`. Returns without waiting for the receiver (eager send).
    /// The tensor is detached from any autograd graph.
    fn send(&self, t: &Tensor, dst: usize, tag: Tag) -> Result<()>;
    /// Receives the tensor that `src` sent with `tag`, blocking until it arrives.
    fn recv(&self, src: usize, tag: Tag) -> Result<Tensor>;

    /// Combines `t` across the group; every rank gets the same result.
    fn all_reduce(&self, t: &Tensor, op: ReduceOp) -> Result<Tensor>;
    /// Concatenates every rank's `t` along `dim`, in rank order. All shapes must agree.
    fn all_gather(&self, t: &Tensor, dim: usize) -> Result<Tensor>;
    /// Reduces across the group, then gives rank `r` the `r`-th of `world_size` equal
    /// slices along `dim`. The size of `dim` must divide by the world size.
    fn reduce_scatter(&self, t: &Tensor, dim: usize, op: ReduceOp) -> Result<Tensor>;
    /// Every rank gets `root`'s tensor. Other ranks' `t` only needs the right shape on
    /// backends that require it; the local backend ignores it.
    fn broadcast(&self, t: &Tensor, root: usize) -> Result<Tensor>;
    /// Rank `r` sends `parts[d]` to rank `d` and receives, in rank order, the part every
    /// rank addressed to it. `parts.len()` must equal the world size.
    fn all_to_all(&self, parts: Vec<Tensor>) -> Result<Vec<Tensor>>;
    /// Blocks until every rank of the group has called `barrier`.
    fn barrier(&self) -> Result<()>;
    /// Splits the group, like `MPI_Comm_split`: ranks passing the same `color` form a new
    /// group, ordered by `(key, rank)`. Two ranks of one colour may not pass the same key.
    /// `name` labels the new group in error messages (`"tp"`, `"dp"`, …).
    fn split_named(&self, color: usize, key: usize, name: &str) -> Result<Arc<dyn Communicator>>;

    /// [`Communicator::split_named`] with the name `"<parent>/<color>"`.
    fn split(&self, color: usize, key: usize) -> Result<Arc<dyn Communicator>> {
        let name = format!("{}/{}", self.name(), color);
        self.split_named(color, key, &name)
    }
}

/// A short human-readable description of a group: `"tp[2,3]"`.
pub fn describe(comm: &dyn Communicator) -> String {
    let m: Vec<String> = comm.members().iter().map(|r| r.to_string()).collect();
    format!("{}[{}]", comm.name(), m.join(","))
}
