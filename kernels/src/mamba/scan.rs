//! Launchers of `kernels/cuda/mamba_scan.cu`: the chunked selective scan.
//!
//! The algorithm, its formulas and the thread layout are described at the
//! top of the `.cu` file. In short: time is cut into chunks of
//! [`SCAN_CHUNK`] steps; the forward pass computes each chunk's affine map
//! (in parallel over chunks), chains the maps serially to get every chunk's
//! entry state (`hin`, kept for the backward pass: `1/SCAN_CHUNK` of the
//! `(B, T, D, N)` states), then recomputes each chunk from its entry state
//! to produce `y` and the gated `out`. The backward pass chains the adjoint
//! the same way in reverse and recomputes each chunk's states in registers.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut};

use super::check::{self, grid};
use super::launcher::{Arg, Grid, Launch};
use super::scan_shape::{BLOCK, FLAT};
use super::MambaKernels;

pub use super::scan_shape::{ScanShape, MAX_D_STATE, SCAN_CHUNK};
use crate::error::KernelError;

/// Inputs the forward and backward scans share.
#[derive(Clone, Copy)]
pub struct ScanInputs<'a> {
    /// `u = SiLU(conv(x))`, `[rows, d_inner]`.
    pub u: &'a CudaView<'a, f32>,
    /// `dt = softplus(dt_proj(.) + bias)`, `[rows, d_inner]`.
    pub dt: &'a CudaView<'a, f32>,
    /// x_proj's output from its B column on: `bc[m * ldbc + n]` is `B_t[n]`,
    /// `bc[m * ldbc + d_state + n]` is `C_t[n]`.
    pub bc: &'a CudaView<'a, f32>,
    /// Leading dimension of x_proj's output (`dt_rank + 2 d_state`).
    pub ldbc: usize,
    /// `A_log`, `[d_inner, d_state]`.
    pub a_log: &'a CudaView<'a, f32>,
    /// The skip parameter `D`, `[d_inner]`.
    pub d: &'a CudaView<'a, f32>,
}

/// Buffers of [`MambaKernels::scan_forward`].
pub struct ScanForward<'a, 'b> {
    /// The gate `z`, `[rows, d_inner]` with leading dimension `ldz`.
    pub z: &'a CudaView<'a, f32>,
    /// Leading dimension of `z`.
    pub ldz: usize,
    /// Scratch, [`ScanShape::state_len`] elements each.
    pub scratch_s: &'a mut CudaViewMut<'b, f32>,
    /// Scratch, [`ScanShape::state_len`] elements.
    pub scratch_p: &'a mut CudaViewMut<'b, f32>,
    /// Out: chunk entry states, [`ScanShape::state_len`] elements; keep for
    /// [`MambaKernels::scan_backward`].
    pub hin: &'a mut CudaViewMut<'b, f32>,
    /// Out: `y = C.h + D u`, `[rows, d_inner]` (kept for the gate's backward).
    pub y: &'a mut CudaViewMut<'b, f32>,
    /// Out: `y * SiLU(z)`, `[rows, d_inner]` (out_proj's input).
    pub out: &'a mut CudaViewMut<'b, f32>,
}

/// Buffers of [`MambaKernels::scan_backward`].
pub struct ScanBackward<'a, 'b> {
    /// `dL/dy`, `[rows, d_inner]`.
    pub dy: &'a CudaView<'a, f32>,
    /// The forward pass's chunk entry states.
    pub hin: &'a CudaView<'a, f32>,
    /// Scratch, [`ScanShape::state_len`] elements.
    pub scratch_g: &'a mut CudaViewMut<'b, f32>,
    /// Scratch, [`ScanShape::state_len`] elements.
    pub scratch_p: &'a mut CudaViewMut<'b, f32>,
    /// Scratch, [`ScanShape::state_len`] elements (per-chunk d A partials).
    pub scratch_da: &'a mut CudaViewMut<'b, f32>,
    /// Scratch, [`ScanShape::dbc_partial_len`] elements.
    pub scratch_dbc: &'a mut CudaViewMut<'b, f32>,
    /// Out: `dL/d(dt_proj output)` = `dL/d dt * softplus'`, `[rows, d_inner]`.
    pub ddt_raw: &'a mut CudaViewMut<'b, f32>,
    /// Out: `dL/du` from the scan and the skip term, `[rows, d_inner]`
    /// (x_proj's backward adds its share afterwards).
    pub du: &'a mut CudaViewMut<'b, f32>,
    /// Out: `dL/dB, dL/dC` into x_proj's output gradient from its B column
    /// on, leading dimension `ldbc` (the first `dt_rank` columns untouched).
    pub dbc: &'a mut CudaViewMut<'b, f32>,
    /// Out: `dL/dA_log`, `[d_inner, d_state]`.
    pub da_log: &'a mut CudaViewMut<'b, f32>,
}

