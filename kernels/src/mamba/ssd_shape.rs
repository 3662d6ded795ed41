//! The SSD scan's extents ([`SsdShape`]), the buffers one call takes
//! (inputs, scratch, outputs) and the checks of their lengths that the
//! launches in `ssd.rs` rest on; the launch geometry's constants mirror
//! `mamba_ssd.cu`'s.
//!
//! Over 450 lines with its unit tests: the one contract of a call's
//! buffers (their types, lengths and kept types), whose checks the tests
//! below pin beside them.

use cudarc::driver::{CudaView, CudaViewMut, LaunchArgs};

use super::check;
use super::launcher::{ReadArg, WriteArg};
use super::{Store, Stored};
use crate::error::KernelError;

/// Tokens per chunk of the SSD kernels (`kQ` in `mamba_ssd.cu`).
pub const SSD_CHUNK: usize = 64;
/// Threads of the per-chunk blocks (`kThreads`).
pub(super) const THREADS: u32 = 256;
/// The chunk states' tile (chunk_state's `kSp`, `kSn`; the state scan's
/// 64 x 64): channels and states.
pub(super) const STATE_TILE_P: usize = 64;
pub(super) const STATE_TILE_N: usize = 64;
/// Dynamic shared memory of `mamba_ssd_state_scan_tc`
/// (`kStateScanSmemFloats` floats in `ssd_tc_tiles.cuh`): two buffers of
/// its X and Y tiles, `SSD_CHUNK` steps of `SSD_CHUNK + 8` floats each.
pub(super) const STATE_SCAN_SMEM_BYTES: usize = 4 * SSD_CHUNK * (SSD_CHUNK + 8) * 4;
/// Dynamic shared memory of `mamba_ssd_chunk_out_tc` and
/// `mamba_ssd_bwd_dx_tc` (`kStagedSmemFloats` floats): a step-major tile
/// (as one of the state scan's) and two buffers of a pair of state tiles of
/// `SSD_CHUNK` rows of `SSD_CHUNK + 4` floats.
pub(super) const STAGED_SMEM_BYTES: usize =
    (SSD_CHUNK * (SSD_CHUNK + 8) + 4 * SSD_CHUNK * (SSD_CHUNK + 4)) * 4;
/// States per block of the dB / dC kernel (`kDn`).
const DBC_TILE_N: usize = 64;

/// The extents of one SSD scan call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsdShape {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Heads (`d_inner / head_dim`).
    pub heads: usize,
    /// Channels per head (`head_dim`).
    pub head_dim: usize,
    /// State size per group (`d_state`).
    pub d_state: usize,
    /// Groups of heads sharing B and C (`n_groups`; divides `heads`).
    pub groups: usize,
}

impl SsdShape {
    /// Rows of the activations (`batch * seq_len`).
    pub fn rows(&self) -> usize {
        self.batch * self.seq_len
    }

    /// Chunks per sequence.
    pub fn chunks(&self) -> usize {
        self.seq_len.div_ceil(SSD_CHUNK)
    }

    /// Chunks of the whole batch.
    pub(super) fn chunk_blocks(&self) -> usize {
        self.batch * self.chunks()
    }

