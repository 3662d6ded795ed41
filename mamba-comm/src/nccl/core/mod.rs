//! The communicator's core: init with a deadline, collective windows under a
//! watchdog, groups, and single-shot teardown, written against the library
//! table ([`NcclApi`]) and the completion seam ([`Completion`]) only, so every
//! rule here is tested on the CPU with a fake library.
//!
//! Files: this one holds the state, the failure rule and single operations;
//! `lifecycle` has init and shutdown, `group` the groups and windows.
//!
//! State, and who may touch the handle:
//! - the handle and the aborted flag live in a [`HandleSlot`] (see the
//!   `handle` module): the handle is released before it is destroyed or
//!   aborted, and the flag is set before the abort;
//! - every wait goes through the `watchdog` module, which only observes;
//!   the abort decisions are made here.
//! - A failure inside an open group does not abort at once: NCCL's group
//!   state is per thread, and the group must be closed (`ncclGroupEnd`)
//!   before the communicator is aborted. The failure poisons the core
//!   (`aborted` set, no further calls) and the abort follows the group's
//!   close.
//! - A *window* ([`CommCore::window_begin`] .. [`CommCore::window_finish`])
//!   makes a sequence of groups one collective window: closing a group
//!   inside it enqueues the group without waiting for the stream, and the
//!   window's end waits once, under the watchdog, with a deadline counted
//!   from the window's start. A failed window body that had enqueued
//!   operations aborts (peers would wait for the rest), like a group body.

mod group;
mod lifecycle;

use std::ffi::c_int;
#[cfg(test)]
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_sys_min::{ncclComm_t, ncclResult_t};

use super::api::NcclApi;
use super::completion::Completion;
use super::handle::HandleSlot;
use super::result::{nonblocking, Progress};
use super::watchdog::{self, nonempty, Failure, Until};
use crate::world_abort::AbortWatch;
use crate::{CommError, Result};

/// The open group (outermost and nested levels share one window).
struct GroupState {
    depth: usize,
    deadline: Instant,
    /// Operations enqueued since the outermost `ncclGroupStart`.
    ops: usize,
    /// First failure seen inside the group; the abort waits for the close.
    failure: Option<String>,
}

/// The open window (see [`CommCore::window_begin`]).
struct WindowState {
    deadline: Instant,
    /// Operations of groups closed in the window, not yet waited for.
    pending: usize,
}

/// How the communicator is identified in messages.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Place {
    pub(crate) rank: usize,
    pub(crate) world: usize,
}

/// See the module docs.
pub(crate) struct CommCore {
    api: Arc<dyn NcclApi>,
    slot: HandleSlot,
    place: Place,
    /// The CUDA device NCCL reports for the communicator.
    device: c_int,
    collective_timeout: Duration,
    group: Option<GroupState>,
    window: Option<WindowState>,
    /// Another rank's posted failure ends every wait at once (see
    /// [`crate::world_abort`]); `None`: waits end only as NCCL, the stream
    /// or the deadline say.
    abort_watch: Option<AbortWatch>,
}

impl std::fmt::Debug for CommCore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CommCore")
            .field("rank", &self.place.rank)
            .field("world", &self.place.world)
            .field("live", &self.slot.exists())
            .field("aborted", &self.is_aborted())
            .finish()
    }
}

/// Timeout hint while NCCL is still enqueuing (nonblocking mode).
const STILL_ENQUEUING: &str =
    "NCCL was still enqueuing: a peer did not take part, or the device stalled";

/// Timeout hint of the collective watchdog.
const NO_COMPLETION: &str = "a peer did not take part, or the device stalled";

impl CommCore {
    /// This rank.
    pub(crate) fn rank(&self) -> usize {
        self.place.rank
    }

    /// Number of ranks.
    pub(crate) fn world(&self) -> usize {
        self.place.world
    }

    /// The CUDA device NCCL reports for this communicator.
    pub(crate) fn device(&self) -> c_int {
        self.device
    }

    /// Let `watch` end this communicator's waits when another rank posts
    /// its failure (replacing any earlier watch).
    pub(crate) fn set_abort_watch(&mut self, watch: AbortWatch) {
        self.abort_watch = Some(watch);
    }

    /// True once the communicator was aborted (or poisoned for an abort
    /// pending on a group's close).
    pub(crate) fn is_aborted(&self) -> bool {
        self.slot.is_aborted()
    }

    /// The shared aborted flag (see the module docs), for the fake library.
    #[cfg(test)]
    pub(crate) fn aborted_flag(&self) -> Arc<AtomicBool> {
        self.slot.aborted_flag()
    }

    /// The raw handle, for the fake library in tests.
    #[cfg(test)]
    pub(crate) fn raw_handle(&self) -> Option<ncclComm_t> {
        self.slot.raw()
    }

    /// True while a window is open.
    #[cfg(test)]
    pub(crate) fn in_window(&self) -> bool {
        self.window.is_some()
    }

    /// Deadline of a new wait that is not inside a group: the open
    /// window's, or the collective timeout from now.
    fn window_or_new_deadline(&self) -> Instant {
        self.window
            .as_ref()
            .map_or_else(|| Instant::now() + self.collective_timeout, |w| w.deadline)
    }

