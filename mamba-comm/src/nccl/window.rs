//! [`NcclComm::window`] and its body's handle, [`Window`]: several groups
//! enqueued back to back, one watchdog wait at the end.

use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

use cudarc::driver::CudaSlice;

use super::comm::NcclComm;
use super::completion::StreamCompletion;
use crate::flight::CallKind;
use crate::transport::Group;
use crate::{CommError, Result};

/// The body's view of one [`NcclComm::window`]: groups over the buffers
/// lent to the window, and read-only access to the communicator (its
/// stream, context, rank).
///
/// Invariant: every buffer a group of the window names was lent to the
/// `window` call and stays borrowed until the window's final wait has
/// returned, so NCCL's deferred reads and writes hit live memory. The
/// communicator is reachable only as `&NcclComm`: nothing that waits on the
/// host for the stream (a download, an upload, a host-value all-reduce,
/// a group outside the lent buffers) can run inside the window, where it
/// would wait for the enqueued groups with no deadline.
///
/// ```compile_fail,E0596
/// use cudarc::driver::CudaSlice;
/// use mamba_comm::nccl::NcclComm;
/// use mamba_comm::Transport;
/// fn misuse(comm: &mut NcclComm, buf: &mut CudaSlice<f32>) -> mamba_comm::Result<()> {
///     let mut host = vec![0.0f32; 4];
///     comm.window(&mut [], |w| {
///         // A download would wait for the window's groups with no deadline.
///         w.comm().download(buf, 0, &mut host)
///     })
/// }
/// ```
///
/// Correct use lends every buffer the window's groups touch:
///
/// ```no_run
/// use cudarc::driver::CudaSlice;
/// use mamba_comm::nccl::NcclComm;
/// use mamba_comm::Transport;
/// fn exchange(comm: &mut NcclComm, a: &mut CudaSlice<f32>, b: &mut CudaSlice<f32>) -> mamba_comm::Result<()> {
///     let peer = 1 - comm.rank();
///     comm.window(&mut [a, b], |w| {
///         w.group(|g| {
///             g.send(0, 0..4, peer)?;
///             g.recv(1, 0..4, peer)
///         })?;
///         w.group(|g| {
///             g.send(1, 0..4, peer)?;
///             g.recv(0, 0..4, peer)
///         })
///     })
/// }
/// ```
pub struct Window<'w, 'b> {
    comm: &'w mut NcclComm,
    buffers: &'w mut [&'b mut CudaSlice<f32>],
}

impl std::fmt::Debug for Window<'_, '_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Window")
            .field("comm", &*self.comm)
            .field("buffers", &self.buffers.len())
            .finish()
    }
}

impl Window<'_, '_> {
    /// The communicator, read-only: its stream (make it wait for events of
    /// other streams between groups), context, rank and world.
    pub fn comm(&self) -> &NcclComm {
        self.comm
    }

    /// Enqueue one group over the window's lent buffers (named by index,
    /// see [`Group`]) and return once NCCL has queued it on the
    /// communicator's stream, without waiting for it: the window's end
    /// waits for every group.
    pub fn group<R>(
        &mut self,
        body: impl FnOnce(&mut Group<'_, '_, NcclComm>) -> Result<R>,
    ) -> Result<R> {
        self.comm.run_group(self.buffers, body)
    }
}

impl NcclComm {
    /// Run `body` as one collective window with a single wait at its end.
    ///
    /// Inside the window, [`Window::group`] enqueues its group on
    /// [`NcclComm::stream`] and returns without waiting for it, so `body`
    /// can queue many groups, and make the stream wait for work on other
    /// streams of this context (`w.comm().stream().wait(&event)`), with no
    /// host round-trip in between. When `body` returns `Ok`, the window
    /// waits under the watchdog until the stream has completed everything
    /// enqueued so far; the deadline is the collective timeout counted from
    /// the window's start, and on expiry the communicator is aborted as for
    /// any window.
    ///
    /// `buffers` are lent to the window for the whole call (NCCL reads and
    /// writes them until the final wait); its groups name them by index.
    ///
    /// When `body` fails (or panics) after a group was enqueued, the
    /// communicator is aborted (the peers would wait for the rest, and the
    /// abort ends NCCL's use of the buffers) and the error says so; a body
    /// that failed before enqueuing anything leaves the communicator usable
    /// and its error is returned as is. A panic continues after that.
    /// Windows do not nest and cannot open inside a group.
    pub fn window<R, E>(
        &mut self,
        buffers: &mut [&mut CudaSlice<f32>],
        body: impl FnOnce(&mut Window<'_, '_>) -> std::result::Result<R, E>,
    ) -> std::result::Result<R, E>
    where
        E: From<CommError> + std::fmt::Display,
    {
        self.bind("window")?;
        self.core.window_begin()?;
        let seq = self.flight.begin(CallKind::Window, 0, None);
        self.flight_open = Some(seq);
        let result = catch_unwind(AssertUnwindSafe(|| {
            body(&mut Window {
                comm: &mut *self,
                buffers,
            })
        }));
        let completion = StreamCompletion {
            stream: &self.stream,
        };
        let result = match result {
            Ok(r) => r,
            Err(panic) => {
                let _ = self
                    .core
                    .window_finish(&completion, Some("the window body panicked"));
                self.flight_open = None;
                self.flight.finish(seq, false);
                resume_unwind(panic)
            }
        };
        let text = result.as_ref().err().map(|e| e.to_string());
        let end = self.core.window_finish(&completion, text.as_deref());
        let end = end.and_then(|()| match &result {
            Ok(_) => self.check_cuda("window"),
            Err(_) => Ok(()),
        });
        self.flight_open = None;
        self.flight.finish(seq, end.is_ok() && result.is_ok());
        if let (Err(e), true) = (&end, self.core.is_aborted()) {
            self.flight.dump(&e.to_string());
        } else if let (Err(e), true) = (&result, self.core.is_aborted()) {
            self.flight.dump(&e.to_string());
        }
        match (result, end) {
            (Ok(v), Ok(())) => Ok(v),
            (Err(e), Ok(())) => Err(e),
            // The abort's error repeats the body's.
            (_, Err(e)) => Err(e.into()),
        }
    }
}
