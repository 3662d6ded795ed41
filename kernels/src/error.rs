//! The crate's one error type.

use cudarc::driver::DriverError;

/// How to get kernels into a build; repeated by every error that stems from
/// a build without nvcc.
pub const HOW_TO_GET_KERNELS: &str = "run scripts/install-nvcc.sh (installs the pinned \
nvcc 13.0 into /opt/nvcc and prints its path), then rebuild with NVCC=<that path> (or with \
CUDA_HOME set, or nvcc on PATH); set MAMBA_REQUIRE_KERNELS=1 to make a build without nvcc \
fail instead of producing this error";

/// Everything that can go wrong between a kernel name and a finished launch.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// This build embedded no kernels: nvcc was not found when it was built.
    #[error("CUDA kernel module `{module}` is not in this build: {reason}. To get kernels: {how}")]
    NotBuilt {
        module: String,
        /// What the build script searched (from the build, verbatim).
        reason: &'static str,
        /// [`HOW_TO_GET_KERNELS`].
        how: &'static str,
    },

    /// The build has kernels, but no `kernels/cuda/<module>.cu`.
    #[error(
        "no CUDA kernel module named `{module}`: expected one of {available:?} \
         (one per kernels/cuda/<name>.cu)"
    )]
    UnknownModule {
        module: String,
        available: Vec<&'static str>,
    },

    /// The CUDA driver library could not be opened (no GPU driver here).
    #[error(
        "the CUDA driver library (libcuda.so.1) could not be loaded: install the NVIDIA driver \
         or add its directory (e.g. /usr/local/nvidia/lib64) to LD_LIBRARY_PATH"
    )]
    NoDriver,

    /// A driver call failed; `what` says which step.
    #[error("CUDA driver error while {what}: {source}")]
    Driver {
        what: String,
        #[source]
        source: DriverError,
    },

    /// A launch was refused before reaching the GPU because its arguments
    /// would read or write outside the buffers, or make no sense.
    #[error("{kernel}: {message}")]
    InvalidArgument {
        kernel: &'static str,
        message: String,
    },
}

impl KernelError {
    /// Wrap a driver error with the step that produced it.
    pub fn driver(what: impl Into<String>, source: DriverError) -> Self {
        KernelError::Driver {
            what: what.into(),
            source,
        }
    }

    pub(crate) fn invalid(kernel: &'static str, message: impl Into<String>) -> Self {
        KernelError::InvalidArgument {
            kernel,
            message: message.into(),
        }
    }
}