    /// `d_inner = heads * head_dim`.
    pub fn inner(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Columns of the conv output the scan reads: x, then B, then C.
    pub fn conv_channels(&self) -> usize {
        self.inner() + 2 * self.groups * self.d_state
    }

    /// First column of B (of group 0) in a conv output row.
    pub(super) fn b_off(&self) -> usize {
        self.inner()
    }

    /// First column of C (of group 0) in a conv output row.
    pub(super) fn c_off(&self) -> usize {
        self.inner() + self.groups * self.d_state
    }

    /// State tiles of the dB / dC kernel.
    pub(super) fn dbc_tiles(&self) -> usize {
        self.d_state.div_ceil(DBC_TILE_N)
    }

    /// Elements of the per-group diagonal weights (`psum`).
    pub(super) fn group_matrix_len(&self) -> usize {
        self.chunk_blocks() * self.groups * SSD_CHUNK * SSD_CHUNK
    }

    /// The element counts of [`SsdScratch`]'s buffers.
    pub fn scratch_lens(&self) -> SsdScratchLens {
        let nbc = self.chunk_blocks();
        let rh = self.rows() * self.heads;
        SsdScratchLens {
            states: nbc * self.heads * self.head_dim * self.d_state,
            chunk_matrix: nbc * self.heads * SSD_CHUNK * SSD_CHUNK,
            group_matrix: self.group_matrix_len(),
            row_heads: rh,
            chunk_heads: nbc * self.heads,
        }
    }

    /// Every extent non-zero, `groups` dividing `heads`, and every size
    /// the kernels take as an `int` fitting one.
    pub(super) fn check(&self, kernel: &'static str) -> Result<(), KernelError> {
        let SsdShape {
            batch,
            seq_len,
            heads,
            head_dim,
            d_state,
            groups,
        } = *self;
        for (what, v) in [
            ("batch", batch),
            ("seq_len", seq_len),
            ("heads", heads),
            ("head_dim", head_dim),
            ("d_state", d_state),
            ("groups", groups),
        ] {
            if v == 0 {
                return Err(KernelError::invalid(
                    kernel,
                    format!("{what} is 0; every SSD extent is at least 1"),
                ));
            }
        }
        if heads % groups != 0 {
            return Err(KernelError::invalid(
                kernel,
                format!("{groups} groups do not divide {heads} heads"),
            ));
        }
        check::int(kernel, "rows", self.rows())?;
        check::int(kernel, "chunks of the batch", self.chunk_blocks())?;
        check::int(kernel, "conv channels", self.conv_channels())?;
        // The tensor-core kernels' offsets inside one chunk are 32-bit.
        check::int(
            kernel,
            "a chunk's rows of dy",
            SSD_CHUNK.saturating_mul(self.inner()),
        )?;
        let states = heads.saturating_mul(head_dim).saturating_mul(d_state);
        check::int(kernel, "a chunk's states", states)?;
        let lens = self.scratch_lens();
        check::int(kernel, "dB / dC blocks", 2 * self.dbc_tiles())?;
        check::long(kernel, "group matrices", lens.group_matrix)?;
        check::long(kernel, "chunk states", lens.states)?;
        check::long(kernel, "chunk matrices", lens.chunk_matrix)?;
        Ok(())
    }
}

/// Element counts of the scratch buffers one shape needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SsdScratchLens {
    /// [`SsdScratch::states`] and [`SsdScratch::dstates`]:
    /// `[batch * chunks][heads][head_dim][d_state]`.
    pub states: usize,
    /// [`SsdScratch::chunk_m`] and [`SsdScratch::chunk_p`]:
    /// `[batch * chunks][heads][SSD_CHUNK][SSD_CHUNK]`.
    pub chunk_matrix: usize,
    /// [`SsdScratch::chunk_psum`]: `[batch * chunks][groups][SSD_CHUNK][SSD_CHUNK]`.
    pub group_matrix: usize,
    /// `cum`, `ds_in`, `ddt_in`, `rst`, `o_row`: `[rows, heads]`.
    pub row_heads: usize,
    /// `dsh`, `da_part`: `[batch * chunks, heads]`.
    pub chunk_heads: usize,
}

/// The scan's inputs, read by the forward and the backward alike.
#[derive(Clone, Copy)]
pub struct SsdInputs<'a> {
    /// The conv output `[rows, ldu]`: x (`inner` columns), then B and C
    /// (`groups * d_state` columns each), from column 0; f32, or its bf16
    /// rounding alone, kept as the states are ([`SsdStates`]: the two
    /// types go together, they pick the kernels).
    pub xbc: Stored<'a>,
    /// Leading dimension of `xbc` (at least [`SsdShape::conv_channels`]).
    pub ldu: usize,
    /// `dt = softplus(dt_raw + dt_bias)`, `[rows, heads]`.
    pub dt: &'a CudaView<'a, f32>,
    /// `A_log`, `[heads]`.
    pub a_log: &'a CudaView<'a, f32>,
    /// The skip `D`, `[heads]`.
    pub d: &'a CudaView<'a, f32>,
}

