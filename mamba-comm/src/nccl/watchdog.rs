//! The waits of the communicator: poll `ncclCommGetAsyncError` (errors
//! reported by NCCL's background threads) and, for a collective window,
//! the stream, until done, an error, or the deadline.
//!
//! These functions only observe: on failure they return what went wrong
//! (NCCL's own last-error text read while the handle is still live, or the
//! abort another rank posted to the [world abort](crate::world_abort)),
//! and the caller ([`super::core::CommCore`]) aborts. Keeping the abort
//! with the caller is what lets a failure inside an open group wait for the
//! group's close.

use std::time::{Duration, Instant};

use nccl_sys_min::ncclComm_t;

use super::api::NcclApi;
use super::completion::Completion;
use super::result::{nonblocking, NcclError, Progress};
use crate::poll::Backoff;
use crate::world_abort::{AbortWatch, PostedAbort};

/// What a wait waits for.
#[derive(Clone, Copy)]
pub(crate) enum Until<'a> {
    /// NCCL's async state leaves `ncclInProgress` (init, an enqueue or a
    /// group end still in progress, finalize).
    Ready,
    /// The stream has completed everything enqueued so far, while NCCL
    /// reports no error (the collective watchdog).
    Complete(&'a dyn Completion),
}

/// Why a wait ended without success.
#[derive(Debug)]
pub(crate) enum Failure {
    /// This rank saw it (an NCCL error, the stream, the deadline): the
    /// detail for the caller's error.
    Local(String),
    /// Another rank posted its failure to the world abort while this rank
    /// waited.
    Peer(PostedAbort),
}

/// The bounds of one wait and how its timeout reads.
#[derive(Clone, Copy)]
pub(crate) struct Limits<'a> {
    /// The operation, for messages.
    pub(crate) op: &'a str,
    /// When the wait gives up.
    pub(crate) deadline: Instant,
    /// The timeout the deadline came from, for messages.
    pub(crate) timeout: Duration,
    /// What a timeout usually means here.
    pub(crate) hint: &'a str,
}

/// Wait as `until` says until `limits.deadline`. A timeout's detail reads
/// `"{op} did not complete within {timeout:?} ({hint})"`; `hint` says what
/// a timeout usually means here. With a `watch`, an abort another rank
/// posted ends the wait too (checked after each poll: a memory read, the
/// watch's thread does the I/O), as a [`Failure::Peer`].
///
/// # Safety
/// `comm` is live for the whole wait (the caller releases nothing while it
/// runs).
pub(crate) unsafe fn wait(
    api: &dyn NcclApi,
    comm: ncclComm_t,
    until: Until<'_>,
    limits: &Limits<'_>,
    watch: Option<&AbortWatch>,
) -> Result<(), Failure> {
    let Limits {
        op,
        deadline,
        timeout,
        hint,
    } = *limits;
    let mut backoff = Backoff::watchdog();
    loop {
        // SAFETY: `comm` is live (the caller's contract).
        let state = match unsafe { api.async_error(comm) } {
            Ok(rc) => nonblocking(rc),
            Err(e) => {
                return Err(Failure::Local(format!(
                    "ncclCommGetAsyncError failed: {}",
                    api.describe(e)
                )))
            }
        };
        let ready = match state {
            Ok(p) => p == Progress::Done,
            // SAFETY: as above; the text is read before the caller aborts.
            Err(e) => return Err(Failure::Local(unsafe { async_failure(api, comm, e) })),
        };
        let done = match until {
            Until::Ready => ready,
            Until::Complete(stream) => match stream.poll() {
                Ok(done) => done,
                Err(text) => return Err(Failure::Local(format!("the stream failed: {text}"))),
            },
        };
        if done {
            return Ok(());
        }
        if let Some(abort) = watch.and_then(AbortWatch::posted) {
            return Err(Failure::Peer(abort.clone()));
        }
        if backoff.pause(deadline).is_err() {
            return Err(Failure::Local(format!(
                "{op} did not complete within {timeout:?} ({hint})"
            )));
        }
    }
}

/// The detail of an error NCCL reported: the code and NCCL's last-error
/// text.
///
/// # Safety
/// `comm` is live.
pub(crate) unsafe fn async_failure(api: &dyn NcclApi, comm: ncclComm_t, e: NcclError) -> String {
    // SAFETY: the caller's contract.
    let text = unsafe { api.last_error(comm) };
    format!("NCCL reported {}: {}", api.describe(e), nonempty(&text))
}

/// NCCL's text, or a placeholder when it has none.
pub(crate) fn nonempty(text: &str) -> &str {
    if text.trim().is_empty() {
        "(no message)"
    } else {
        text
    }
}
