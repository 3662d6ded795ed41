//! The two sets of kernels that compute the SSD's chunk products
//! ([`SsdProducts`]): SIMT f32 (`mamba_ssd.cu`) and tf32 tensor cores
//! (`mamba_ssd_tc.cu`), and the one kernel only the tensor-core set has
//! (each group's `C B^T`, launched by [`MambaKernels::ssd_group_cb`]). The
//! launches that use them are in `ssd.rs`.

use cudarc::driver::{CudaFunction, CudaStream, CudaViewMut};

use super::launcher::{Arg, Grid, Launch};
#[cfg(doc)]
use super::ssd_shape::STATE_SCAN_SMEM_BYTES;
use super::ssd_shape::{SsdInputs, SsdShape, STAGED_SMEM_BYTES, THREADS};
use super::MambaKernels;
use crate::error::KernelError;

/// Which kernels compute the SSD's chunk products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SsdProducts {
    /// f32 fused multiply-adds on the SIMT units (`mamba_ssd.cu`): within
    /// 5e-5 of the f64 program, what f32 runs promise.
    F32,
    /// Tensor cores with operands rounded to tf32 and f32 accumulators
    /// (`mamba_ssd_tc.cu`): about 3e-4 relative, inside the tf32 and bf16
    /// runs' tolerances; its kernels take 0.48x (bwd_dx) to 0.64x
    /// (chunk_out) of the SIMT ones' time at the 130m shape, and its chunk
    /// states are made and passed by one kernel (docs/PERFORMANCE.md).
    Tf32,
}

/// The kernels of one set of products ([`SsdProducts`]), with their names
/// for errors. Each `_tc` kernel has its SIMT twin's signature, argument
/// for argument, and the same extents of reads and writes, so the SAFETY
/// arguments of `ssd.rs`, which name the SIMT kernels, hold for either set; the
/// tensor-core chunk_out and bwd_qq take one more argument last, each
/// group's `C B^T` (`[nbc][G][Q][Q]`), which `cb` (tensor cores only)
/// makes into `chunk_psum` first (the backward's psum overwrites it after
/// bwd_qq, its last reader). The `_h` kernels of the bf16 kept tensors
/// have their f32 twin's signature with `unsigned short*` for `xbc`, `dy`
/// and the states (the same elements, half the bytes).
pub(super) struct Products<'a> {
    pub(super) cb: Option<(&'static str, &'a CudaFunction)>,
    pub(super) states: ChunkStates<'a>,
    pub(super) chunk_out: (&'static str, &'a CudaFunction),
    /// The dynamic shared memory of chunk_out and bwd_dx, in bytes.
    pub(super) staged_smem: u32,
    pub(super) bwd_qq: (&'static str, &'a CudaFunction),
    pub(super) bwd_dx: (&'static str, &'a CudaFunction),
    pub(super) bwd_dbc: (&'static str, &'a CudaFunction),
}

/// How a set makes the entry states from the chunk states.
pub(super) enum ChunkStates<'a> {
    /// The chunk states into the output (`mamba_ssd_chunk_state`, grid
    /// `(nbc, H, tiles)`), then the shared `mamba_ssd_state_pass` over
    /// them in place.
    TwoPass((&'static str, &'a CudaFunction)),
    /// One kernel with chunk_state's arguments that makes each chunk's state
    /// and passes it in registers (`mamba_ssd_state_scan_tc`: grid `(B, H,
    /// tiles)`, [`STATE_SCAN_SMEM_BYTES`] of dynamic shared memory), writing
    /// only the entry states.
    Scan((&'static str, &'a CudaFunction)),
}