impl MambaKernels {
    /// The checks both scan directions start with: the stream's context,
    /// the shape, and the inputs they share. Returns the activation length
    /// `rows * d_inner` and the chunk-state length ([`ScanShape::state_len`]).
    fn scan_checks(
        &self,
        kernel: &'static str,
        stream: &CudaStream,
        shape: &ScanShape,
        inp: &ScanInputs<'_>,
    ) -> Result<(usize, usize), KernelError> {
        self.check_stream(kernel, stream)?;
        shape.validate(kernel)?;
        check_inputs(kernel, shape, inp)?;
        let rd = check::mul(kernel, "activations", shape.rows(), shape.d_inner)?;
        Ok((rd, shape.state_len()))
    }

    /// The forward selective scan (three launches; see the module docs).
    pub fn scan_forward(
        &self,
        stream: &CudaStream,
        shape: ScanShape,
        inp: ScanInputs<'_>,
        buf: ScanForward<'_, '_>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_scan_forward";
        let (rd, sl) = self.scan_checks(K, stream, &shape, &inp)?;
        let (rows, d) = (shape.rows(), shape.d_inner);
        check::matrix(K, "z", buf.z.len(), rows, d, buf.ldz)?;
        check::len(K, "scratch_s", buf.scratch_s.len(), sl)?;
        check::len(K, "scratch_p", buf.scratch_p.len(), sl)?;
        check::len(K, "hin", buf.hin.len(), sl)?;
        check::len(K, "y", buf.y.len(), rd)?;
        check::len(K, "out", buf.out.len(), rd)?;
        if shape.is_empty() {
            return Ok(());
        }
        let lp = shape.launch(K)?;
        let (ldbc, ldz) = (
            check::long(K, "ldbc", inp.ldbc)?,
            check::long(K, "ldz", buf.ldz)?,
        );

        let launch = Launch {
            kernel: "mamba_scan_fwd_local",
            func: &self.f.scan_fwd_local,
            grid: Grid::Checked(lp.chunk_grid),
            block: BLOCK as u32,
        };
        let mut args = [
            Arg::In(inp.u),
            Arg::In(inp.dt),
            Arg::In(inp.bc),
            Arg::I64(ldbc),
            Arg::In(inp.a_log),
            Arg::Out(&mut *buf.scratch_s),
            Arg::Out(&mut *buf.scratch_p),
            Arg::I32(lp.t),
            Arg::I32(lp.di),
            Arg::I32(lp.ni),
            Arg::I32(lp.np),
        ];
        // SAFETY: matches mamba_scan_fwd_local(const float* u, const float*
        // dt, const float* bc, long long ldbc, const float* a_log, float* S,
        // float* P, int T, int D, int N, int np); check_inputs and the
        // checks above bound every index (rows < batch*seq_len, states <
        // state_len).
        unsafe { self.launch(stream, launch, &mut args) }?;

        let launch = Launch {
            kernel: "mamba_scan_fwd_combine",
            func: &self.f.scan_fwd_combine,
            grid: Grid::Checked(lp.flat_grid),
            block: FLAT,
        };
        let (s, p) = (buf.scratch_s.as_view(), buf.scratch_p.as_view());
        let mut args = [
            Arg::In(&s),
            Arg::In(&p),
            Arg::Out(&mut *buf.hin),
            Arg::I32(lp.bi),
            Arg::I32(lp.nch),
            Arg::I64(lp.dn),
        ];
        // SAFETY: matches mamba_scan_fwd_combine(const float* S, const float*
        // P, float* Hin, int B, int nch, long long DN); indices below
        // state_len.
        unsafe { self.launch(stream, launch, &mut args) }?;

        let hin = buf.hin.as_view();
        let launch = Launch {
            kernel: "mamba_scan_fwd_out",
            func: &self.f.scan_fwd_out,
            grid: Grid::Checked(lp.chunk_grid),
            block: BLOCK as u32,
        };
        let mut args = [
            Arg::In(inp.u),
            Arg::In(inp.dt),
            Arg::In(inp.bc),
            Arg::I64(ldbc),
            Arg::In(inp.a_log),
            Arg::In(inp.d),
            Arg::In(buf.z),
            Arg::I64(ldz),
            Arg::In(&hin),
            Arg::Out(&mut *buf.y),
            Arg::Out(&mut *buf.out),
            Arg::I32(lp.t),
            Arg::I32(lp.di),
            Arg::I32(lp.ni),
            Arg::I32(lp.np),
        ];
        // SAFETY: matches mamba_scan_fwd_out(u, dt, bc, long long ldbc,
        // a_log, dpar, z, long long ldz, Hin, float* y, float* out, int T,
        // int D, int N, int np); extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// The backward selective scan (four launches plus the d A_log
    /// reduction; see the module docs).
    pub fn scan_backward(
        &self,
        stream: &CudaStream,
        shape: ScanShape,
        inp: ScanInputs<'_>,
        buf: ScanBackward<'_, '_>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_scan_backward";
        let (rd, sl) = self.scan_checks(K, stream, &shape, &inp)?;
        let (rows, d, n) = (shape.rows(), shape.d_inner, shape.d_state);
        check::len(K, "dy", buf.dy.len(), rd)?;
        check::len(K, "hin", buf.hin.len(), sl)?;
        check::len(K, "scratch_g", buf.scratch_g.len(), sl)?;
        check::len(K, "scratch_p", buf.scratch_p.len(), sl)?;
        check::len(K, "scratch_da", buf.scratch_da.len(), sl)?;
        check::len(
            K,
            "scratch_dbc",
            buf.scratch_dbc.len(),
            shape.dbc_partial_len(),
        )?;
        check::len(K, "ddt_raw", buf.ddt_raw.len(), rd)?;
        check::len(K, "du", buf.du.len(), rd)?;
        check::matrix(K, "dbc", buf.dbc.len(), rows, 2 * n, inp.ldbc)?;
        check::len(K, "da_log", buf.da_log.len(), d * n)?;
        if shape.is_empty() {
            return Ok(());
        }
        let lp = shape.launch(K)?;
        let bwd_grid = grid(
            K,
            (shape.groups(), shape.chunks(), shape.batch),
            BLOCK as u32,
        )?;
        let ldbc = check::long(K, "ldbc", inp.ldbc)?;
        let (rounds, groups) = (shape.rounds() as i32, shape.groups() as i32);
        let rows_l = check::long(K, "rows", rows)?;

        let launch = Launch {
            kernel: "mamba_scan_bwd_local",
            func: &self.f.scan_bwd_local,
            grid: Grid::Checked(lp.chunk_grid),
            block: BLOCK as u32,
        };
        let mut args = [
            Arg::In(inp.dt),
            Arg::In(inp.bc),
            Arg::I64(ldbc),
            Arg::In(inp.a_log),
            Arg::In(buf.dy),
            Arg::Out(&mut *buf.scratch_g),
            Arg::Out(&mut *buf.scratch_p),
            Arg::I32(lp.t),
            Arg::I32(lp.di),
            Arg::I32(lp.ni),
            Arg::I32(lp.np),
        ];
        // SAFETY: matches mamba_scan_bwd_local(const float* dt, const float*
        // bc, long long ldbc, const float* a_log, const float* dy, float* G,
        // float* P, int T, int D, int N, int np); extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }?;

        let p = buf.scratch_p.as_view();
        let launch = Launch {
            kernel: "mamba_scan_bwd_combine",
            func: &self.f.scan_bwd_combine,
            grid: Grid::Checked(lp.flat_grid),
            block: FLAT,
        };
        let mut args = [
            Arg::Out(&mut *buf.scratch_g),
            Arg::In(&p),
            Arg::I32(lp.bi),
            Arg::I32(lp.nch),
            Arg::I64(lp.dn),
        ];
        // SAFETY: matches mamba_scan_bwd_combine(float* G, const float* P,
        // int B, int nch, long long DN); in place on G, indices below
        // state_len.
        unsafe { self.launch(stream, launch, &mut args) }?;

        let g = buf.scratch_g.as_view();
        let launch = Launch {
            kernel: "mamba_scan_bwd",
            func: &self.f.scan_bwd,
            grid: Grid::Checked(bwd_grid),
            block: BLOCK as u32,
        };
        let mut args = [
            Arg::In(inp.u),
            Arg::In(inp.dt),
            Arg::In(inp.bc),
            Arg::I64(ldbc),
            Arg::In(inp.a_log),
            Arg::In(inp.d),
            Arg::In(buf.dy),
            Arg::In(buf.hin),
            Arg::In(&g),
            Arg::Out(&mut *buf.ddt_raw),
            Arg::Out(&mut *buf.du),
            Arg::Out(&mut *buf.scratch_dbc),
            Arg::Out(&mut *buf.scratch_da),
            Arg::I32(lp.t),
            Arg::I32(lp.di),
            Arg::I32(lp.ni),
            Arg::I32(lp.np),
            Arg::I32(rounds),
        ];
        // SAFETY: matches mamba_scan_bwd(u, dt, bc, long long ldbc, a_log,
        // dpar, dy, Hin, Gin, float* ddtr, float* du, float* part, float*
        // dA_part, int T, int D, int N, int np, int rounds); the grid's x
        // extent is groups = ceil(ceil(D / cpb) / rounds), so every channel
        // index is bounded by c < D checks in the kernel, and part is
        // [groups][rows][2N] (checked above).
        unsafe { self.launch(stream, launch, &mut args) }?;

        let reduce_grid = grid(K, ((rows * 2 * n).div_ceil(FLAT as usize), 1, 1), FLAT)?;
        let part = buf.scratch_dbc.as_view();
        let launch = Launch {
            kernel: "mamba_scan_dbc_reduce",
            func: &self.f.scan_dbc_reduce,
            grid: Grid::Checked(reduce_grid),
            block: FLAT,
        };
        let mut args = [
            Arg::In(&part),
            Arg::I32(groups),
            Arg::I64(rows_l),
            Arg::I32(lp.ni),
            Arg::Out(&mut *buf.dbc),
            Arg::I64(ldbc),
        ];
        // SAFETY: matches mamba_scan_dbc_reduce(const float* part, int
        // groups, long long M, int N, float* dbc, long long ldbc); dbc holds a
        // [rows, 2N] block with leading dimension ldbc (checked above).
        unsafe { self.launch(stream, launch, &mut args) }?;

        let da = buf.scratch_da.as_view();
        let parts = shape.batch * shape.chunks();
        self.reduce_partials(
            stream,
            &da,
            parts,
            d * n,
            0,
            d * n,
            Some(inp.a_log),
            buf.da_log,
        )
    }
}

fn check_inputs(
    kernel: &'static str,
    shape: &ScanShape,
    inp: &ScanInputs<'_>,
) -> Result<(), KernelError> {
    let (rows, d, n) = (shape.rows(), shape.d_inner, shape.d_state);
    let rd = check::mul(kernel, "activations", rows, d)?;
    check::len(kernel, "u", inp.u.len(), rd)?;
    check::len(kernel, "dt", inp.dt.len(), rd)?;
    check::matrix(kernel, "bc", inp.bc.len(), rows, 2 * n, inp.ldbc)?;
    check::len(
        kernel,
        "a_log",
        inp.a_log.len(),
        check::mul(kernel, "a_log", d, n)?,
    )?;
    check::len(kernel, "d", inp.d.len(), d)?;
    Ok(())
}
