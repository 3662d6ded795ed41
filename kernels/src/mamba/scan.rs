//! Launchers of `kernels/cuda/mamba_scan.cu`: the selective scan.
//!
//! The algorithm, its formulas and the thread layout are described at the
//! top of the `.cu` file. In short: each thread holds 4 states of one
//! channel of one sequence in registers and walks time in order, reading
//! each chunk's inputs from shared memory (staged one chunk ahead). The
//! forward pass (one launch) keeps the state every chunk of [`SCAN_CHUNK`]
//! steps enters with (`hin`: `1/SCAN_CHUNK` of the `(B, T, D, N)` states)
//! and writes `y` and the gated `out`; the backward pass walks the chunks in
//! reverse, recomputes each one's states from `hin` into shared memory and
//! carries the adjoint across them, then two fixed-order reductions finish
//! d B / d C (over channel groups) and d A_log (over the batch and the time
//! segments). A sequence of more than [`SEGMENT_CHUNKS`] chunks is walked
//! as several time segments in parallel, each direction with a first pass
//! that links them (see the `.cu` file).
//!
//! Over 450 lines: the two scan directions, their segment passes and the
//! input checks that make each launch's SAFETY argument (types, alignment,
//! extents) are one unsafe boundary over one `.cu` file; split, the checks
//! would sit apart from the launches they justify.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, DevicePtr};

use super::check::{self, grid};
use super::launcher::{Arg, Grid, Launch};
use super::scan_shape::{ScanLaunch, BLOCK, FLAT};
use super::store::{Store, Stored};
use super::MambaKernels;

pub use super::scan_shape::{ScanShape, MAX_D_STATE, SCAN_CHUNK, SEGMENT_CHUNKS};
use crate::error::KernelError;

/// Inputs the forward and backward scans share.
#[derive(Clone, Copy)]
pub struct ScanInputs<'a> {
    /// `u = SiLU(conv(x))`, `[rows, d_inner]`: f32, or bf16 (then `dt`
    /// too, and `d_inner` even, the views 4-byte aligned: the kernels stage
    /// two channels a copy).
    pub u: Stored<'a>,
    /// `dt = softplus(dt_proj(.) + bias)`, `[rows, d_inner]`, kept in the
    /// type `u` is.
    pub dt: Stored<'a>,
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
    /// The gate `z`, `[rows, d_inner]` with leading dimension `ldz`, kept
    /// in the type `u` is (bf16: `ldz` even and the view 4-byte aligned, as
    /// for `u`).
    pub z: Stored<'a>,
    /// Leading dimension of `z`.
    pub ldz: usize,
    /// Out: chunk entry states, [`ScanShape::state_len`] elements; keep for
    /// [`MambaKernels::scan_backward`].
    pub hin: &'a mut CudaViewMut<'b, f32>,
    /// Out: `y = C.h + D u`, `[rows, d_inner]` (kept for the gate's
    /// backward): f32, bf16 or both.
    pub y: Store<'b>,
    /// Out: `y * SiLU(z)` from `y` as it is kept (its bf16 rounding when
    /// `y` is bf16 alone), `[rows, d_inner]` (out_proj's input): f32, bf16
    /// (all a bf16 out_proj reads) or both. [`MambaKernels::gate_bwd`]
    /// recomputes the same bits.
    pub out: Store<'b>,
    /// Scratch, [`ScanShape::segment_scratch_len`] elements (none needed,
    /// any length, for a one-segment sequence).
    pub scratch_seg: &'a mut CudaViewMut<'b, f32>,
}