    /// Abort now (see [`HandleSlot::abort`]). Returns a note for error
    /// messages when the abort itself failed.
    fn abort_now(&mut self) -> String {
        match self.slot.abort(&*self.api) {
            Ok(()) => String::new(),
            Err(e) => format!(" (ncclCommAbort itself returned {})", self.api.describe(e)),
        }
    }

    /// Record a failure of `op`, found by NCCL or outside it (e.g. a CUDA
    /// error around a collective): abort now, or, inside an open group,
    /// poison and let the group's close abort. Returns the error for the
    /// caller.
    pub(crate) fn fail(&mut self, op: &str, detail: String) -> CommError {
        let Place { rank, world } = self.place;
        if let Some(g) = self.group.as_mut() {
            self.slot.poison();
            g.failure.get_or_insert_with(|| detail.clone());
            return CommError::transport(
                op,
                format!(
                    "rank {rank} of {world}: {detail}; the communicator will be aborted when the \
                     enclosing group closes"
                ),
            );
        }
        let note = self.abort_now();
        CommError::transport(
            op,
            format!(
                "rank {rank} of {world}: {detail}; the communicator was aborted{note} — tear the world down"
            ),
        )
    }

    /// Wait (see [`watchdog::wait`]) on the live handle; on failure,
    /// fail `op` (abort now, or after the enclosing group closes).
    fn wait(
        &mut self,
        op: &str,
        until: Until<'_>,
        deadline: Instant,
        timeout: Duration,
        hint: &str,
    ) -> Result<()> {
        let h = self.slot.live_handle(op)?;
        let watch = self.abort_watch.as_ref();
        // SAFETY: `h` is live, and nothing releases it during the wait.
        let limits = watchdog::Limits {
            op,
            deadline,
            timeout,
            hint,
        };
        let waited = unsafe { watchdog::wait(&*self.api, h, until, &limits, watch) };
        waited.map_err(|failure| match failure {
            Failure::Local(detail) => self.fail(op, detail),
            Failure::Peer(posted) => {
                // The same abort (or poison, inside a group) as any failure;
                // the error names the rank that posted, not this one.
                let aborted = if self.group.is_some() {
                    "its communicator will be aborted when the enclosing group closes"
                } else {
                    "its communicator was aborted"
                };
                let _ = self.fail(op, format!("rank {} posted its failure", posted.rank));
                CommError::PeerFailed {
                    rank: posted.rank,
                    detail: format!(
                        "{} (posted to the world abort; rank {} of {} stopped waiting in {op}:                          {aborted})",
                        posted.detail, self.place.rank, self.place.world
                    ),
                }
            }
        })
    }

    /// The collective watchdog: after an enqueue, wait until the stream has
    /// completed the work, NCCL reports an error, or `deadline` passes.
    fn wait_complete(
        &mut self,
        op: &str,
        completion: &dyn Completion,
        deadline: Instant,
    ) -> Result<()> {
        let t = self.collective_timeout;
        self.wait(op, Until::Complete(completion), deadline, t, NO_COMPLETION)
    }

    /// Wait until an enqueue or group end that returned `ncclInProgress`
    /// has been taken by NCCL.
    fn wait_enqueued(&mut self, op: &str, deadline: Instant) -> Result<()> {
        let t = self.collective_timeout;
        self.wait(op, Until::Ready, deadline, t, STILL_ENQUEUING)
    }

    /// One operation. Outside a group this is a whole collective window:
    /// enqueue, then wait (bounded by the collective timeout) until the
    /// stream has completed it. Inside a group it only enqueues; the group's
    /// close waits for everything.
    ///
    /// `call` makes the NCCL call with the live handle it is given; it must
    /// not keep the handle.
    pub(crate) fn run(
        &mut self,
        op: &str,
        completion: &dyn Completion,
        call: impl FnOnce(&dyn NcclApi, ncclComm_t) -> ncclResult_t,
    ) -> Result<()> {
        let h = self.slot.live_handle(op)?;
        let deadline = match &self.group {
            Some(g) => g.deadline,
            None => self.window_or_new_deadline(),
        };
        match nonblocking(call(&*self.api, h)) {
            Ok(Progress::Done) => {}
            Ok(Progress::InProgress) => self.wait_enqueued(op, deadline)?,
            Err(e) => {
                // SAFETY: `h` is live; read the text before any abort.
                let text = unsafe { self.api.last_error(h) };
                let d = self.api.describe(e);
                return Err(self.fail(op, format!("enqueue returned {d}: {}", nonempty(&text))));
            }
        }
        if let Some(g) = self.group.as_mut() {
            g.ops += 1;
            return Ok(());
        }
        self.wait_complete(op, completion, deadline)
    }
}

impl Drop for CommCore {
    /// Aborts a communicator that still exists in NCCL (never destroyed,
    /// never aborted); does nothing otherwise. Never panics. A group left
    /// open by a panic in its body is closed first, so this thread's NCCL
    /// group state returns to zero.
    fn drop(&mut self) {
        if let Some(g) = self.group.take() {
            for _ in 0..g.depth {
                let _ = self.api.group_end();
            }
        }
        if self.slot.exists() {
            let _ = self.abort_now();
        }
    }
}
