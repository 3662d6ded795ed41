//! Typed launchers for the Mamba model kernels (`kernels/cuda/mamba_*.cu`):
//! Mamba-1's, which Mamba-2 also runs, and Mamba-2's per-head moves
//! ([`heads`]).
//!
//! [`MambaKernels::load`] loads the three modules of one context
//! (`mamba_ops`, `mamba_scan`, `mamba_optim`); its methods enqueue kernels on
//! a caller's stream (asynchronously, in stream order). [`DecodeKernels`]
//! adds the recurrent decode step's module (`mamba_decode`) beside them. Every launcher checks
//! on the host that each index its kernel touches lies inside the buffers it
//! was given, and refuses with [`KernelError::InvalidArgument`] otherwise.
//!
//! Conventions:
//! - activations are row-major `[rows, width]` with `rows = batch *
//!   seq_len` (row `b * seq_len + t`); a column block of a wider matrix is a
//!   view starting at its first column plus a leading dimension `ld`;
//! - parameters have the Hugging Face shapes of `mamba_train::params`.
//!
//! Determinism: no kernel here uses atomics, and every reduction has a fixed
//! association that depends only on the problem shape (never on the device's
//! multiprocessor count or on scheduling), so the same inputs give the same
//! bits on every run of the same build on the same GPU model. The optimizer
//! kernels go further and reproduce the CPU optimizer bit for bit
//! ([`optim`]).

pub mod cast;
mod check;
#[cfg(test)]
mod colsum_emu_tests;
pub mod conv;
#[cfg(test)]
mod conv_emu_tests;
pub mod decode;
#[cfg(test)]
mod gated_norm_emu_tests;
pub mod heads;
mod launcher;
pub mod ops;
pub mod optim;
pub mod reductions;
pub mod scan;
#[cfg(test)]
mod scan_emu_tests;
mod scan_shape;
pub mod ssd;
#[cfg(test)]
mod ssd_emu_tests;
mod ssd_products;
mod ssd_shape;
pub mod store;
pub mod tokens;

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};

use crate::device::load_module;
use crate::error::KernelError;
use ssd_shape::{STAGED_SMEM_BYTES, STATE_SCAN_SMEM_BYTES};

pub use cast::{bf16_to_f32, f32_to_bf16_rne};
pub use conv::MAX_CONV_WIDTH;
pub use decode::{DecodeKernels, ScanStepInputs};
pub use optim::{check_decay_ranges, AdamWStep, NORM_CHUNK};
pub use reductions::{ColSum, LogitGrad, LossScale};
pub use scan::{
    ScanBackward, ScanForward, ScanInputs, ScanShape, MAX_D_STATE, SCAN_CHUNK, SEGMENT_CHUNKS,
};
pub use ssd::{
    SsdBackward, SsdForward, SsdInputs, SsdProducts, SsdScratch, SsdScratchLens, SsdShape,
    SsdStates, SSD_CHUNK,
};
pub use store::{Store, Stored};
pub use tokens::{DeviceTokenCsr, TokenCsr};

/// Rows summed per block by the two-stage column reductions
/// (`mamba_common.cuh`'s `kColSlab`): a column sum over `rows` rows writes
/// `ceil(rows / COL_SLAB)` partials.
pub const COL_SLAB: usize = 256;

/// The loaded Mamba kernels of one context.
///
/// Holds the modules (and through them the context) alive; cheap to clone,
/// and usable from any thread (launches go through the caller's stream,
/// which must belong to the same context).
#[derive(Debug, Clone)]
pub struct MambaKernels {
    ctx: Arc<CudaContext>,
    modules: [Arc<CudaModule>; 5],
    f: Functions,
}

