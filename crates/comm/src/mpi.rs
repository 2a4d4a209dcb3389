//! The MPI backend: one process per rank under `mpirun`.
//!
//! Built with the cargo feature `mpi` (rsmpi on OpenMPI; `scripts/install-mpi.sh`
//! installs what the build needs). Without the feature the public surface is the same:
//! [`init`] and [`init_with`] return [`CommError::Unavailable`] with instructions, so
//! callers need no `cfg` of their own. The tutorial is `docs/tutorial/08-mpi.md`.
//!
//! ## Design
//!
//! The backend implements [`Communicator`] with the semantics of the in-process backend
//! ([`crate::local`]) and passes the same conformance suite ([`crate::conformance`]).
//!
//! * **Nothing blocks inside MPI.** Every operation is started with a non-blocking call
//!   (`MPI_Isend`, `MPI_Improbe`/`MPI_Imrecv`, `MPI_Iallgather`, `MPI_Ialltoallv`, …) and
//!   completed by polling `MPI_Test*`: a short spin (yielding the core), then short sleeps.
//!   So every wait is bounded by the timeout of [`MpiConfig`] (default 300 s, as the local
//!   backend; [`init`] takes it from `SWITCHYARD_COMM_TIMEOUT_SECS` when that is set,
//!   [`init_with`] uses the configuration it is given) and ends with
//!   [`CommError::Timeout`] naming the operation, the rank and the peer or group. After a
//!   timeout the process's communicators refuse further work (`PeerFailed` naming the
//!   rank that timed out), as the local backend's do: MPI may still own buffers of the
//!   abandoned operation, which are leaked rather than freed, and the process does not
//!   call `MPI_Finalize` (which could wait for the abandoned operation forever): `mpirun`
//!   then ends the job.
//! * **Eager sends.** [`Communicator::send`] copies the tensor into one message (a small
//!   header with tag, dtype and shape, then the data), starts `MPI_Isend` and returns. The
//!   message stays alive until MPI reports it sent; completed sends are reaped by every
//!   later call, and a communicator that is dropped first drains its sends (bounded by
//!   the timeout). Receives match the (source, tag) with `MPI_Improbe`; a switchyard tag
//!   (64 bits) is folded into MPI's tag range, and a message whose full tag differs is
//!   kept aside for the receive that wants it.
//! * **Descriptors first.** Every collective starts with the same step, an all-gather of a
//!   fixed-size descriptor (operation, dtype, shape, dim, reduce op, root, colour and key).
//!   Ranks that disagree all return [`CommError::Mismatch`] before any data moves, and
//!   the group stays usable; the descriptor also tells broadcast's non-roots the root's
//!   shape, and it doubles as the barrier.
//! * **Rank-order reductions.** All-reduce is a reduce-scatter (`MPI_Ialltoallv` of
//!   line-aligned chunks into the group's reused scratch buffer) followed by an
//!   all-gather (`MPI_Iallgatherv`). Buffers up to 1 KiB ride with the descriptors (one
//!   round in all) and small ones are all-gathered whole. Either way each rank reduces
//!   with the crate's own kernel, in rank order, so results are bit-identical to the
//!   in-process backend's and do not depend on MPI's choice of algorithm.
//!   Reduce-scatter is one `MPI_Ialltoallv` plus the same kernel.
//! * **Groups** are MPI communicators: [`Communicator::split_named`] checks the colours
//!   and keys of every rank (duplicate keys are a `Mismatch` on every rank), then calls
//!   `MPI_Comm_split`. Point-to-point messages of different groups never meet.
//! * **Lifetime.** [`init`] calls `MPI_Init_thread` asking for `MPI_THREAD_MULTIPLE` (if
//!   the library offers less, the backend serialises its MPI calls itself). Every
//!   communicator holds the MPI runtime; `MPI_Finalize` runs when the last one (the world
//!   and every group split from it) is dropped. Keep them until the end of `main`. MPI
//!   cannot be initialised twice: [`init`] after finalisation is an error.
//! * **Failure ends the job.** A process that exits or dies makes `mpirun` end the job
//!   (OpenMPI's default). A rank whose work fails should call [`abort`], which prints
//!   `rank R failed: message` and calls `MPI_Abort`: the `switchyard` binary does so.
//!   Unlike the local backend, other ranks are not told *why*: they are killed by
//!   `mpirun`, whose report names the rank and its exit code.
//!
//! Limits: CPU tensors of dtype f32, f64, bf16, f16, u8, u32 or i64; collectives take
//! tensors of at most 16 dims; one message or buffer holds at most 2^31 - 1 elements
//! (MPI's `int` counts). Data is sent in the host's byte order: all machines of a job
//! must share it (as every x86-64 and aarch64 cluster does).

