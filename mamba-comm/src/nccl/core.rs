//! The communicator's core: init with a deadline, collective windows under a
//! watchdog, groups, and single-shot teardown, written against the library
//! table ([`NcclApi`]) and the completion seam ([`Completion`]) only, so every
//! rule here is tested on the CPU with a fake library.
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

use std::ffi::c_int;
#[cfg(test)]
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_sys_min::{ncclComm_t, ncclConfig_t, ncclResult_t};

use super::api::NcclApi;
use super::completion::Completion;
use super::handle::HandleSlot;
use super::result::{completed, nonblocking, Progress};
use super::watchdog::{self, nonempty, Until};
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
    /// Create this rank's communicator with NCCL's nonblocking pattern:
    /// `ncclCommInitRankConfig` with `blocking = 0`, then poll
    /// `ncclCommGetAsyncError` until it leaves `ncclInProgress`. A peer that
    /// never arrives makes the poll reach `deadline`; the half-made
    /// communicator is then aborted and the error says so. Errors carry
    /// NCCL's last-error text.
    pub(crate) fn init(
        api: Arc<dyn NcclApi>,
        id: &[u8; 128],
        place: Place,
        init_timeout: Duration,
        deadline: Instant,
        collective_timeout: Duration,
    ) -> Result<Self> {
        let Place { rank, world } = place;
        let to_c = |v: usize, what: &str| {
            c_int::try_from(v)
                .map_err(|_| CommError::config(format!("{what} {v} does not fit NCCL's int")))
        };
        let (c_world, c_rank) = (to_c(world, "world size")?, to_c(rank, "rank")?);
        if world == 0 || rank >= world {
            return Err(CommError::config(format!(
                "NCCL init: rank {rank} is outside a world of {world}; expected 0 <= rank < world"
            )));
        }
        let mut config = ncclConfig_t::initializer();
        config.blocking = 0;
        let (rc, raw) = api.init_rank_config(c_world, id, c_rank, &mut config);
        let started = nonblocking(rc);
        if started.is_err() || raw.is_null() {
            // SAFETY: `raw` is null or the handle NCCL just returned.
            let text = unsafe { api.last_error(raw) };
            if !raw.is_null() {
                // SAFETY: a non-null handle from a failed init still owns
                // resources; it is aborted once and never used again.
                unsafe { api.abort(raw) };
            }
            let what = match started {
                Ok(_) => "returned no communicator".to_string(),
                Err(e) => format!("returned {}", api.describe(e)),
            };
            return Err(CommError::transport(
                "init",
                format!(
                    "rank {rank} of {world}: ncclCommInitRankConfig {what}; NCCL says: {}",
                    nonempty(&text)
                ),
            ));
        }
        let mut core = CommCore {
            api,
            slot: HandleSlot::new(raw),
            place,
            device: -1,
            collective_timeout,
            group: None,
            window: None,
        };
        let hint = format!(
            "a rank never arrived: all {world} ranks must call init within {init_timeout:?}; a crashed \
             rank, a wrong unique id or an unreachable network are the usual causes (NCCL_DEBUG=WARN \
             shows NCCL's view)"
        );
        core.wait("init", Until::Ready, deadline, init_timeout, &hint)?;
        // SAFETY: the handle is live (Some) and initialised (the poll above
        // returned ncclSuccess).
        let identity = unsafe { core.api.identity(raw) };
        match identity {
            Ok((count, user_rank, device)) if count == c_world && user_rank == c_rank => {
                core.device = device;
                Ok(core)
            }
            Ok((count, user_rank, _)) => Err(core.fail(
                "init",
                format!(
                    "NCCL made a communicator of {count} ranks with this process as rank \
                     {user_rank}; expected {world} ranks and rank {rank}"
                ),
            )),
            Err(e) => {
                let d = core.api.describe(e);
                Err(core.fail("init", format!("querying the new communicator failed: {d}")))
            }
        }
    }

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

    /// True while a group is open.
    pub(crate) fn in_group(&self) -> bool {
        self.group.is_some()
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

    /// Fail `op` for a reason found outside NCCL (e.g. a CUDA error around a
    /// collective): same rules as an NCCL failure (abort now, or after the
    /// enclosing group closes).
    pub(crate) fn abort_with(&mut self, op: &str, detail: String) -> CommError {
        self.fail(op, detail)
    }

    /// Abort now (see [`HandleSlot::abort`]). Returns a note for error
    /// messages when the abort itself failed.
    fn abort_now(&mut self) -> String {
        match self.slot.abort(&*self.api) {
            Ok(()) => String::new(),
            Err(e) => format!(" (ncclCommAbort itself returned {})", self.api.describe(e)),
        }
    }

    /// Record a failure of `op`: abort now, or, inside an open group, poison
    /// and let the group's close abort. Returns the error for the caller.
    fn fail(&mut self, op: &str, detail: String) -> CommError {
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
        // SAFETY: `h` is live, and nothing releases it during the wait.
        let waited = unsafe { watchdog::wait(&*self.api, h, until, op, deadline, timeout, hint) };
        waited.map_err(|detail| self.fail(op, detail))
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

    /// Open a group level (`ncclGroupStart`). Must be paired with
    /// [`CommCore::group_finish`] whatever happens in between.
    pub(crate) fn group_begin(&mut self) -> Result<()> {
        self.slot.live_handle("group")?;
        if let Err(e) = completed(self.api.group_start()) {
            let d = self.api.describe(e);
            return Err(self.fail("group", format!("ncclGroupStart returned {d}")));
        }
        let deadline = self.window_or_new_deadline();
        match self.group.as_mut() {
            Some(g) => g.depth += 1,
            None => {
                self.group = Some(GroupState {
                    depth: 1,
                    deadline,
                    ops: 0,
                    failure: None,
                })
            }
        }
        Ok(())
    }

    /// Close a group level: `ncclGroupEnd` is always called, even when the
    /// body failed or the core was poisoned inside it. At the outermost level:
    /// - a failure inside the group aborts now (after the close);
    /// - a failed body that had already enqueued operations aborts too (its
    ///   peers would wait for the rest) and the error says so; a body that
    ///   failed before enqueuing anything leaves the communicator usable;
    /// - otherwise the whole group is one collective window, waited for under
    ///   the watchdog; inside an open window the wait is left to the
    ///   window's end (the group is enqueued on the stream when this
    ///   returns).
    pub(crate) fn group_finish<R>(
        &mut self,
        completion: &dyn Completion,
        body: Result<R>,
    ) -> Result<R> {
        let end = nonblocking(self.api.group_end());
        let Some(g) = self.group.as_mut() else {
            return Err(CommError::config(
                "group_finish without group_begin (a bug in mamba-comm)",
            ));
        };
        g.depth = g.depth.saturating_sub(1);
        if let Err(e) = end {
            let d = self.api.describe(e);
            g.failure
                .get_or_insert_with(|| format!("ncclGroupEnd returned {d}"));
            self.slot.poison();
        }
        if g.depth > 0 {
            return body;
        }
        let Some(g) = self.group.take() else {
            return Err(CommError::config(
                "group state vanished (a bug in mamba-comm)",
            ));
        };
        if let Some(reason) = g.failure {
            let Place { rank, world } = self.place;
            let note = self.abort_now();
            return Err(body.err().unwrap_or_else(|| {
                CommError::transport(
                    "group",
                    format!("rank {rank} of {world}: {reason}; the communicator was aborted{note}"),
                )
            }));
        }
        if g.ops > 0 {
            if let Err(e) = &body {
                return Err(self.fail(
                    "group",
                    format!(
                        "the group body failed after enqueuing {} operation(s), which peers \
                         would wait for: {e}",
                        g.ops
                    ),
                ));
            }
        }
        // A non-blocking group end may still be enqueuing: wait for it
        // whether the body succeeded or failed before enqueuing anything.
        if end == Ok(Progress::InProgress) {
            self.wait_enqueued("group", g.deadline)?;
        }
        let v = body?;
        if g.ops > 0 {
            match self.window.as_mut() {
                Some(w) => w.pending += g.ops,
                None => self.wait_complete("group", completion, g.deadline)?,
            }
        }
        Ok(v)
    }

    /// Open a window: until [`CommCore::window_finish`], closing a group
    /// enqueues it without waiting for the stream, so the caller can queue
    /// several groups (and its own stream work between them) and wait once.
    /// Every wait inside the window, and the final one, shares one deadline:
    /// the collective timeout from now. Windows do not nest and cannot open
    /// inside a group.
    pub(crate) fn window_begin(&mut self) -> Result<()> {
        self.slot.live_handle("window")?;
        if self.group.is_some() {
            return Err(CommError::config(
                "a window cannot open inside a group; open the window first and run groups in it",
            ));
        }
        if self.window.is_some() {
            return Err(CommError::config(
                "windows do not nest: finish the open window before opening another",
            ));
        }
        self.window = Some(WindowState {
            deadline: Instant::now() + self.collective_timeout,
            pending: 0,
        });
        Ok(())
    }

    /// Close the window. `body_error` is the text of the body's error, if
    /// it failed.
    /// - The body failed after groups were enqueued in the window: abort
    ///   (peers would wait for the rest), and the error says so.
    /// - The body failed before enqueuing anything (or the communicator is
    ///   already aborted): nothing more happens here; the caller returns the
    ///   body's error.
    /// - The body succeeded: wait under the watchdog, until the window's
    ///   deadline, for everything enqueued on the stream so far (NCCL's
    ///   groups and any work the caller made the stream wait for).
    pub(crate) fn window_finish(
        &mut self,
        completion: &dyn Completion,
        body_error: Option<&str>,
    ) -> Result<()> {
        let Some(w) = self.window.take() else {
            return Err(CommError::config(
                "window_finish without window_begin (a bug in mamba-comm)",
            ));
        };
        match body_error {
            Some(e) if w.pending > 0 && !self.is_aborted() => Err(self.fail(
                "window",
                format!(
                    "the window body failed after enqueuing {} operation(s), which peers would \
                     wait for: {e}",
                    w.pending
                ),
            )),
            Some(_) => Ok(()),
            None => self.wait_complete("window", completion, w.deadline),
        }
    }

    /// Orderly teardown: `ncclCommFinalize`, polled to completion under the
    /// collective timeout, then `ncclCommDestroy`.
    /// - A failed or timed-out finalize aborts instead, and the error says so.
    /// - The handle is released before `ncclCommDestroy`; a failed destroy is
    ///   reported and never followed by an abort (the handle is gone).
    /// - On a communicator already aborted (or already shut down) there is
    ///   nothing left to release: `Ok(())`, and no NCCL call is made.
    pub(crate) fn shutdown(&mut self) -> Result<()> {
        if self.group.is_some() {
            return Err(CommError::config(
                "shutdown inside an open group (a bug in mamba-comm)",
            ));
        }
        if !self.slot.exists() {
            return Ok(());
        }
        if self.is_aborted() {
            self.abort_now();
            return Ok(());
        }
        let h = self.slot.live_handle("shutdown")?;
        let timeout = self.collective_timeout;
        let deadline = Instant::now() + timeout;
        // SAFETY: `h` is live (present, not aborted).
        if let Err(e) = nonblocking(unsafe { self.api.finalize(h) }) {
            // SAFETY: still live; text read before the abort.
            let text = unsafe { self.api.last_error(h) };
            let d = self.api.describe(e);
            return Err(self.fail(
                "shutdown",
                format!(
                    "ncclCommFinalize returned {d}: {}; aborting instead of destroying",
                    nonempty(&text)
                ),
            ));
        }
        self.wait(
            "shutdown",
            Until::Ready,
            deadline,
            timeout,
            "ncclCommFinalize never reached quiescence: a peer is gone or stuck",
        )?;
        match self.slot.destroy(&*self.api) {
            Ok(_) => Ok(()),
            Err(e) => {
                let Place { rank, world } = self.place;
                Err(CommError::transport(
                    "shutdown",
                    format!(
                        "rank {rank} of {world}: ncclCommDestroy returned {}; the handle is \
                         released and is not aborted (it no longer exists to abort)",
                        self.api.describe(e)
                    ),
                ))
            }
        }
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