/// How the SSD keeps the chunks' entry states and their gradients between
/// its kernels ([`SsdScratch::states`], [`SsdScratch::dstates`]): f32, or
/// their bf16 rounding alone, as its input `xbc` and the backward's `dy`
/// are kept ([`SsdInputs::xbc`], [`SsdBackward::dy`]). The type picks the
/// kernels: bf16 needs the tensor-core products
/// ([`super::SsdProducts::Tf32`]), whose `_h` kernels read x, B, C and dy
/// in bf16, store the states rounded, and widen each value as they stage
/// it (bf16 runs keep them so: SPEC's stored activations, and
/// the reference keeps its passed states in the input's type; the carry
/// from chunk to chunk stays f32). Half the bytes of the largest buffers
/// the SSD kernels move.
pub enum SsdStates<'a> {
    F32(CudaViewMut<'a, f32>),
    Bf16(CudaViewMut<'a, u16>),
}

impl SsdStates<'_> {
    /// Elements.
    pub fn len(&self) -> usize {
        match self {
            SsdStates::F32(v) => v.len(),
            SsdStates::Bf16(v) => v.len(),
        }
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether the states are kept in bf16.
    pub fn is_bf16(&self) -> bool {
        matches!(self, SsdStates::Bf16(_))
    }

    /// A shared view, for the kernels that read the states.
    pub(super) fn as_view(&self) -> SsdStatesView<'_> {
        match self {
            SsdStates::F32(v) => SsdStatesView::F32(v.as_view()),
            SsdStates::Bf16(v) => SsdStatesView::Bf16(v.as_view()),
        }
    }
}

/// [`SsdStates`] lent to the kernels that read them.
pub(super) enum SsdStatesView<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, u16>),
}

impl ReadArg for SsdStatesView<'_> {
    fn push_read<'s>(&'s self, b: &mut LaunchArgs<'s>) {
        match self {
            SsdStatesView::F32(v) => v.push_read(b),
            SsdStatesView::Bf16(v) => v.push_read(b),
        }
    }
}

impl WriteArg for SsdStates<'_> {
    fn push_write<'s>(&'s mut self, b: &mut LaunchArgs<'s>) {
        match self {
            SsdStates::F32(v) => v.push_write(b),
            SsdStates::Bf16(v) => v.push_write(b),
        }
    }
}

/// Scratch of one call, overwritten by it ([`SsdShape::scratch_lens`] gives
/// each length; the forward uses `cum` and `states` alone, and
/// `chunk_psum` too with tensor-core products). Nothing in it
/// is read before the call writes it, so it need not survive between calls.
pub struct SsdScratch<'a> {
    /// The decays' running sums per chunk, `[rows, heads]`.
    pub cum: CudaViewMut<'a, f32>,
    /// Chunk entry states.
    pub states: SsdStates<'a>,
    /// Backward: the gradients of the states each chunk passes on (kept as
    /// `states` is).
    pub dstates: SsdStates<'a>,
    /// Backward: the diagonal block's weights per chunk.
    pub chunk_m: CudaViewMut<'a, f32>,
    /// Backward: the diagonal block's dB / dC weights per chunk and head.
    pub chunk_p: CudaViewMut<'a, f32>,
    /// Backward: those weights summed over each group's heads. With
    /// tensor-core products ([`super::SsdProducts::Tf32`]) it first holds
    /// each group's `C B^T` per chunk, in the forward and in the backward
    /// until the psum kernel overwrites it.
    pub chunk_psum: CudaViewMut<'a, f32>,
    /// Backward: per-token terms of d dt (`[rows, heads]` each).
    pub ds_in: CudaViewMut<'a, f32>,
    pub ddt_in: CudaViewMut<'a, f32>,
    pub rst: CudaViewMut<'a, f32>,
    pub o_row: CudaViewMut<'a, f32>,
    /// Backward: `<dS, H>` per chunk and head.
    pub dsh: CudaViewMut<'a, f32>,
    /// Backward: d A partials per chunk.
    pub da_part: CudaViewMut<'a, f32>,
}

