//! The one place where NCCL return codes become `Result`s (the pattern of
//! cudarc's `result` layer): the raw table ([`super::api::NcclApi`]) hands
//! back `ncclResult_t` as NCCL does, and every caller classifies it here,
//! so "is `ncclInProgress` an error?" is answered once per kind of call,
//! not by hand at each call site.
//!
//! - [`nonblocking`]: a call on a nonblocking communicator (init, enqueue,
//!   group end, finalize, destroy) or the state `ncclCommGetAsyncError`
//!   reports: `ncclInProgress` means "still working", not failure.
//! - [`completed`]: a call that has no background work to report
//!   (`ncclGroupStart`, `ncclCommAbort`, the queries and
//!   `ncclCommGetAsyncError` itself): only `ncclSuccess` is success.

use nccl_sys_min::{ncclResult_t, result_name};

/// An NCCL return code that is a failure for the call that returned it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct NcclError(pub(crate) ncclResult_t);

impl NcclError {
    /// The code's name (`ncclSystemError`), or its number when NCCL added
    /// codes this crate does not know.
    pub(crate) fn name(self) -> String {
        result_name(self.0)
            .map(str::to_string)
            .unwrap_or_else(|| format!("result {}", (self.0).0))
    }
}

/// How a call that did not fail left its work.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Progress {
    /// `ncclSuccess`: done.
    Done,
    /// `ncclInProgress`: accepted, still running in NCCL's background
    /// threads; poll `ncclCommGetAsyncError` for the outcome.
    InProgress,
}

/// Classify the code of a nonblocking call (see the module docs).
pub(crate) fn nonblocking(rc: ncclResult_t) -> Result<Progress, NcclError> {
    match rc {
        ncclResult_t::ncclSuccess => Ok(Progress::Done),
        ncclResult_t::ncclInProgress => Ok(Progress::InProgress),
        rc => Err(NcclError(rc)),
    }
}

/// Classify the code of a call that must have finished: anything but
/// `ncclSuccess`, `ncclInProgress` included, is an error.
pub(crate) fn completed(rc: ncclResult_t) -> Result<(), NcclError> {
    match rc {
        ncclResult_t::ncclSuccess => Ok(()),
        rc => Err(NcclError(rc)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_progress_is_success_only_for_nonblocking_calls() {
        let ok = ncclResult_t::ncclSuccess;
        let busy = ncclResult_t::ncclInProgress;
        let bad = ncclResult_t::ncclSystemError;
        assert_eq!(nonblocking(ok), Ok(Progress::Done));
        assert_eq!(nonblocking(busy), Ok(Progress::InProgress));
        assert_eq!(nonblocking(bad), Err(NcclError(bad)));
        assert_eq!(completed(ok), Ok(()));
        assert_eq!(completed(busy), Err(NcclError(busy)));
        assert_eq!(completed(bad), Err(NcclError(bad)));
        assert_eq!(NcclError(bad).name(), "ncclSystemError");
    }
}
