//! The CUDA side of the communicator: finding and opening its device, and
//! the conversions between cudarc's handles and NCCL's.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError};
use nccl_sys_min::{cudaStream_t, CUstream_st};

use crate::{CommError, Result};

/// Number of CUDA devices this process can see, or an error when the
/// NVIDIA driver library is missing (checked first: cudarc panics on a
/// missing libcuda, this returns an error instead). GPU tests use it to
/// decide whether to run or skip.
pub fn visible_devices() -> Result<usize> {
    // SAFETY: only tries to dlopen libcuda under its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CommError::config(
            "libcuda (the NVIDIA driver library) was not found; an NCCL communicator needs an \
             NVIDIA GPU and its driver (use the host transport on CPU-only machines)",
        ));
    }
    let count = cudarc::driver::CudaContext::device_count().map_err(cuda_error("init"))?;
    Ok(usize::try_from(count).unwrap_or(0))
}

/// Map a cudarc error of `op` to a transport error.
pub(crate) fn cuda_error(op: &'static str) -> impl Fn(DriverError) -> CommError {
    move |e| CommError::transport(op, format!("CUDA reported {e}"))
}

/// The stream as NCCL's `cudaStream_t` (the same driver object).
pub(crate) fn raw_stream(stream: &CudaStream) -> cudaStream_t {
    stream.cu_stream() as *mut CUstream_st
}

/// A device address as the pointer NCCL takes (never dereferenced on the
/// host).
pub(crate) fn device_ptr(p: u64) -> *mut c_void {
    p as usize as *mut c_void
}

/// The CUDA context and a fresh stream on `device`, or an error saying why
/// not (no driver, no such device) instead of cudarc's panic on a missing
/// libcuda.
pub(crate) fn open_device(device: usize) -> Result<(Arc<CudaContext>, Arc<CudaStream>)> {
    let visible = visible_devices()?;
    if device >= visible {
        return Err(CommError::config(format!(
            "CUDA device {device} does not exist: {visible} device(s) visible (check \
             CUDA_VISIBLE_DEVICES and the rank-to-device mapping)"
        )));
    }
    let ctx = CudaContext::new(device).map_err(cuda_error("init"))?;
    let stream = ctx.new_stream().map_err(cuda_error("init"))?;
    Ok((ctx, stream))
}