/// Outputs of [`MambaKernels::ssd_forward`](super::MambaKernels::ssd_forward).
pub struct SsdForward<'a> {
    /// The gate `z`, `[rows, inner]` with leading dimension `ldz`, f32 or
    /// kept in bf16.
    pub z: Stored<'a>,
    pub ldz: usize,
    /// Out: `y`, `[rows, inner]` (kept for the gate's backward): f32, its
    /// bf16 rounding alone, or both.
    pub y: Store<'a>,
    /// Out: `y SiLU(z)`, `[rows, inner]` (f32, its bf16 rounding alone, or
    /// both), from `y` as it is kept (its rounding when only bf16 is), so
    /// [`MambaKernels::gate_bwd`](super::MambaKernels::gate_bwd) recomputes
    /// the same bits from the kept `y` and `z`.
    pub gate: Store<'a>,
}

/// Inputs and outputs of [`MambaKernels::ssd_backward`](super::MambaKernels::ssd_backward).
pub struct SsdBackward<'a> {
    /// `dL/dy`, `[rows, inner]` (the skip's share included: `dx` gets `D
    /// dy`; `dL/dD` is not computed here), kept as `xbc` is (f32, or its
    /// bf16 rounding alone).
    pub dy: Stored<'a>,
    /// Out: the x, B and C columns of the conv output's gradient (the same
    /// layout as `xbc`, leading dimension `lddx`); other columns untouched.
    pub dxbc: &'a mut CudaViewMut<'a, f32>,
    pub lddx: usize,
    /// Out: `dL/d dt_raw` (through softplus, from `dt` itself), `[rows,
    /// heads]` with leading dimension `ld_ddt`: f32, its bf16 rounding (for
    /// the bf16 GEMMs that read it, so no cast pass does) or both, each at
    /// that leading dimension.
    pub ddt_raw: Store<'a>,
    pub ld_ddt: usize,
    /// Out: `dL/dA_log`, `[heads]`.
    pub da_log: &'a mut CudaViewMut<'a, f32>,
}

impl SsdScratch<'_> {
    /// Every buffer as long as `shape` needs (`forward_only`: the forward's
    /// two).
    pub(super) fn check(
        &self,
        kernel: &'static str,
        shape: &SsdShape,
        forward_only: bool,
    ) -> Result<(), KernelError> {
        let l = shape.scratch_lens();
        check::len(kernel, "cum", self.cum.len(), l.row_heads)?;
        check::len(kernel, "states", self.states.len(), l.states)?;
        if forward_only {
            return Ok(());
        }
        if self.dstates.is_bf16() != self.states.is_bf16() {
            return Err(KernelError::invalid(
                kernel,
                "states and dstates must both be f32 or both bf16 (one kept type of the states)",
            ));
        }
        for (what, have, need) in [
            ("dstates", self.dstates.len(), l.states),
            ("chunk_m", self.chunk_m.len(), l.chunk_matrix),
            ("chunk_p", self.chunk_p.len(), l.chunk_matrix),
            ("chunk_psum", self.chunk_psum.len(), l.group_matrix),
            ("ds_in", self.ds_in.len(), l.row_heads),
            ("ddt_in", self.ddt_in.len(), l.row_heads),
            ("rst", self.rst.len(), l.row_heads),
            ("o_row", self.o_row.len(), l.row_heads),
            ("dsh", self.dsh.len(), l.chunk_heads),
            ("da_part", self.da_part.len(), l.chunk_heads),
        ] {
            check::len(kernel, what, have, need)?;
        }
        Ok(())
    }
}