/// Every kernel (module index into [`MambaKernels::MODULES`], symbol), in
/// the order of [`Functions`]' fields.
const SYMBOLS: [(usize, &str); 46] = [
    (0, "mamba_embed_fwd"),
    (0, "mamba_embed_bwd"),
    (0, "mamba_rmsnorm_fwd"),
    (0, "mamba_rmsnorm_bwd"),
    (0, "mamba_conv_fwd"),
    (0, "mamba_conv_bwd"),
    (0, "mamba_dt_softplus"),
    (0, "mamba_gate_bwd"),
    (0, "mamba_gated_norm_bwd"),
    (0, "mamba_colsum_partial"),
    (0, "mamba_reduce_partials"),
    (0, "mamba_ce_fwd_bwd"),
    (0, "mamba_loss_mean"),
    (0, "mamba_cast_bf16"),
    (0, "mamba_group_bcast"),
    (0, "mamba_group_sum"),
    (1, "mamba_scan_fwd"),
    (1, "mamba_scan_bwd"),
    (1, "mamba_scan_dbc_reduce"),
    (1, "mamba_scan_fwd_seg"),
    (1, "mamba_scan_bwd_seg"),
    (1, "mamba_scan_seg_link"),
    (2, "mamba_adamw"),
    (2, "mamba_sumsq_chunks"),
    (3, "mamba_ssd_cumsum"),
    (3, "mamba_ssd_chunk_state"),
    (3, "mamba_ssd_state_pass"),
    (3, "mamba_ssd_chunk_out"),
    (3, "mamba_ssd_bwd_qq"),
    (3, "mamba_ssd_bwd_dx"),
    (3, "mamba_ssd_bwd_psum"),
    (3, "mamba_ssd_bwd_dbc"),
    (3, "mamba_ssd_bwd_dt"),
    (3, "mamba_ssd_dalog"),
    (4, "mamba_ssd_state_scan_tc"),
    (4, "mamba_ssd_chunk_out_tc"),
    (4, "mamba_ssd_bwd_qq_tc"),
    (4, "mamba_ssd_bwd_dx_tc"),
    (4, "mamba_ssd_bwd_dbc_tc"),
    (4, "mamba_ssd_cb_tc"),
    (4, "mamba_ssd_state_scan_tc_h"),
    (4, "mamba_ssd_chunk_out_tc_h"),
    (4, "mamba_ssd_bwd_dx_tc_h"),
    (4, "mamba_ssd_bwd_dbc_tc_h"),
    (4, "mamba_ssd_cb_tc_h"),
    (4, "mamba_ssd_bwd_qq_tc_h"),
];

#[derive(Debug, Clone)]
struct Functions {
    embed_fwd: CudaFunction,
    embed_bwd: CudaFunction,
    rmsnorm_fwd: CudaFunction,
    rmsnorm_bwd: CudaFunction,
    conv_fwd: CudaFunction,
    conv_bwd: CudaFunction,
    dt_softplus: CudaFunction,
    gate_bwd: CudaFunction,
    gated_norm_bwd: CudaFunction,
    colsum_partial: CudaFunction,
    reduce_partials: CudaFunction,
    ce_fwd_bwd: CudaFunction,
    loss_mean: CudaFunction,
    cast_bf16: CudaFunction,
    group_bcast: CudaFunction,
    group_sum: CudaFunction,
    scan_fwd: CudaFunction,
    scan_bwd: CudaFunction,
    scan_dbc_reduce: CudaFunction,
    scan_fwd_seg: CudaFunction,
    scan_bwd_seg: CudaFunction,
    scan_seg_link: CudaFunction,
    adamw: CudaFunction,
    sumsq_chunks: CudaFunction,
    ssd_cumsum: CudaFunction,
    ssd_chunk_state: CudaFunction,
    ssd_state_pass: CudaFunction,
    ssd_chunk_out: CudaFunction,
    ssd_bwd_qq: CudaFunction,
    ssd_bwd_dx: CudaFunction,
    ssd_bwd_psum: CudaFunction,
    ssd_bwd_dbc: CudaFunction,
    ssd_bwd_dt: CudaFunction,
    ssd_dalog: CudaFunction,
    ssd_state_scan_tc: CudaFunction,
    ssd_chunk_out_tc: CudaFunction,
    ssd_bwd_qq_tc: CudaFunction,
    ssd_bwd_dx_tc: CudaFunction,
    ssd_bwd_dbc_tc: CudaFunction,
    ssd_cb_tc: CudaFunction,
    ssd_state_scan_tc_h: CudaFunction,
    ssd_chunk_out_tc_h: CudaFunction,
    ssd_bwd_dx_tc_h: CudaFunction,
    ssd_bwd_dbc_tc_h: CudaFunction,
    ssd_cb_tc_h: CudaFunction,
    ssd_bwd_qq_tc_h: CudaFunction,
}