use std::sync::Arc;
use std::time::Duration;

use crate::{CommError, Communicator, Result};

#[cfg(feature = "mpi")]
mod collective;
#[cfg(feature = "mpi")]
mod comm;
#[cfg(feature = "mpi")]
mod exchange;
#[cfg(feature = "mpi")]
mod runtime;
#[cfg(feature = "mpi")]
mod wire;

/// The environment variable that gives the timeout of [`init`] (seconds, decimals
/// allowed): a default only. A timeout passed explicitly ([`init_with`]) wins over it.
pub const TIMEOUT_ENV: &str = "SWITCHYARD_COMM_TIMEOUT_SECS";

/// How the MPI backend is set up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpiConfig {
    /// Bounds every blocking receive and collective (and the drain of unfinished sends
    /// when a communicator is dropped). [`init_with`] uses it as given; [`TIMEOUT_ENV`]
    /// is consulted only by [`MpiConfig::from_env`] (and so by [`init`]).
    pub timeout: Duration,
}

impl MpiConfig {
    /// The default bound on one blocking operation, as the local backend's.
    pub const DEFAULT_TIMEOUT: Duration = crate::local::Launcher::DEFAULT_TIMEOUT;

    /// The configuration [`init`] uses: the timeout from [`TIMEOUT_ENV`] when it is set,
    /// else [`MpiConfig::DEFAULT_TIMEOUT`].
    ///
    /// Errors: [`CommError::Invalid`] when the variable is not a positive number of seconds.
    pub fn from_env() -> Result<MpiConfig> {
        let env = std::env::var(TIMEOUT_ENV).ok();
        let timeout =
            resolve_timeout(None, env.as_deref()).map_err(|reason| CommError::Invalid {
                op: "mpi::init",
                rank: launcher_rank().unwrap_or(0),
                reason,
            })?;
        Ok(MpiConfig { timeout })
    }
}

/// The timeout MPI runs with: `explicit` when given (the environment is then not read at
/// all), else the value of [`TIMEOUT_ENV`] (`env`), else the default.
fn resolve_timeout(
    explicit: Option<Duration>,
    env: Option<&str>,
) -> std::result::Result<Duration, String> {
    if let Some(t) = explicit {
        return Ok(t);
    }
    let Some(v) = env else {
        return Ok(MpiConfig::DEFAULT_TIMEOUT);
    };
    match v.trim().parse::<f64>() {
        Ok(s) if s.is_finite() && s > 0.0 => Ok(Duration::from_secs_f64(s)),
        _ => Err(format!(
            "{TIMEOUT_ENV}={v:?} is not a positive number of seconds"
        )),
    }
}

impl Default for MpiConfig {
    fn default() -> Self {
        MpiConfig {
            timeout: Self::DEFAULT_TIMEOUT,
        }
    }
}

/// Whether this build has the MPI backend (the cargo feature `mpi`).
pub const fn is_available() -> bool {
    cfg!(feature = "mpi")
}

/// Initialises MPI and returns the world communicator of this process.
///
/// Same as [`init_with`] with [`MpiConfig::from_env`]: the timeout is [`TIMEOUT_ENV`]'s
/// when that is set, else the default (300 s).
///
/// Errors: as [`init_with`], and [`CommError::Invalid`] for a malformed [`TIMEOUT_ENV`].
pub fn init() -> Result<Arc<dyn Communicator>> {
    init_with(MpiConfig::from_env()?)
}

