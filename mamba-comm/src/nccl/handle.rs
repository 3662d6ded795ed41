//! Who may touch the communicator handle, and when it is freed.
//!
//! [`HandleSlot`] holds NCCL's `ncclComm_t` and the aborted flag, and is the
//! only place the handle is released:
//! - the handle is present exactly while the communicator exists inside
//!   NCCL (neither destroyed nor aborted). It is taken out *before*
//!   `ncclCommDestroy` or `ncclCommAbort` is called, so no later path
//!   (`Drop` included) can hand a freed handle to NCCL, whatever those
//!   calls return;
//! - the aborted flag is set *before* the abort call (and when the core is
//!   poisoned for an abort deferred to a group's close); once set, no
//!   operation is issued with the handle. It is shared (`Arc`) so an
//!   observer (a test, a monitoring thread) can see the communicator die
//!   without touching it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nccl_sys_min::ncclComm_t;

use super::api::NcclApi;
use super::result::{completed, nonblocking, NcclError, Progress};
use crate::{CommError, Result};

/// A communicator handle. NCCL allows a communicator to be used from any
/// thread as long as calls are not concurrent; its owner
/// ([`super::core::CommCore`]) takes `&mut self` for every call, so moving
/// it between threads is sound.
struct Handle(ncclComm_t);

// SAFETY: see the type's docs; the pointer is never dereferenced in Rust.
unsafe impl Send for Handle {}

/// See the module docs.
pub(crate) struct HandleSlot {
    handle: Option<Handle>,
    aborted: Arc<AtomicBool>,
}

impl HandleSlot {
    /// Take ownership of `raw`.
    ///
    /// # Safety
    /// `raw` is a live handle NCCL returned (initialised or still
    /// initialising), owned by nobody else: from here on the slot alone
    /// destroys or aborts it.
    pub(crate) unsafe fn new(raw: ncclComm_t) -> Self {
        HandleSlot {
            handle: Some(Handle(raw)),
            aborted: Arc::new(AtomicBool::new(false)),
        }
    }

    /// True while the communicator exists inside NCCL (aborted or not:
    /// a poisoned slot still holds the handle until its abort).
    pub(crate) fn exists(&self) -> bool {
        self.handle.is_some()
    }

    /// True once the communicator was aborted or poisoned.
    pub(crate) fn is_aborted(&self) -> bool {
        self.aborted.load(Ordering::SeqCst)
    }

    /// The shared aborted flag.
    #[cfg(test)]
    pub(crate) fn aborted_flag(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.aborted)
    }

    /// The raw handle, whatever the flag says (for the fake's checks).
    #[cfg(test)]
    pub(crate) fn raw(&self) -> Option<ncclComm_t> {
        self.handle.as_ref().map(|h| h.0)
    }

    /// The handle for a new NCCL call on it, or an error saying why there
    /// is none (aborted, or shut down). The handle stays owned here: the
    /// caller uses it for calls made before it returns and keeps no copy.
    pub(crate) fn live_handle(&self, op: &str) -> Result<ncclComm_t> {
        if self.is_aborted() {
            return Err(CommError::transport(
                op,
                "the communicator was aborted after an earlier error; tear the world down and create a new one",
            ));
        }
        match &self.handle {
            Some(h) => Ok(h.0),
            None => Err(CommError::transport(
                op,
                "the communicator was already shut down",
            )),
        }
    }

    /// Mark the communicator aborted without aborting it yet (the abort
    /// waits for an open group to close).
    pub(crate) fn poison(&self) {
        self.aborted.store(true, Ordering::SeqCst);
    }

    /// Set the flag, release the handle, then `ncclCommAbort` it. Nothing
    /// to do (`Ok`) when the handle is already gone.
    pub(crate) fn abort(&mut self, api: &dyn NcclApi) -> std::result::Result<(), NcclError> {
        self.poison();
        let Some(h) = self.handle.take() else {
            return Ok(());
        };
        // SAFETY: the handle was live (present) and has just been released,
        // so this is its last use.
        completed(unsafe { api.abort(h.0) })
    }

    /// Release the handle, then `ncclCommDestroy` it: whatever the code,
    /// the handle is gone and is never aborted afterwards. Nothing to do
    /// when it is already gone.
    pub(crate) fn destroy(
        &mut self,
        api: &dyn NcclApi,
    ) -> std::result::Result<Progress, NcclError> {
        let Some(h) = self.handle.take() else {
            return Ok(Progress::Done);
        };
        // SAFETY: the handle was live and has been released: its last use.
        nonblocking(unsafe { api.destroy(h.0) })
    }
}
