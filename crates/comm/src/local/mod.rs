//! The in-process backend: one thread per rank.
//!
//! [`launch`] (or a configured [`Launcher`]) starts `world_size` threads, gives each an
//! `Arc<dyn Communicator>` for the world group, runs the closure on every rank inside
//! that rank's own rayon pool, and returns every rank's result.
//!
//! ## How it works
//!
//! * **Point-to-point** goes through a crossbeam channel per `(group, source, destination,
//!   tag)`. A message is the tensor itself (an `Arc`), detached from the sender's autograd
//!   graph: no bytes are copied.
//! * **Collectives** meet at a rendezvous in the group's shared state. Each rank deposits
//!   its (contiguous) input; then, for all-reduce, rank `r` reduces the `r`-th slice of
//!   every input straight into one output buffer that all ranks share (a reduce-scatter),
//!   and after a second rendezvous every rank holds the whole result (the all-gather is
//!   free in shared memory). Each rank reads `(n-1)/n` of the data and writes `1/n`:
//!   bandwidth-optimal, with no scratch buffers. All-gather writes each rank's piece into
//!   one shared output in parallel; broadcast and all-to-all move `Arc`s only.
//! * **Failure** never hangs: the launcher records the first rank that returns an error,
//!   panics or times out, then wakes every blocked operation of every other rank, which
//!   returns [`CommError::PeerFailed`](crate::CommError::PeerFailed) naming itself, the
//!   peer or group it waited for, and the failed rank. A rank whose closure returns while
//!   a peer still waits for it also ends that wait. Every wait is bounded by the
//!   launcher's timeout.

mod comm;
mod group;
mod launcher;

pub use launcher::{launch, solo, FailureKind, LaunchError, Launcher, RankFailure};