/// Initialises MPI (asking for `MPI_THREAD_MULTIPLE`) and returns the world communicator
/// of this process: rank `r` of `mpirun -np N` is rank `r` of a world of `N`.
///
/// Calling it again while any communicator is alive returns the same world communicator
/// (with the first call's configuration). MPI is finalised when the last communicator is
/// dropped and cannot be initialised again.
///
/// The configuration is used as given: [`TIMEOUT_ENV`] does not override it (it is only
/// the default of [`init`]).
///
/// Errors: [`CommError::Unavailable`] without the `mpi` feature; [`CommError::Backend`]
/// when MPI cannot start.
pub fn init_with(config: MpiConfig) -> Result<Arc<dyn Communicator>> {
    #[cfg(feature = "mpi")]
    {
        comm::world(config)
    }
    #[cfg(not(feature = "mpi"))]
    {
        let _ = config;
        Err(unavailable())
    }
}

/// Ends the whole job because this rank failed: prints `rank R failed: <message>` on
/// stderr and calls `MPI_Abort(MPI_COMM_WORLD, code)`, after which `mpirun` kills every
/// rank and exits with an error.
///
/// Call it when a rank's work returns an error; other ranks may be blocked waiting for
/// this one and would otherwise only notice at their timeout. Without MPI (no `mpi`
/// feature, or MPI not initialised) it prints the same line and exits with `code`.
pub fn abort(code: i32, message: &str) -> ! {
    #[cfg(feature = "mpi")]
    {
        runtime::abort(code, message)
    }
    #[cfg(not(feature = "mpi"))]
    {
        eprintln!("rank {} failed: {message}", launcher_rank().unwrap_or(0));
        std::process::exit(code)
    }
}

/// This process's rank as announced by the MPI launcher in the environment
/// (`OMPI_COMM_WORLD_RANK`, `PMI_RANK` or `PMIX_RANK`), before or without [`init`];
/// `None` when the process was not started by `mpirun`.
///
/// Useful to check that `--backend mpi` was really launched with `mpirun`, and to print
/// from one rank only before MPI is up.
pub fn launcher_rank() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

/// The world size announced by the MPI launcher (`OMPI_COMM_WORLD_SIZE` or `PMI_SIZE`);
/// `None` when the process was not started by `mpirun`.
pub fn launcher_size() -> Option<usize> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}

#[cfg(not(feature = "mpi"))]
fn unavailable() -> CommError {
    CommError::Unavailable(
        "this build of switchyard has no MPI backend: rebuild with `--features mpi` \
         (scripts/install-mpi.sh installs OpenMPI and libclang on Debian)"
            .into(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_timeout_matches_the_local_backend() {
        assert_eq!(MpiConfig::default().timeout, Duration::from_secs(300));
    }

    #[test]
    fn an_explicit_timeout_wins_over_the_environment() {
        let five = Duration::from_secs(5);
        assert_eq!(resolve_timeout(Some(five), Some("30")), Ok(five));
        // The variable is not even read when the timeout is explicit.
        assert_eq!(resolve_timeout(Some(five), Some("soon")), Ok(five));
    }

    #[test]
    fn the_environment_is_the_default_timeout() {
        assert_eq!(
            resolve_timeout(None, Some(" 1.5 ")),
            Ok(Duration::from_millis(1500))
        );
        assert_eq!(resolve_timeout(None, None), Ok(MpiConfig::DEFAULT_TIMEOUT));
        for bad in ["soon", "0", "-3", "nan", "inf", ""] {
            let e = resolve_timeout(None, Some(bad)).unwrap_err();
            assert!(
                e.contains(TIMEOUT_ENV) && e.contains("positive"),
                "{bad}: {e}"
            );
        }
    }

    #[cfg(not(feature = "mpi"))]
    #[test]
    fn init_without_the_feature_is_unavailable() {
        assert!(!is_available());
        match init() {
            Err(CommError::Unavailable(m)) => assert!(m.contains("--features mpi"), "{m}"),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("init succeeded without the mpi feature"),
        }
    }
}