/// Buffers of [`MambaKernels::scan_backward`].
pub struct ScanBackward<'a, 'b> {
    /// `dL/dy`, `[rows, d_inner]`.
    pub dy: &'a CudaView<'a, f32>,
    /// The forward pass's chunk entry states.
    pub hin: &'a CudaView<'a, f32>,
    /// Scratch, [`ScanShape::da_partial_len`] elements (per-sequence d A
    /// partials).
    pub scratch_da: &'a mut CudaViewMut<'b, f32>,
    /// Scratch, [`ScanShape::dbc_partial_len`] elements.
    pub scratch_dbc: &'a mut CudaViewMut<'b, f32>,
    /// Scratch, [`ScanShape::segment_scratch_len`] elements.
    pub scratch_seg: &'a mut CudaViewMut<'b, f32>,
    /// Out: `dL/d(dt_proj output)` = `dL/d dt * softplus'`, `[rows,
    /// d_inner]`: f32, bf16 or both (dt_proj's bias gradient reads the f32
    /// values, its bf16 GEMMs the copy).
    pub ddt_raw: Store<'b>,
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
        check_inputs(kernel, stream, shape, inp)?;
        let rd = check::mul(kernel, "activations", shape.rows(), shape.d_inner)?;
        Ok((rd, shape.state_len()))
    }

    /// The forward selective scan (one launch; see the module docs).
    pub fn scan_forward(
        &self,
        stream: &CudaStream,
        shape: ScanShape,
        inp: ScanInputs<'_>,
        mut buf: ScanForward<'_, '_>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_scan_forward";
        let (rd, sl) = self.scan_checks(K, stream, &shape, &inp)?;
        let (rows, d) = (shape.rows(), shape.d_inner);
        check::matrix(K, "z", buf.z.len(), rows, d, buf.ldz)?;
        check_gate(K, stream, &inp, &buf)?;
        check::len(K, "hin", buf.hin.len(), sl)?;
        buf.y
            .check_each("y", |what, have| check::len(K, what, have, rd))?;
        buf.out
            .check_each("out", |what, have| check::len(K, what, have, rd))?;
        check::len(
            K,
            "scratch_seg",
            buf.scratch_seg.len(),
            shape.segment_scratch_len(),
        )?;
        if shape.is_empty() {
            return Ok(());
        }
        let lp = shape.launch(K)?;
        let (ldbc, ldz) = (
            check::long(K, "ldbc", inp.ldbc)?,
            check::long(K, "ldz", buf.ldz)?,
        );
        if let Some(seg_grid) = lp.seg_grid {
            let launch = Launch {
                kernel: "mamba_scan_fwd_seg",
                func: &self.f.scan_fwd_seg,
                grid: Grid::Checked(seg_grid),
                block: BLOCK as u32,
            };
            let ([u, u_h], [dt, dt_h]) = (inp.u.args(), inp.dt.args());
            let mut args = [
                u,
                u_h,
                dt,
                dt_h,
                Arg::In(inp.bc),
                Arg::I64(ldbc),
                Arg::In(inp.a_log),
                Arg::Out(&mut *buf.scratch_seg),
                Arg::I32(lp.t),
                Arg::I32(lp.di),
                Arg::I32(lp.ni),
                Arg::I32(lp.sp),
                Arg::I32(lp.seg),
            ];
            // SAFETY: matches mamba_scan_fwd_seg(const float* u, const unsigned
            // short* u_h, const float* dt, const unsigned short* dt_h (one of
            // each pair null, both pairs of one type: check_inputs), const float* bc, long long ldbc, const float* a_log, float*
            // seg_state, int T, int D, int N, int sp, int seg); the grid is
            // (channel sets, batch, segments - 1), it reads what the forward
            // reads and writes seg_state[< segment_scratch_len] (checked).
            unsafe { self.launch(stream, launch, &mut args) }?;
            self.scan_seg_link(stream, &shape, &lp, buf.scratch_seg, Some(&mut *buf.hin))?;
        }
        let launch = Launch {
            kernel: "mamba_scan_fwd",
            func: &self.f.scan_fwd,
            grid: Grid::Checked(lp.fwd_grid),
            block: BLOCK as u32,
        };
        let [out_f32, out_bf16] = buf.out.args();
        let [y_f32, y_bf16] = buf.y.args();
        let ([u, u_h], [dt, dt_h]) = (inp.u.args(), inp.dt.args());
        let [z, z_h] = buf.z.args();
        let mut args = [
            u,
            u_h,
            dt,
            dt_h,
            Arg::In(inp.bc),
            Arg::I64(ldbc),
            Arg::In(inp.a_log),
            Arg::In(inp.d),
            z,
            z_h,
            Arg::I64(ldz),
            Arg::Out(&mut *buf.hin),
            y_f32,
            y_bf16,
            out_f32,
            out_bf16,
            Arg::I32(lp.t),
            Arg::I32(lp.di),
            Arg::I32(lp.ni),
            Arg::I32(lp.sp),
            Arg::I32(lp.seg),
        ];
        // SAFETY: matches mamba_scan_fwd(const float* u, const unsigned
        // short* u_h, const float* dt, const unsigned short* dt_h, const
        // float* bc, long long ldbc, const float* a_log, const float* dpar,
        // const float* z, const unsigned short* z_h, long long ldz, float*
        // Hin, float* y, unsigned short* y_h, float* out, unsigned short*
        // out_h, int T, int D, int N, int sp, int seg) (one of u / u_h, of
        // dt / dt_h and of z / z_h null, all three of one type, bf16 ones
        // aligned with D and ldz even: check_inputs, check_gate; y / y_h and
        // out / out_h each null or checked; a segment's entry state is
        // read from Hin, where the link above wrote it); check_inputs and the
        // checks above
        // bound every index (rows < batch*seq_len, channels < d_inner, states
        // < state_len); the grid's y extent is the batch.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// The backward selective scan (one launch, the d B / d C group sum and
    /// the d A_log batch sum; see the module docs).
    pub fn scan_backward(
        &self,
        stream: &CudaStream,
        shape: ScanShape,
        inp: ScanInputs<'_>,
        mut buf: ScanBackward<'_, '_>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_scan_backward";
        let (rd, sl) = self.scan_checks(K, stream, &shape, &inp)?;
        let (rows, d, n) = (shape.rows(), shape.d_inner, shape.d_state);
        check::len(K, "dy", buf.dy.len(), rd)?;
        check::len(K, "hin", buf.hin.len(), sl)?;
        check::len(
            K,
            "scratch_da",
            buf.scratch_da.len(),
            shape.da_partial_len(),
        )?;
        check::len(
            K,
            "scratch_dbc",
            buf.scratch_dbc.len(),
            shape.dbc_partial_len(),
        )?;
        buf.ddt_raw
            .check_each("ddt_raw", |what, have| check::len(K, what, have, rd))?;
        check::len(K, "du", buf.du.len(), rd)?;
        check::matrix(K, "dbc", buf.dbc.len(), rows, 2 * n, inp.ldbc)?;
        check::len(K, "da_log", buf.da_log.len(), d * n)?;
        check::len(
            K,
            "scratch_seg",
            buf.scratch_seg.len(),
            shape.segment_scratch_len(),
        )?;
        if shape.is_empty() {
            return Ok(());
        }
        let lp = shape.launch(K)?;
        let ldbc = check::long(K, "ldbc", inp.ldbc)?;
        let rows_l = check::long(K, "rows", rows)?;

        if let Some(seg_grid) = lp.seg_grid {
            let launch = Launch {
                kernel: "mamba_scan_bwd_seg",
                func: &self.f.scan_bwd_seg,
                grid: Grid::Checked(seg_grid),
                block: BLOCK as u32,
            };
            let [dt, dt_h] = inp.dt.args();
            let mut args = [
                dt,
                dt_h,
                Arg::In(inp.bc),
                Arg::I64(ldbc),
                Arg::In(inp.a_log),
                Arg::In(buf.dy),
                Arg::Out(&mut *buf.scratch_seg),
                Arg::I32(lp.t),
                Arg::I32(lp.di),
                Arg::I32(lp.ni),
                Arg::I32(lp.sp),
                Arg::I32(lp.seg),
            ];
            // SAFETY: matches mamba_scan_bwd_seg(const float* dt, const
            // unsigned short* dt_h (one null: check_inputs), const float* bc, long long ldbc, const float* a_log, const float* dy,
            // float* seg_carry, int T, int D, int N, int sp, int seg); the
            // grid is (channel sets, batch, segments - 1); it reads what the
            // backward reads and writes seg_carry[< segment_scratch_len]
            // (checked).
            unsafe { self.launch(stream, launch, &mut args) }?;
            self.scan_seg_link(stream, &shape, &lp, buf.scratch_seg, None)?;
        }

        let launch = Launch {
            kernel: "mamba_scan_bwd",
            func: &self.f.scan_bwd,
            grid: Grid::Checked(lp.bwd_grid),
            block: BLOCK as u32,
        };
        let seg_in = buf.scratch_seg.as_view();
        let [ddt_f32, ddt_bf16] = buf.ddt_raw.args();
        let ([u, u_h], [dt, dt_h]) = (inp.u.args(), inp.dt.args());
        let mut args = [
            u,
            u_h,
            dt,
            dt_h,
            Arg::In(inp.bc),
            Arg::I64(ldbc),
            Arg::In(inp.a_log),
            Arg::In(inp.d),
            Arg::In(buf.dy),
            Arg::In(buf.hin),
            ddt_f32,
            ddt_bf16,
            Arg::Out(&mut *buf.du),
            Arg::Out(&mut *buf.scratch_dbc),
            Arg::Out(&mut *buf.scratch_da),
            Arg::In(&seg_in),
            Arg::I32(lp.t),
            Arg::I32(lp.di),
            Arg::I32(lp.ni),
            Arg::I32(lp.sp),
            Arg::I32(lp.rounds),
            Arg::I32(lp.seg),
        ];
        // SAFETY: matches mamba_scan_bwd(u, u_h, dt, dt_h (as the forward's),
        // bc, long long ldbc, a_log,
        // dpar, dy, Hin, float* ddtr, unsigned short* ddtr_h, float* du,
        // float* part, float* dA_part, int T, int D, int N, int sp, int
        // rounds) (ddtr and ddtr_h each null or checked; seg_carry as the
        // forward's seg_state, and int seg after rounds); the grid is (groups,
        // batch, segments) with groups = ceil(ceil(D / cpb) / rounds), so every channel
        // index is bounded by c < D checks in the kernel; part is
        // [groups][rows][2N] and dA_part [batch][segments][D][N] (checked above).
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
            Arg::I32(lp.groups),
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
        self.reduce_partials(
            stream,
            &da,
            shape.batch * shape.segments(),
            d * n,
            0,
            d * n,
            Some(inp.a_log),
            buf.da_log,
        )
    }
}

