//! The NCCL communicator: fail-fast, with a deadline on every wait.
//!
//! [`NcclComm`] is one process's rank in a world of GPUs. It implements
//! [`Transport`](crate::Transport) over device memory
//! (`cudarc::driver::CudaSlice<f32>`), and keeps these rules:
//!
//! - **Preflight** ([`preflight`]): the library is opened at run time and
//!   refused below [`MIN_VERSION`] (2.26.0); this doubles as the "is NCCL
//!   here" check a supervisor makes before spawning ranks.
//! - **Unique id**: rank 0 creates the 128-byte id and publishes it through
//!   the [`Rendezvous`](crate::Rendezvous) under [`UNIQUE_ID_KEY`] (the file
//!   rendezvous writes to a temporary name, then renames); the others fetch
//!   exactly 128 bytes with the init deadline.
//! - **Init with a hard deadline**, **collective watchdog**, **single-shot
//!   teardown** and **groups that always close**: see below and the
//!   `core` module.
//! - Byte movement (send, recv, broadcast) for the fixed-order reducer; the
//!   library's own arithmetic only for the opt-in f32 sum and for exact i32
//!   max flags.
//! - One communicator per process. It retains the CUDA context it was made
//!   in; it may move between threads (`Send`) but is used from one at a time
//!   (`!Sync`, every call takes `&mut self`).
//!
//! # Why nonblocking communicators and async-error polling
//!
//! NCCL's documented fault-tolerance pattern (NCCL user guide, "Fault
//! Tolerance" and "Communicator configuration: blocking") is to create
//! communicators with `ncclCommInitRankConfig` and `config.blocking = 0`.
//! Every call on such a communicator returns at once (`ncclInProgress` while
//! work continues in the background), and the caller polls
//! `ncclCommGetAsyncError` until it reports `ncclSuccess` or an error; when
//! anything goes wrong the application calls `ncclCommAbort` on every rank.
//!
//! A blocking communicator cannot keep a deadline: `ncclCommInitRank` waits
//! inside NCCL for every peer, and the first point-to-point operation
//! between two ranks connects them inside `ncclGroupEnd`, so a missing peer
//! means a thread stuck in the library with no way back except another
//! thread calling abort on a handle that thread is still using. With the
//! nonblocking pattern the calling thread never waits inside NCCL: it owns
//! the clock, and when the deadline passes it sets the aborted flag and
//! aborts the communicator itself. Nothing here uses the blocking path.
//!
//! A collective's window runs from its enqueue to the completion of the
//! stream: the watchdog polls `ncclCommGetAsyncError` (errors reported by
//! NCCL's proxy threads, e.g. a peer that closed its socket) and
//! `cuStreamQuery` (the kernels actually finished) until both say done, or
//! the collective timeout passes. On expiry the aborted flag is set *before*
//! `ncclCommAbort`, so no later path (a retry, `shutdown`, `Drop`) can touch
//! the freed handle, and the error says the communicator was aborted.
//!
//! With [`NcclComm::watch_aborts`] the watchdog also ends a wait when
//! another rank has posted its failure to the launch's rendezvous
//! ([`crate::world_abort`]): a rank that failed outside any collective
//! would otherwise leave its peers waiting for the whole timeout. The
//! abort is the same as any failure's; the error is
//! [`CommError::PeerFailed`] naming the
//! poster. The watch's thread does the rendezvous I/O, so the wait loop
//! only reads memory.
//!
//! The NCCL calls go through a small internal table (`api::NcclApi`), whose
//! return codes become `Result`s in one place (`result`), and the stream
//! query through another seam (`completion::Completion`); the CPU tests in
//! this module drive the same logic with a fake library that hangs, fails
//! and loses peers on command. Inside: `core` (init, windows, groups,
//! teardown), `handle` (the only owner of the raw handle), `watchdog` (the
//! waits), `op` and `comm` (the typed operations on device memory), `window`
//! (several groups, one wait),
//! `cuda` (device discovery).

mod api;
mod checks;
mod comm;
mod completion;
mod core;
mod cuda;
mod handle;
mod op;
mod result;
mod unique_id;
mod watchdog;
mod window;

#[cfg(test)]
mod fake;
#[cfg(test)]
mod tests;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

pub use comm::NcclComm;
pub use cuda::visible_devices;
pub use nccl_sys_min::NcclVersion;
use nccl_sys_min::{Nccl, LIBRARY_ENV};
pub use window::Window;

use crate::{CommError, Result};

/// The oldest NCCL this crate accepts: 2.26.0 (code 22600).
pub const MIN_VERSION: NcclVersion = NcclVersion::new(2, 26, 0);

/// The rendezvous key under which rank 0 publishes the unique id.
pub const UNIQUE_ID_KEY: &str = "nccl-unique-id";

/// Length of NCCL's unique id in bytes.
pub const UNIQUE_ID_BYTES: usize = 128;

/// Deadlines of the communicator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NcclOptions {
    /// Upper bound on [`NcclComm::init`] as a whole: fetching the unique id
    /// and NCCL's own init (every rank must arrive within it).
    pub init_timeout: Duration,
    /// Upper bound on one collective window (enqueue through stream
    /// completion; a whole group is one window) and on the finalize of
    /// [`NcclComm::shutdown`].
    pub collective_timeout: Duration,
}

impl Default for NcclOptions {
    /// 120 s for init, 300 s per collective window.
    fn default() -> Self {
        NcclOptions {
            init_timeout: Duration::from_secs(120),
            collective_timeout: Duration::from_secs(300),
        }
    }
}

/// Open NCCL (once per process) and check its version against
/// [`MIN_VERSION`]. Run before spawning ranks: a missing or too-old library
/// is then one clear error instead of one per rank.
pub fn preflight() -> Result<NcclVersion> {
    let lib = library()?;
    check_version(lib.version(), lib.path())
}

/// `version` is at least [`MIN_VERSION`].
pub(crate) fn check_version(version: NcclVersion, path: &str) -> Result<NcclVersion> {
    if version < MIN_VERSION {
        return Err(CommError::config(format!(
            "NCCL {version} (code {}) at {path} is older than the supported floor {MIN_VERSION} \
             (code {}); install NCCL {MIN_VERSION} or newer, or point {LIBRARY_ENV} at one",
            version.code(),
            MIN_VERSION.code()
        )));
    }
    Ok(version)
}

/// The process's NCCL library, opened on first success and kept for the life
/// of the process (never unloaded: NCCL's threads may outlive any one
/// communicator). A failure is not cached, so fixing the environment and
/// retrying works.
pub(crate) fn library() -> Result<Arc<Nccl>> {
    static LIB: OnceLock<Arc<Nccl>> = OnceLock::new();
    if let Some(lib) = LIB.get() {
        return Ok(Arc::clone(lib));
    }
    let lib = Nccl::open().map_err(|e| CommError::config(e.to_string()))?;
    Ok(Arc::clone(LIB.get_or_init(|| Arc::new(lib))))
}
