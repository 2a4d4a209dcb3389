//! The MPI runtime of this process: initialisation and finalisation, how MPI calls are
//! made (serialised when the library is not thread-safe, errors turned into strings),
//! the polling loop every wait goes through, the process's failure state, and abort.

use std::ffi::{c_int, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use mpi::environment::{self, Threading, Universe};
use mpi::ffi;

use super::MpiConfig;
use crate::{CommError, Peer, Result};

/// An MPI handle (a pointer in OpenMPI) that may cross threads: the library is
/// initialised for `MPI_THREAD_MULTIPLE`, or every call is serialised by [`Runtime::call`].
#[derive(Clone, Copy)]
pub(super) struct Handle<T>(pub T);
// SAFETY: see above; handles are only used through MPI calls.
unsafe impl<T> Send for Handle<T> {}
unsafe impl<T> Sync for Handle<T> {}

/// The runtime alive in this process, if any.
static CURRENT: Mutex<Weak<Runtime>> = Mutex::new(Weak::new());
/// This process's world rank once MPI is up (for [`abort`]'s message).
static WORLD_RANK: AtomicUsize = AtomicUsize::new(usize::MAX);

/// How long a waiting rank polls without sleeping: long enough to cover a large transfer
/// that only progresses while MPI is called, short enough not to burn a core through a
/// pipeline bubble.
const SPIN: Duration = Duration::from_millis(20);

pub(super) struct Runtime {
    /// Dropping the universe calls `MPI_Finalize`.
    universe: Mutex<Option<Universe>>,
    pub timeout: Duration,
    /// Held around every MPI call when the library is not `MPI_THREAD_MULTIPLE`.
    serial: Option<Mutex<()>>,
    /// The largest MPI tag (`MPI_TAG_UB`).
    pub tag_ub: u64,
    pub world_rank: usize,
    pub world_size: usize,
    /// The first failure of this process (a timeout): later operations refuse to run.
    failure: Mutex<Option<(usize, String)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The text of an MPI error code.
pub(super) fn error_string(code: c_int) -> String {
    let mut buf = vec![0 as std::ffi::c_char; 1024];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING (256 in OpenMPI) characters.
    let rc = unsafe { ffi::MPI_Error_string(code, buf.as_mut_ptr(), &mut len) };
    if rc != 0 {
        return format!("MPI error {code}");
    }
    // SAFETY: MPI wrote a NUL-terminated string.
    let s = unsafe { CStr::from_ptr(buf.as_ptr()) };
    format!("MPI error {code}: {}", s.to_string_lossy())
}

impl Runtime {
    /// The runtime of this process, starting MPI on first use.
    pub fn get(config: MpiConfig) -> Result<Arc<Runtime>> {
        let mut current = lock(&CURRENT);
        if let Some(rt) = current.upgrade() {
            return Ok(rt);
        }
        let backend = |reason: String| CommError::Backend {
            op: "mpi::init",
            rank: crate::mpi::launcher_rank().unwrap_or(0),
            reason,
        };
        let timeout = config.timeout;
        if environment::is_finalized() {
            return Err(backend(
                "MPI was finalised when the last communicator was dropped; it cannot be \
                 initialised twice in one process"
                    .into(),
            ));
        }
        let (universe, threading) = environment::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| {
                backend("MPI was already initialised outside switchyard_comm::mpi::init".into())
            })?;
        let world = Handle(unsafe { ffi::RSMPI_COMM_WORLD });
        let (mut rank, mut size): (c_int, c_int) = (0, 0);
        // SAFETY: MPI is initialised; the out-pointers are valid.
        unsafe {
            // Errors become return codes (turned into CommError) instead of aborting.
            ffi::MPI_Comm_set_errhandler(world.0, ffi::RSMPI_ERRORS_RETURN);
            ffi::MPI_Comm_rank(world.0, &mut rank);
            ffi::MPI_Comm_size(world.0, &mut size);
        }
        let tag_ub = query_tag_ub(world.0);
        let world_rank = rank as usize;
        WORLD_RANK.store(world_rank, Ordering::Release);
        let rt = Arc::new(Runtime {
            universe: Mutex::new(Some(universe)),
            timeout,
            serial: (threading < Threading::Multiple).then(|| Mutex::new(())),
            tag_ub,
            world_rank,
            world_size: size as usize,
            failure: Mutex::new(None),
        });
        *current = Arc::downgrade(&rt);
        Ok(rt)
    }

    pub fn world(&self) -> Handle<ffi::MPI_Comm> {
        Handle(unsafe { ffi::RSMPI_COMM_WORLD })
    }

    /// Makes one MPI call (serialised if need be); a failing return code becomes its text.
    pub fn call(&self, f: impl FnOnce() -> c_int) -> std::result::Result<(), String> {
        let _guard = self.serial.as_ref().map(lock);
        match f() {
            0 => Ok(()),
            code => Err(error_string(code)),
        }
    }

    /// Fails fast once this process has failed.
    pub fn check(&self, op: &'static str, rank: usize, peer: Peer) -> Result<()> {
        match &*lock(&self.failure) {
            None => Ok(()),
            Some((failed_rank, cause)) => Err(CommError::PeerFailed {
                op,
                rank,
                peer,
                failed_rank: *failed_rank,
                cause: cause.clone(),
            }),
        }
    }

    /// Whether this process has failed (an operation timed out or MPI failed).
    pub fn failed(&self) -> bool {
        lock(&self.failure).is_some()
    }

    /// Records the first failure of this process.
    pub fn fail(&self, err: &CommError) {
        let mut f = lock(&self.failure);
        if f.is_none() {
            *f = Some((self.world_rank, err.to_string()));
        }
    }

    /// Calls `step` until it reports completion (`Ok(true)`), an error, or the deadline
    /// of `poll` (`Ok(false)`).
    pub fn poll(
        &self,
        poll: &Poll,
        mut step: impl FnMut() -> std::result::Result<bool, String>,
    ) -> std::result::Result<bool, String> {
        loop {
            if step()? {
                return Ok(true);
            }
            let waited = poll.start.elapsed();
            if waited >= poll.timeout {
                return Ok(false);
            }
            if waited < SPIN {
                std::thread::yield_now();
            } else if waited < Duration::from_secs(1) {
                std::thread::sleep(Duration::from_micros(50));
            } else {
                std::thread::sleep(Duration::from_micros(500));
            }
        }
    }
}

impl Drop for Runtime {
    fn drop(&mut self) {
        let universe = lock(&self.universe).take();
        if self.failed() {
            // An abandoned operation may still be in flight, and MPI_Finalize could wait
            // for it forever. Exiting without finalising makes mpirun end the job.
            std::mem::forget(universe);
            return;
        }
        // MPI_Finalize: every communicator (and its sends) is gone by now.
        drop(universe);
        WORLD_RANK.store(usize::MAX, Ordering::Release);
    }
}

/// The clock of one blocking operation.
pub(super) struct Poll {
    start: Instant,
    pub timeout: Duration,
}

impl Poll {
    pub fn new(timeout: Duration) -> Poll {
        Poll {
            start: Instant::now(),
            timeout,
        }
    }
}

fn query_tag_ub(world: ffi::MPI_Comm) -> u64 {
    let mut value: *mut c_int = std::ptr::null_mut();
    let mut flag: c_int = 0;
    // SAFETY: for MPI_TAG_UB, MPI stores a pointer to an int in `value`.
    let rc = unsafe {
        ffi::MPI_Comm_get_attr(
            world,
            ffi::MPI_TAG_UB as c_int,
            &mut value as *mut *mut c_int as *mut std::ffi::c_void,
            &mut flag,
        )
    };
    if rc == 0 && flag != 0 && !value.is_null() {
        // SAFETY: MPI set `value` to its attribute.
        let ub = unsafe { *value };
        if ub > 0 {
            return ub as u64;
        }
    }
    // The standard's guaranteed minimum.
    32767
}

/// See [`crate::mpi::abort`].
pub(super) fn abort(code: i32, message: &str) -> ! {
    let rank = match WORLD_RANK.load(Ordering::Acquire) {
        usize::MAX => crate::mpi::launcher_rank().unwrap_or(0),
        r => r,
    };
    eprintln!("rank {rank} failed: {message}");
    if environment::is_initialized() && !environment::is_finalized() {
        // SAFETY: MPI is initialised; MPI_Abort does not return.
        unsafe {
            ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, code);
        }
    }
    std::process::exit(code)
}