impl MambaKernels {
    /// Link the time segments after a first pass (`mamba_scan_seg_link`):
    /// forward (`hin` given) each later segment's entry state into `hin` at
    /// its first chunk, backward (`hin` None) each earlier segment's carry
    /// in over its slot of `seg`. Only with several segments.
    fn scan_seg_link(
        &self,
        stream: &CudaStream,
        shape: &ScanShape,
        lp: &ScanLaunch,
        seg: &mut CudaViewMut<'_, f32>,
        hin: Option<&mut CudaViewMut<'_, f32>>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_scan_seg_link";
        let n = shape.batch * shape.d_inner * shape.d_state;
        let backward = hin.is_none();
        let hin_arg = match hin {
            Some(h) => Arg::Out(h),
            None => Arg::Null,
        };
        let launch = Launch {
            kernel: K,
            func: &self.f.scan_seg_link,
            grid: Grid::Flat { n },
            block: FLAT,
        };
        let mut args = [
            Arg::Out(seg),
            hin_arg,
            Arg::Int("batch", shape.batch),
            Arg::I32(lp.t),
            Arg::I32(lp.di),
            Arg::I32(lp.ni),
            Arg::I32(lp.seg),
            Arg::I32(backward as i32),
        ];
        // SAFETY: matches mamba_scan_seg_link(float* seg_buf, float* Hin,
        // int B, int T, int D, int N, int seg, int backward); one thread per
        // (b, c, n) < B D N; it touches seg_buf[< segment_scratch_len] and,
        // forward only (Hin not null then), Hin[< state_len] at segment
        // starts (both checked by the callers).
        unsafe { self.launch(stream, launch, &mut args) }
    }
}

