//! All CUDA kernels of the project, embedded as fatbins and loaded through
//! the driver API (cudarc).
//!
//! # Build
//!
//! `build.rs` compiles every `kernels/cuda/*.cu` with nvcc (found through
//! `NVCC`, `CUDA_HOME`/`CUDA_PATH`, `PATH`, then `/opt/nvcc`, and driven
//! through `cc`) into a fatbin with SASS for sm_80 and sm_90 and PTX for
//! compute_90, with IEEE division/square root and `--fmad` per file (off
//! where a CPU twin needs the same bits, on where the contract is a
//! tolerance: the table is in `kernels/README.md`), and embeds
//! it as module `<stem>`. A new `.cu` file needs no build change: it appears
//! in [`embedded()`] and loads with [`load_module`]`(ctx, "<stem>")`.
//!
//! Without nvcc the crate still builds: [`available()`] is false, the table
//! is empty, and every GPU entry point returns [`KernelError::NotBuilt`],
//! whose message says how to get kernels (`scripts/install-nvcc.sh`, then
//! `NVCC=...`). With `MAMBA_REQUIRE_KERNELS=1` (CI) a missing nvcc fails
//! the build instead.
//!
//! # Use
//!
//! ```no_run
//! # fn main() -> Result<(), kernels::KernelError> {
//! let ctx = kernels::open_context(0)?;
//! let fold = kernels::FoldKernel::load(&ctx)?;
//! let stream = ctx.default_stream();
//! let a = stream.clone_htod(&[1.0f32, 2.0, 3.0]).unwrap();
//! let b = stream.clone_htod(&[10.0f32, 20.0, 30.0]).unwrap();
//! let mut out = stream.alloc_zeros::<f32>(3).unwrap();
//! // out = (a + b) * 0.5, one ascending chain per element.
//! fold.det_chain(&stream, &mut out.as_view_mut(), None, &[a.as_view(), b.as_view()], 3, Some(0.5))?;
//! # Ok(()) }
//! ```
//!
//! Model kernels add their own launchers (in `src/mamba/`) on top of
//! [`load_module`] and [`LaunchShape`].
//!
//! # Checking kernels without a GPU
//!
//! `emu/cuda_emu.h` emulates the CUDA subset the scan kernels use (blocks as
//! host threads with real barriers and warp shuffles, NaN-filled shared
//! memory, cp.async that lands as late as allowed); a unit test compiles
//! `cuda/mamba_scan.cu` against it with the host C++ compiler and checks it
//! against a sequential f64 scan (`emu/scan_check.cpp`), so an index or
//! barrier bug fails on any machine. It checks logic, not bits or speed.

pub mod device;
pub mod embedded;
pub mod error;
pub mod fold;
pub mod launch;
pub mod mamba;
pub mod peer;

// The build script's nvcc search, compiled here so it has unit tests.
#[cfg(test)]
#[path = "../build/nvcc.rs"]
mod nvcc_discovery;
#[cfg(test)]
mod nvcc_discovery_tests;

pub use device::{device_count, driver_present, load_module, open_context};
pub use embedded::{
    available, embedded, fatbin, nvcc_release, source_names, EmbeddedKernel, FATBIN_MAGIC,
};
pub use error::{KernelError, HOW_TO_GET_KERNELS};
pub use fold::{FoldKernel, MAX_CHAIN_ADDENDS};
pub use launch::LaunchShape;
pub use peer::{PeerKernels, PeerStatus, ABORT_FLAG, MAX_PEERS};
