//! Opening a device and loading modules through the driver API.
//!
//! cudarc opens `libcuda` lazily and panics when it is missing; everything
//! here checks for the library first so a machine without a GPU driver gets
//! [`KernelError::NoDriver`] instead.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::embedded::require_fatbin;
use crate::error::KernelError;

/// Whether the CUDA driver library can be opened on this machine.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the driver library by its known names and
    // drops the handle; no symbol is called.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// Number of CUDA devices, or [`KernelError::NoDriver`] without a driver.
pub fn device_count() -> Result<usize, KernelError> {
    if !driver_present() {
        return Err(KernelError::NoDriver);
    }
    let n =
        CudaContext::device_count().map_err(|e| KernelError::driver("counting CUDA devices", e))?;
    Ok(usize::try_from(n).unwrap_or(0))
}

/// The primary context of device `ordinal` (cudarc retains it; it is
/// released when the last `Arc` drops).
pub fn open_context(ordinal: usize) -> Result<Arc<CudaContext>, KernelError> {
    let count = device_count()?;
    if ordinal >= count {
        return Err(KernelError::InvalidArgument {
            kernel: "open_context",
            message: format!(
                "device {ordinal} does not exist: this machine has {count} CUDA device(s)"
            ),
        });
    }
    CudaContext::new(ordinal)
        .map_err(|e| KernelError::driver(format!("opening the context of device {ordinal}"), e))
}

/// Load the embedded module `name` (`kernels/cuda/<name>.cu`) into `ctx`.
///
/// The image is copied into the driver, which picks the sm_80 or sm_90 SASS
/// for the device or JITs the compute_90 PTX on newer GPUs. The returned
/// module holds `ctx` alive and is unloaded when its last `Arc` (including
/// every `CudaFunction` taken from it) drops.
///
/// Errors: [`KernelError::NotBuilt`] in a build without nvcc (with how to
/// get kernels), [`KernelError::UnknownModule`] for a name with no `.cu`
/// file, [`KernelError::Driver`] when the driver rejects the image.
pub fn load_module(ctx: &Arc<CudaContext>, name: &str) -> Result<Arc<CudaModule>, KernelError> {
    let image = require_fatbin(name)?;
    ctx.load_module(Ptx::from_binary(image.to_vec()))
        .map_err(|e| {
            KernelError::driver(
                format!(
                "loading kernel module `{name}` ({} byte fatbin: sm_80/sm_90 SASS, compute_90 PTX) \
                 on device {}",
                image.len(),
                ctx.ordinal()
            ),
                e,
            )
        })
}