/// The forward's gate input: in `u`'s type (the kernel's bf16 staging is
/// one compile-time choice for u, dt and z), and when bf16 staged like
/// them, two channels a 4-byte copy (`ldz` even, the view aligned).
fn check_gate(
    kernel: &'static str,
    stream: &CudaStream,
    inp: &ScanInputs<'_>,
    buf: &ScanForward<'_, '_>,
) -> Result<(), KernelError> {
    match (inp.u, buf.z) {
        (Stored::F32(_), Stored::F32(_)) => Ok(()),
        (Stored::Bf16(_), Stored::Bf16(z)) => {
            let (ptr, _read) = z.device_ptr(stream);
            if buf.ldz % 2 != 0 || ptr % 4 != 0 {
                return Err(KernelError::invalid(
                    kernel,
                    format!(
                        "bf16 z needs an even leading dimension and a 4-byte aligned start \
                         (ldz {}, at {ptr:#x})",
                        buf.ldz
                    ),
                ));
            }
            Ok(())
        }
        _ => Err(KernelError::invalid(
            kernel,
            "z must be kept in the type u and dt are (all f32 or all bf16)",
        )),
    }
}

fn check_inputs(
    kernel: &'static str,
    stream: &CudaStream,
    shape: &ScanShape,
    inp: &ScanInputs<'_>,
) -> Result<(), KernelError> {
    let (rows, d, n) = (shape.rows(), shape.d_inner, shape.d_state);
    let rd = check::mul(kernel, "activations", rows, d)?;
    check::len(kernel, "u", inp.u.len(), rd)?;
    check::len(kernel, "dt", inp.dt.len(), rd)?;
    match (inp.u, inp.dt) {
        (Stored::F32(_), Stored::F32(_)) => {}
        (Stored::Bf16(u), Stored::Bf16(dt)) => {
            // Two channels a 4-byte copy: every pair (m * d + c, c even)
            // must be 4-byte aligned.
            if d % 2 != 0 {
                return Err(KernelError::invalid(
                    kernel,
                    format!("bf16 u and dt need an even d_inner, got {d}"),
                ));
            }
            for (what, v) in [("u", u), ("dt", dt)] {
                let (ptr, _read) = v.device_ptr(stream);
                if ptr % 4 != 0 {
                    return Err(KernelError::invalid(
                        kernel,
                        format!("bf16 {what} must start 4-byte aligned (at {ptr:#x})"),
                    ));
                }
            }
        }
        _ => {
            return Err(KernelError::invalid(
                kernel,
                "u and dt must be kept in the same type (both f32 or both bf16)",
            ))
        }
    }
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