impl MambaKernels {
    /// Module names (`kernels/cuda/<name>.cu`).
    pub const MODULES: [&'static str; 5] = [
        "mamba_ops",
        "mamba_scan",
        "mamba_optim",
        "mamba_ssd",
        "mamba_ssd_tc",
    ];

    /// Load the Mamba modules into `ctx` and look up every kernel.
    ///
    /// Errors: [`KernelError::NotBuilt`] in a build without nvcc (the message
    /// says how to get kernels), [`KernelError::Driver`] naming the module or
    /// symbol the driver refused.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<MambaKernels, KernelError> {
        let modules = [
            load_module(ctx, Self::MODULES[0])?,
            load_module(ctx, Self::MODULES[1])?,
            load_module(ctx, Self::MODULES[2])?,
            load_module(ctx, Self::MODULES[3])?,
            load_module(ctx, Self::MODULES[4])?,
        ];
        let mut found = Vec::with_capacity(SYMBOLS.len());
        for &(m, symbol) in SYMBOLS.iter() {
            found.push(modules[m].load_function(symbol).map_err(|e| {
                KernelError::driver(
                    format!("looking up kernel {symbol} in module {}", Self::MODULES[m]),
                    e,
                )
            })?);
        }
        let mut it = found.into_iter();
        let mut next = || {
            it.next().ok_or_else(|| {
                KernelError::invalid("MambaKernels::load", "fewer kernels than Functions fields")
            })
        };
        // Field order = SYMBOLS order.
        let f = Functions {
            embed_fwd: next()?,
            embed_bwd: next()?,
            rmsnorm_fwd: next()?,
            rmsnorm_bwd: next()?,
            conv_fwd: next()?,
            conv_bwd: next()?,
            dt_softplus: next()?,
            gate_bwd: next()?,
            gated_norm_bwd: next()?,
            colsum_partial: next()?,
            reduce_partials: next()?,
            ce_fwd_bwd: next()?,
            loss_mean: next()?,
            cast_bf16: next()?,
            group_bcast: next()?,
            group_sum: next()?,
            scan_fwd: next()?,
            scan_bwd: next()?,
            scan_dbc_reduce: next()?,
            scan_fwd_seg: next()?,
            scan_bwd_seg: next()?,
            scan_seg_link: next()?,
            adamw: next()?,
            sumsq_chunks: next()?,
            ssd_cumsum: next()?,
            ssd_chunk_state: next()?,
            ssd_state_pass: next()?,
            ssd_chunk_out: next()?,
            ssd_bwd_qq: next()?,
            ssd_bwd_dx: next()?,
            ssd_bwd_psum: next()?,
            ssd_bwd_dbc: next()?,
            ssd_bwd_dt: next()?,
            ssd_dalog: next()?,
            ssd_state_scan_tc: next()?,
            ssd_chunk_out_tc: next()?,
            ssd_bwd_qq_tc: next()?,
            ssd_bwd_dx_tc: next()?,
            ssd_bwd_dbc_tc: next()?,
            ssd_cb_tc: next()?,
            ssd_state_scan_tc_h: next()?,
            ssd_chunk_out_tc_h: next()?,
            ssd_bwd_dx_tc_h: next()?,
            ssd_bwd_dbc_tc_h: next()?,
            ssd_cb_tc_h: next()?,
            ssd_bwd_qq_tc_h: next()?,
        };
        // The scan kernels and the SSD's tensor-core state scan, chunk
        // outputs and d x take their staging buffers as dynamic shared
        // memory, above the 48 KiB a launch gets
        // without opting in.
        let (fwd_smem, bwd_smem) = ScanShape::max_smem_bytes();
        for (func, bytes, symbol) in [
            (&f.scan_fwd, fwd_smem, "mamba_scan_fwd"),
            (&f.scan_bwd, bwd_smem, "mamba_scan_bwd"),
            (&f.scan_fwd_seg, fwd_smem, "mamba_scan_fwd_seg"),
            (&f.scan_bwd_seg, fwd_smem, "mamba_scan_bwd_seg"),
            (
                &f.ssd_state_scan_tc,
                STATE_SCAN_SMEM_BYTES,
                "mamba_ssd_state_scan_tc",
            ),
            (
                &f.ssd_chunk_out_tc,
                STAGED_SMEM_BYTES,
                "mamba_ssd_chunk_out_tc",
            ),
            (&f.ssd_bwd_dx_tc, STAGED_SMEM_BYTES, "mamba_ssd_bwd_dx_tc"),
            (
                &f.ssd_state_scan_tc_h,
                STATE_SCAN_SMEM_BYTES,
                "mamba_ssd_state_scan_tc_h",
            ),
            (
                &f.ssd_chunk_out_tc_h,
                STAGED_SMEM_BYTES,
                "mamba_ssd_chunk_out_tc_h",
            ),
            (
                &f.ssd_bwd_dx_tc_h,
                STAGED_SMEM_BYTES,
                "mamba_ssd_bwd_dx_tc_h",
            ),
        ] {
            func.set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| {
                KernelError::driver(
                    format!("allowing {symbol} {bytes} bytes of dynamic shared memory"),
                    e,
                )
            })?;
        }
        Ok(MambaKernels {
            ctx: ctx.clone(),
            modules,
            f,
        })
    }

    /// The context the modules live in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The loaded modules, in [`Self::MODULES`] order.
    pub fn modules(&self) -> &[Arc<CudaModule>; 5] {
        &self.modules
    }

    fn check_stream(&self, kernel: &'static str, stream: &CudaStream) -> Result<(), KernelError> {
        if stream.context().cu_ctx() == self.ctx.cu_ctx() {
            Ok(())
        } else {
            Err(KernelError::invalid(
                kernel,
                format!(
                    "stream belongs to the context of device {}, but the Mamba kernels were \
                     loaded into device {}'s; load MambaKernels per context",
                    stream.context().ordinal(),
                    self.ctx.ordinal()
                ),
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_kernel_symbol_is_in_its_embedded_module() {
        // Catches a renamed or missing `extern "C"` kernel without a GPU.
        for &(m, symbol) in SYMBOLS.iter() {
            let module = MambaKernels::MODULES[m];
            assert!(
                crate::source_names().contains(&module),
                "kernels/cuda/{module}.cu is missing (build saw {:?})",
                crate::source_names()
            );
            let Some(image) = crate::fatbin(module) else {
                assert!(
                    !crate::available(),
                    "built with nvcc but {module} is not embedded"
                );
                continue;
            };
            let found = image.windows(symbol.len()).any(|w| w == symbol.as_bytes());
            assert!(found, "the {module} fatbin lacks the kernel {symbol}");
        }
        // Negative control: a name that is not a kernel is not found.
        if let Some(image) = crate::fatbin(MambaKernels::MODULES[0]) {
            let bogus = b"mamba_no_such_kernel";
            assert!(!image.windows(bogus.len()).any(|w| w == bogus));
        }
    }

    #[test]
    fn symbols_are_distinct() {
        let mut names: Vec<&str> = SYMBOLS.iter().map(|s| s.1).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), SYMBOLS.len());
    }
}
