//! Groups and windows of the core: how several operations become one
//! collective window (see the parent module's docs for the rules).

use std::time::Instant;

use super::{CommCore, GroupState, Place, WindowState};
use crate::nccl::completion::Completion;
use crate::nccl::result::{completed, nonblocking, Progress};
use crate::{CommError, Result};

impl CommCore {
    /// Refuse `op`, a call that waits on the host for the stream (a
    /// download, an upload from pageable memory, a host-value all-reduce),
    /// while a group or a window is open: inside a group its data would
    /// only move when the group closes, and inside a window the stream
    /// holds enqueued groups, so the copy would wait for them on the host
    /// with no deadline (a missing peer would hang it forever, out of the
    /// watchdog's reach). The typed API already keeps such calls out of
    /// group and window bodies; this is the core's own guard.
    pub(crate) fn refuse_host_wait(&self, op: &str) -> Result<()> {
        let inside = if self.group.is_some() {
            "a group: its operations only run when the group closes"
        } else if self.window.is_some() {
            "a window: the stream holds the window's enqueued groups, and the host would wait \
             for them with no deadline"
        } else {
            return Ok(());
        };
        Err(CommError::config(format!(
            "{op} cannot run inside {inside}; move it after the window or group returns"
        )))
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
}
