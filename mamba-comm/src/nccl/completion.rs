//! The second seam: "has the stream finished the work enqueued so far?",
//! asked without blocking so the watchdog keeps its deadline.

use cudarc::driver::sys::{cuStreamQuery, CUresult};
use cudarc::driver::CudaStream;

/// Non-blocking completion query of the work a collective window enqueued.
pub(crate) trait Completion {
    /// `Ok(true)` when everything enqueued so far has completed, `Ok(false)`
    /// while work is pending, `Err(text)` when the device reported an error.
    fn poll(&self) -> Result<bool, String>;
}

/// Completion of a CUDA stream, through `cuStreamQuery`.
pub(crate) struct StreamCompletion<'a> {
    pub(crate) stream: &'a CudaStream,
}

impl Completion for StreamCompletion<'_> {
    fn poll(&self) -> Result<bool, String> {
        // SAFETY: the stream handle is alive for `'a` (the CudaStream owns
        // it); cuStreamQuery only reads its state.
        match unsafe { cuStreamQuery(self.stream.cu_stream()) } {
            CUresult::CUDA_SUCCESS => Ok(true),
            CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            other => Err(format!("cuStreamQuery reported {other:?}")),
        }
    }
}