impl MambaKernels {
    /// The kernels of `which`, for the kept tensors (x, B, C and the
    /// states) in bf16 when `bf16_kept` (the tensor-core set's `_h`
    /// kernels, which read and store them so; the SIMT set keeps them in
    /// f32 only, an error naming the kernel `kernel` otherwise).
    pub(super) fn products(
        &self,
        kernel: &'static str,
        which: SsdProducts,
        bf16_kept: bool,
    ) -> Result<Products<'_>, KernelError> {
        let f = &self.f;
        Ok(match (which, bf16_kept) {
            (SsdProducts::F32, true) => {
                return Err(KernelError::invalid(
                    kernel,
                    "the SIMT f32 products keep the SSD's inputs and states in f32; bf16 ones \
                     need the tensor-core products (SsdProducts::Tf32)",
                ))
            }
            (SsdProducts::F32, false) => Products {
                cb: None,
                states: ChunkStates::TwoPass(("mamba_ssd_chunk_state", &f.ssd_chunk_state)),
                chunk_out: ("mamba_ssd_chunk_out", &f.ssd_chunk_out),
                staged_smem: 0,
                bwd_qq: ("mamba_ssd_bwd_qq", &f.ssd_bwd_qq),
                bwd_dx: ("mamba_ssd_bwd_dx", &f.ssd_bwd_dx),
                bwd_dbc: ("mamba_ssd_bwd_dbc", &f.ssd_bwd_dbc),
            },
            (SsdProducts::Tf32, false) => Products {
                cb: Some(("mamba_ssd_cb_tc", &f.ssd_cb_tc)),
                states: ChunkStates::Scan(("mamba_ssd_state_scan_tc", &f.ssd_state_scan_tc)),
                chunk_out: ("mamba_ssd_chunk_out_tc", &f.ssd_chunk_out_tc),
                staged_smem: STAGED_SMEM_BYTES as u32,
                bwd_qq: ("mamba_ssd_bwd_qq_tc", &f.ssd_bwd_qq_tc),
                bwd_dx: ("mamba_ssd_bwd_dx_tc", &f.ssd_bwd_dx_tc),
                bwd_dbc: ("mamba_ssd_bwd_dbc_tc", &f.ssd_bwd_dbc_tc),
            },
            (SsdProducts::Tf32, true) => Products {
                cb: Some(("mamba_ssd_cb_tc_h", &f.ssd_cb_tc_h)),
                states: ChunkStates::Scan(("mamba_ssd_state_scan_tc_h", &f.ssd_state_scan_tc_h)),
                chunk_out: ("mamba_ssd_chunk_out_tc_h", &f.ssd_chunk_out_tc_h),
                staged_smem: STAGED_SMEM_BYTES as u32,
                bwd_qq: ("mamba_ssd_bwd_qq_tc_h", &f.ssd_bwd_qq_tc_h),
                bwd_dx: ("mamba_ssd_bwd_dx_tc_h", &f.ssd_bwd_dx_tc_h),
                bwd_dbc: ("mamba_ssd_bwd_dbc_tc_h", &f.ssd_bwd_dbc_tc_h),
            },
        })
    }

    /// Each group's `C B^T` into `out` (`[nbc][G][Q][Q]`) when the products
    /// have a `cb` kernel (tensor cores); nothing otherwise.
    ///
    /// # Safety
    /// `shape` and `inp` must have passed their checks, and `out` must hold
    /// [`SsdShape::group_matrix_len`] elements when `products.cb` is set.
    pub(super) unsafe fn ssd_group_cb(
        &self,
        stream: &CudaStream,
        products: &Products<'_>,
        shape: &SsdShape,
        inp: &SsdInputs<'_>,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<(), KernelError> {
        let Some((kernel, func)) = products.cb else {
            return Ok(());
        };
        let mut args = [
            inp.xbc.kept_arg(),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("b_off", shape.b_off()),
            Arg::Int("c_off", shape.c_off()),
            Arg::Out(out),
            Arg::Int("seq_len", shape.seq_len),
            Arg::Int("d_state", shape.d_state),
            Arg::Int("chunks", shape.chunks()),
        ];
        let launch = Launch {
            kernel,
            func,
            grid: Grid::Dims(shape.chunk_blocks(), shape.groups, 1),
            block: THREADS,
        };
        // SAFETY: matches mamba_ssd_cb_tc(const float* xbc, long long ldu,
        // int b_off, int c_off, float* cb, int T, int N, int nc) (xbc
        // `const unsigned short*` in the _h twin, which products() picks
        // exactly when xbc is kept in bf16); block (bc,
        // g) reads its chunk's rows of xbc (B and C columns of group g, <
        // conv_channels) and writes cb[bc][g][Q][Q], inside the lengths of
        // this function's contract (G is the grid's y extent).
        unsafe { self.launch(stream, launch, &mut args) }
    }
}
