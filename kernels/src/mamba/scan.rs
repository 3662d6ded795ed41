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

use cudarc::driver::{CudaStream, CudaView, CudaViewMut, LaunchConfig, PushKernelArg};

use super::check::{self, grid};
use super::{launched, MambaKernels};
use crate::error::KernelError;

/// Time steps per chunk (`kChunk` in the `.cu` file).
pub const SCAN_CHUNK: usize = 16;
/// Threads per block of the per-chunk kernels (`kThreads`).
const BLOCK: usize = 128;
/// Largest state size: one channel's lanes must fit a block.
pub const MAX_D_STATE: usize = BLOCK;
/// Threads per block of the serial-combine and reduction kernels.
const FLAT: u32 = 256;

/// The extents of one scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanShape {
    /// Sequences.
    pub batch: usize,
    /// Time steps per sequence.
    pub seq_len: usize,
    /// Channels (`d_inner`).
    pub d_inner: usize,
    /// State size `N` (`d_state`), 1..=[`MAX_D_STATE`].
    pub d_state: usize,
}

impl ScanShape {
    /// Rows of the activations: `batch * seq_len`.
    pub fn rows(&self) -> usize {
        self.batch * self.seq_len
    }
    /// Chunks per sequence: `ceil(seq_len / SCAN_CHUNK)`.
    pub fn chunks(&self) -> usize {
        self.seq_len.div_ceil(SCAN_CHUNK)
    }
    /// Elements of one chunk-state array (`[batch][chunks][d_inner][d_state]`):
    /// the length of `hin` and of each scan scratch buffer.
    pub fn state_len(&self) -> usize {
        self.batch * self.chunks() * self.d_inner * self.d_state
    }
    /// Lanes per channel: `d_state` rounded up to a power of two.
    pub fn lanes(&self) -> usize {
        self.d_state.next_power_of_two()
    }
    /// Channels one block covers: `128 / lanes`.
    pub fn channels_per_block(&self) -> usize {
        BLOCK / self.lanes()
    }
    /// Channel sets one backward block walks in turn (so that its d B / d C
    /// partial covers more channels): a function of the shape only, so the
    /// summation order never depends on the device.
    pub fn rounds(&self) -> usize {
        let sets = self.d_inner.div_ceil(self.channels_per_block());
        (sets / 16).clamp(1, 8)
    }
    /// Channel groups of the backward pass (its grid's x extent, and the
    /// number of d B / d C partials summed per element).
    pub fn groups(&self) -> usize {
        self.d_inner
            .div_ceil(self.channels_per_block())
            .div_ceil(self.rounds())
    }
    /// Length of the d B / d C partial buffer of [`MambaKernels::scan_backward`].
    pub fn dbc_partial_len(&self) -> usize {
        self.groups() * self.rows() * 2 * self.d_state
    }

    fn validate(&self, kernel: &'static str) -> Result<(), KernelError> {
        if self.d_state == 0 || self.d_state > MAX_D_STATE {
            return Err(KernelError::invalid(
                kernel,
                format!(
                    "d_state {}; the scan handles 1..={MAX_D_STATE}",
                    self.d_state
                ),
            ));
        }
        if self.batch > check::MAX_GRID_YZ || self.chunks() > check::MAX_GRID_YZ {
            return Err(KernelError::invalid(
                kernel,
                format!(
                    "batch {} and {} chunks of {SCAN_CHUNK} steps: each must be at most {}",
                    self.batch,
                    self.chunks(),
                    check::MAX_GRID_YZ
                ),
            ));
        }
        check::int(kernel, "seq_len", self.seq_len)?;
        check::int(kernel, "d_inner", self.d_inner)?;
        check::long(kernel, "state elements", self.state_len())?;
        Ok(())
    }

    /// The grids and kernel integers both scan directions launch with.
    /// Call only after [`Self::validate`] (which bounds `seq_len`, `d_inner`
    /// and the state count, so the casts below cannot truncate) and on a
    /// non-empty shape (else a grid extent is 0 and this refuses).
    fn launch(&self, kernel: &'static str) -> Result<ScanLaunch, KernelError> {
        let (d, n) = (self.d_inner, self.d_state);
        let chunk_grid = grid(
            kernel,
            (
                d.div_ceil(self.channels_per_block()),
                self.chunks(),
                self.batch,
            ),
            BLOCK as u32,
        )?;
        let flat_grid = grid(
            kernel,
            ((self.batch * d * n).div_ceil(FLAT as usize), 1, 1),
            FLAT,
        )?;
        Ok(ScanLaunch {
            chunk_grid,
            flat_grid,
            t: self.seq_len as i32,
            di: d as i32,
            ni: n as i32,
            np: self.lanes() as i32,
            bi: self.batch as i32,
            nch: self.chunks() as i32,
            dn: (d * n) as i64,
        })
    }