impl SsdInputs<'_> {
    /// Whether the kept tensors are bf16: `xbc` and the scratch's states
    /// must be kept in one type (it picks the kernels), an error naming
    /// `kernel` otherwise.
    pub(super) fn kept_bf16(
        &self,
        kernel: &'static str,
        states: &SsdStates<'_>,
    ) -> Result<bool, KernelError> {
        if self.xbc.is_bf16() != states.is_bf16() {
            let name = |bf16: bool| if bf16 { "bf16" } else { "f32" };
            return Err(KernelError::invalid(
                kernel,
                format!(
                    "the conv output xbc is kept in {} but the SSD states in {}: the SSD's kept \
                     tensors are all f32 or all bf16",
                    name(self.xbc.is_bf16()),
                    name(states.is_bf16())
                ),
            ));
        }
        Ok(states.is_bf16())
    }

    pub(super) fn check(&self, kernel: &'static str, shape: &SsdShape) -> Result<(), KernelError> {
        let rows = shape.rows();
        check::matrix(
            kernel,
            "xbc (the conv output)",
            self.xbc.len(),
            rows,
            shape.conv_channels(),
            self.ldu,
        )?;
        check::matrix(kernel, "dt", self.dt.len(), rows, shape.heads, shape.heads)?;
        check::len(kernel, "A_log", self.a_log.len(), shape.heads)?;
        check::len(kernel, "D", self.d.len(), shape.heads)?;
        // The tensor-core kernels' offsets inside one chunk are 32-bit.
        check::int(
            kernel,
            "a chunk's rows of xbc",
            SSD_CHUNK.saturating_mul(self.ldu),
        )?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(heads: usize, head_dim: usize, d_state: usize, groups: usize) -> SsdShape {
        SsdShape {
            batch: 8,
            seq_len: 1024,
            heads,
            head_dim,
            d_state,
            groups,
        }
    }

    fn refusal(s: SsdShape) -> String {
        s.check("k").expect_err("refused").to_string()
    }

    #[test]
    fn the_130m_shape_and_ragged_small_ones_pass() {
        assert!(shape(24, 64, 128, 1).check("k").is_ok());
        assert!(shape(3, 5, 7, 3).check("k").is_ok());
        let s = shape(24, 64, 128, 2);
        assert_eq!(s.chunks(), 16);
        assert_eq!(s.conv_channels(), 24 * 64 + 2 * 2 * 128);
        assert_eq!((s.b_off(), s.c_off()), (1536, 1536 + 256));
        assert_eq!(s.group_matrix_len(), 8 * 16 * 2 * SSD_CHUNK * SSD_CHUNK);
    }

    #[test]
    fn bad_extents_are_refused_naming_them() {
        assert!(refusal(shape(0, 64, 128, 1)).contains("heads is 0"));
        assert!(refusal(shape(24, 64, 0, 1)).contains("d_state is 0"));
        assert!(refusal(shape(24, 64, 128, 5)).contains("5 groups do not divide 24 heads"));
    }

    #[test]
    fn a_chunk_whose_offsets_overflow_32_bits_is_refused() {
        // The tensor-core kernels index inside a chunk with 32-bit offsets:
        // 64 rows of dy, and one chunk's H x P x N states.
        let e = refusal(shape(1, 40_000_000, 1, 1));
        assert!(e.contains("a chunk's rows of dy"), "{e}");
        let e = refusal(shape(1, 1000, 3_000_000, 1));
        assert!(e.contains("a chunk's states"), "{e}");
        // Just inside both limits.
        assert!(shape(1, (i32::MAX as usize) / SSD_CHUNK - 2, 1, 1)
            .check("k")
            .is_ok());
    }
}
