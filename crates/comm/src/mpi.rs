//! The MPI backend: one process per rank under `mpirun`.
//!
//! Built with the cargo feature `mpi`. Without it, [`init`] returns
//! [`CommError::Unavailable`] with instructions, so callers need no `cfg` of their own.

use std::sync::Arc;

use crate::{CommError, Communicator, Result};

/// Initialises MPI and returns the world communicator of this process.
pub fn init() -> Result<Arc<dyn Communicator>> {
    Err(CommError::Unavailable(
        "this build of switchyard has no MPI backend: rebuild with `--features mpi` \
         (scripts/install-mpi.sh installs OpenMPI and libclang on Debian)"
            .into(),
    ))
}