    fn is_empty(&self) -> bool {
        self.batch == 0 || self.seq_len == 0 || self.d_inner == 0
    }
}

/// What [`ScanShape::launch`] computes for both scan directions.
struct ScanLaunch {
    /// One block per (channel set, chunk, sequence): the per-chunk kernels.
    chunk_grid: LaunchConfig,
    /// One thread per `(sequence, channel, state)`: the serial combines.
    flat_grid: LaunchConfig,
    /// `seq_len`, `d_inner`, `d_state` and lanes per channel (`T, D, N, np`).
    t: i32,
    di: i32,
    ni: i32,
    np: i32,
    /// `batch`, chunks per sequence and `d_inner * d_state` (`B, nch, DN`).
    bi: i32,
    nch: i32,
    dn: i64,
}

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

        let mut l = stream.launch_builder(&self.f.scan_fwd_local);
        l.arg(inp.u)
            .arg(inp.dt)
            .arg(inp.bc)
            .arg(&ldbc)
            .arg(inp.a_log);
        l.arg(&mut *buf.scratch_s)
            .arg(&mut *buf.scratch_p)
            .arg(&lp.t)
            .arg(&lp.di)
            .arg(&lp.ni)
            .arg(&lp.np);
        // SAFETY: matches mamba_scan_fwd_local(const float* u, const float*
        // dt, const float* bc, long long ldbc, const float* a_log, float* S,
        // float* P, int T, int D, int N, int np); check_inputs and the
        // checks above bound every index (rows < batch*seq_len, states <
        // state_len).
        launched("mamba_scan_fwd_local", unsafe { l.launch(lp.chunk_grid) })?;

        let mut l = stream.launch_builder(&self.f.scan_fwd_combine);
        let (s, p) = (buf.scratch_s.as_view(), buf.scratch_p.as_view());
        l.arg(&s)
            .arg(&p)
            .arg(&mut *buf.hin)
            .arg(&lp.bi)
            .arg(&lp.nch)
            .arg(&lp.dn);
        // SAFETY: matches mamba_scan_fwd_combine(const float* S, const float*
        // P, float* Hin, int B, int nch, long long DN); indices below
        // state_len.
        launched("mamba_scan_fwd_combine", unsafe { l.launch(lp.flat_grid) })?;

        let hin = buf.hin.as_view();
        let mut l = stream.launch_builder(&self.f.scan_fwd_out);
        l.arg(inp.u)
            .arg(inp.dt)
            .arg(inp.bc)
            .arg(&ldbc)
            .arg(inp.a_log)
            .arg(inp.d);
        l.arg(buf.z)
            .arg(&ldz)
            .arg(&hin)
            .arg(&mut *buf.y)
            .arg(&mut *buf.out);
        l.arg(&lp.t).arg(&lp.di).arg(&lp.ni).arg(&lp.np);
        // SAFETY: matches mamba_scan_fwd_out(u, dt, bc, long long ldbc,
        // a_log, dpar, z, long long ldz, Hin, float* y, float* out, int T,
        // int D, int N, int np); extents checked above.
        launched("mamba_scan_fwd_out", unsafe { l.launch(lp.chunk_grid) })
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

        let mut l = stream.launch_builder(&self.f.scan_bwd_local);
        l.arg(inp.dt)
            .arg(inp.bc)
            .arg(&ldbc)
            .arg(inp.a_log)
            .arg(buf.dy);
        l.arg(&mut *buf.scratch_g)
            .arg(&mut *buf.scratch_p)
            .arg(&lp.t)
            .arg(&lp.di)
            .arg(&lp.ni)
            .arg(&lp.np);
        // SAFETY: matches mamba_scan_bwd_local(const float* dt, const float*
        // bc, long long ldbc, const float* a_log, const float* dy, float* G,
        // float* P, int T, int D, int N, int np); extents checked above.
        launched("mamba_scan_bwd_local", unsafe { l.launch(lp.chunk_grid) })?;

        let p = buf.scratch_p.as_view();
        let mut l = stream.launch_builder(&self.f.scan_bwd_combine);
        l.arg(&mut *buf.scratch_g)
            .arg(&p)
            .arg(&lp.bi)
            .arg(&lp.nch)
            .arg(&lp.dn);
        // SAFETY: matches mamba_scan_bwd_combine(float* G, const float* P,
        // int B, int nch, long long DN); in place on G, indices below
        // state_len.
        launched("mamba_scan_bwd_combine", unsafe { l.launch(lp.flat_grid) })?;

        let g = buf.scratch_g.as_view();
        let mut l = stream.launch_builder(&self.f.scan_bwd);
        l.arg(inp.u)
            .arg(inp.dt)
            .arg(inp.bc)
            .arg(&ldbc)
            .arg(inp.a_log)
            .arg(inp.d);
        l.arg(buf.dy)
            .arg(buf.hin)
            .arg(&g)
            .arg(&mut *buf.ddt_raw)
            .arg(&mut *buf.du);
        l.arg(&mut *buf.scratch_dbc).arg(&mut *buf.scratch_da);
        l.arg(&lp.t)
            .arg(&lp.di)
            .arg(&lp.ni)
            .arg(&lp.np)
            .arg(&rounds);
        // SAFETY: matches mamba_scan_bwd(u, dt, bc, long long ldbc, a_log,
        // dpar, dy, Hin, Gin, float* ddtr, float* du, float* part, float*
        // dA_part, int T, int D, int N, int np, int rounds); the grid's x
        // extent is groups = ceil(ceil(D / cpb) / rounds), so every channel
        // index is bounded by c < D checks in the kernel, and part is
        // [groups][rows][2N] (checked above).
        launched("mamba_scan_bwd", unsafe { l.launch(bwd_grid) })?;

        let reduce_grid = grid(K, ((rows * 2 * n).div_ceil(FLAT as usize), 1, 1), FLAT)?;
        let part = buf.scratch_dbc.as_view();
        let mut l = stream.launch_builder(&self.f.scan_dbc_reduce);
        l.arg(&part)
            .arg(&groups)
            .arg(&rows_l)
            .arg(&lp.ni)
            .arg(&mut *buf.dbc)
            .arg(&ldbc);
        // SAFETY: matches mamba_scan_dbc_reduce(const float* part, int
        // groups, long long M, int N, float* dbc, long long ldbc); dbc holds a
        // [rows, 2N] block with leading dimension ldbc (checked above).
        launched("mamba_scan_dbc_reduce", unsafe { l.launch(reduce_grid) })?;

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

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(batch: usize, seq_len: usize, d_inner: usize, d_state: usize) -> ScanShape {
        ScanShape {
            batch,
            seq_len,
            d_inner,
            d_state,
        }
    }

    #[test]
    fn chunking_covers_ragged_sequences() {
        let s = shape(2, 37, 5, 16);
        assert_eq!(s.chunks(), 3);
        assert_eq!(s.state_len(), 2 * 3 * 5 * 16);
        assert_eq!(shape(1, 16, 1, 1).chunks(), 1);
        assert_eq!(shape(1, 17, 1, 1).chunks(), 2);
    }

    #[test]
    fn lanes_cover_the_state_and_a_block_covers_whole_channels() {
        for (n, lanes, cpb) in [
            (1, 1, 128),
            (7, 8, 16),
            (16, 16, 8),
            (33, 64, 2),
            (64, 64, 2),
            (128, 128, 1),
        ] {
            let s = shape(1, 1, 10, n);
            assert_eq!((s.lanes(), s.channels_per_block()), (lanes, cpb), "N = {n}");
        }
    }

    #[test]
    fn backward_groups_cover_every_channel_exactly_once() {
        for d in [1, 5, 64, 127, 128, 1536, 3000] {
            for n in [1, 16, 64] {
                let s = shape(1, 1, d, n);
                let covered = s.groups() * s.rounds() * s.channels_per_block();
                assert!(covered >= d, "d {d} n {n}");
                // No group lies wholly beyond the channels.
                assert!(
                    (s.groups() - 1) * s.rounds() * s.channels_per_block() < d,
                    "d {d} n {n}"
                );
                assert!((1..=8).contains(&s.rounds()));
            }
        }
        // The 130m shape: 1536 channels, N 16 -> 192 channel sets, 8 rounds, 24 groups.
        let s = shape(8, 1024, 1536, 16);
        assert_eq!((s.rounds(), s.groups()), (8, 24));
    }

    #[test]
    fn shapes_the_kernels_cannot_run_are_refused() {
        assert!(shape(1, 1, 1, 0).validate("k").is_err());
        let e = shape(1, 1, 1, 129).validate("k").unwrap_err().to_string();
        assert!(e.contains("1..=128"), "{e}");
        assert!(shape(65_536, 1, 1, 1).validate("k").is_err());
        assert!(shape(1, 16 * 65_535 + 1, 1, 1).validate("k").is_err());
        assert!(shape(1, 16 * 65_535, 1, 16).validate("k").is_ok());
    }
}
