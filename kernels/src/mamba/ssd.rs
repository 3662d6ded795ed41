//! Launchers of `kernels/cuda/mamba_ssd.cu`: the Mamba-2 scan by
//! state-space duality, chunked ([`SSD_CHUNK`] tokens a chunk), forward and
//! backward, for any number of groups of heads sharing B and C.
//!
//! The `.cu` file derives the algorithm and states every sum's order. In
//! short, per chunk: the decays' running sums; the chunk's own state; the
//! entry states passed from chunk to chunk (one serial pass over chunks per
//! state element); then the output from the diagonal block and the entry
//! state. The backward recomputes the running sums and entry states
//! (nothing but `y` is kept from the forward), passes the states' gradient
//! the other way, and finishes d x, d B / d C (summed over a group's heads
//! in ascending order), d dt (through softplus) and d A_log. No kernel uses
//! atomics, and the chunk length is a constant of the kernels (not the
//! model's `chunk_size`), so the bits depend on the shapes and values alone.
//!
//! The kernels' twin on the host is `kernels/emu/ssd_check.cpp` (the same
//! source compiled as C++ and checked against a sequential f64 recurrence,
//! `ssd_emu_tests.rs`); on the device, `mamba-train/tests/cuda_mamba2.rs`
//! pins the trainer's use of them to the CPU model.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut};

use super::check;
use super::launcher::{Arg, Grid, Launch};
use super::MambaKernels;
use crate::error::KernelError;

/// Tokens per chunk of the SSD kernels (`kQ` in `mamba_ssd.cu`).
pub const SSD_CHUNK: usize = 64;
/// Threads of the per-chunk blocks (`kThreads`).
const THREADS: u32 = 256;
/// chunk_state's tile: channels and states (`kSp`, `kSn`).
const STATE_TILE_P: usize = 64;
const STATE_TILE_N: usize = 64;
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
    fn chunk_blocks(&self) -> usize {
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
    fn b_off(&self) -> usize {
        self.inner()
    }

    /// First column of C (of group 0) in a conv output row.
    fn c_off(&self) -> usize {
        self.inner() + self.groups * self.d_state
    }

    /// State tiles of the dB / dC kernel.
    fn dbc_tiles(&self) -> usize {
        self.d_state.div_ceil(DBC_TILE_N)
    }

    /// Elements of the per-group diagonal weights (`psum`).
    fn group_matrix_len(&self) -> usize {
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
    fn check(&self, kernel: &'static str) -> Result<(), KernelError> {
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
    /// (`groups * d_state` columns each), from column 0.
    pub xbc: &'a CudaView<'a, f32>,
    /// Leading dimension of `xbc` (at least [`SsdShape::conv_channels`]).
    pub ldu: usize,
    /// `dt = softplus(dt_raw + dt_bias)`, `[rows, heads]`.
    pub dt: &'a CudaView<'a, f32>,
    /// `A_log`, `[heads]`.
    pub a_log: &'a CudaView<'a, f32>,
    /// The skip `D`, `[heads]`.
    pub d: &'a CudaView<'a, f32>,
}

/// Scratch of one call, overwritten by it ([`SsdShape::scratch_lens`] gives
/// each length; the forward uses `cum` and `states` alone). Nothing in it
/// is read before the call writes it, so it need not survive between calls.
pub struct SsdScratch<'a> {
    /// The decays' running sums per chunk, `[rows, heads]`.
    pub cum: CudaViewMut<'a, f32>,
    /// Chunk entry states.
    pub states: CudaViewMut<'a, f32>,
    /// Backward: the gradients of the states each chunk passes on.
    pub dstates: CudaViewMut<'a, f32>,
    /// Backward: the diagonal block's weights per chunk.
    pub chunk_m: CudaViewMut<'a, f32>,
    /// Backward: the diagonal block's dB / dC weights per chunk and head.
    pub chunk_p: CudaViewMut<'a, f32>,
    /// Backward: those weights summed over each group's heads.
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

/// Outputs of [`MambaKernels::ssd_forward`].
pub struct SsdForward<'a> {
    /// The gate `z`, `[rows, inner]` with leading dimension `ldz`.
    pub z: &'a CudaView<'a, f32>,
    pub ldz: usize,
    /// Out: `y`, `[rows, inner]` (kept for the gate's backward).
    pub y: &'a mut CudaViewMut<'a, f32>,
    /// Out: `y SiLU(z)` ([`MambaKernels::gate_bwd`] recomputes the same
    /// bits from `y` and `z`), `[rows, inner]`.
    pub gate: &'a mut CudaViewMut<'a, f32>,
}

/// Inputs and outputs of [`MambaKernels::ssd_backward`].
pub struct SsdBackward<'a> {
    /// `dL/dy`, `[rows, inner]` (the skip's share included: `dx` gets `D
    /// dy`; `dL/dD` is not computed here).
    pub dy: &'a CudaView<'a, f32>,
    /// Out: the x, B and C columns of the conv output's gradient (the same
    /// layout as `xbc`, leading dimension `lddx`); other columns untouched.
    pub dxbc: &'a mut CudaViewMut<'a, f32>,
    pub lddx: usize,
    /// Out: `dL/d dt_raw` (through softplus, from `dt` itself), `[rows,
    /// heads]` with leading dimension `ld_ddt`.
    pub ddt_raw: &'a mut CudaViewMut<'a, f32>,
    pub ld_ddt: usize,
    /// Out: `dL/dA_log`, `[heads]`.
    pub da_log: &'a mut CudaViewMut<'a, f32>,
}

impl SsdScratch<'_> {
    /// Every buffer as long as `shape` needs (`forward_only`: the forward's
    /// two).
    fn check(
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
    fn check(&self, kernel: &'static str, shape: &SsdShape) -> Result<(), KernelError> {
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
        Ok(())
    }
}

impl MambaKernels {
    /// The running sums of `dt A` per chunk, then every chunk's entry state
    /// into `scratch.states` (the forward and the backward's recompute:
    /// the same launches, the same bits).
    ///
    /// # Safety
    /// `shape`, `inp` and `scratch` (its forward buffers) must have passed
    /// their checks for this shape.
    unsafe fn ssd_entry_states(
        &self,
        stream: &CudaStream,
        shape: &SsdShape,
        inp: &SsdInputs<'_>,
        scratch: &mut SsdScratch<'_>,
    ) -> Result<(), KernelError> {
        let (nbc, nc) = (shape.chunk_blocks(), shape.chunks());
        let mut args = [
            Arg::In(inp.dt),
            Arg::In(inp.a_log),
            Arg::Out(&mut scratch.cum),
            Arg::Int("seq_len", shape.seq_len),
            Arg::Int("heads", shape.heads),
            Arg::Int("chunks", nc),
            Arg::Int("chunks of the batch", nbc),
        ];
        let launch = Launch {
            kernel: "mamba_ssd_cumsum",
            func: &self.f.ssd_cumsum,
            grid: Grid::Flat {
                n: nbc * shape.heads,
            },
            block: THREADS,
        };
        // SAFETY: matches mamba_ssd_cumsum(const float* dt, const float*
        // a_log, float* s, int T, int H, int nc, int nbc); a thread per
        // (chunk, head) < nbc * H reads dt and writes s at rows of its
        // chunk (< rows) times H plus h, and a_log[h]: inside the [rows,
        // heads] buffers and [heads] checked by the callers.
        unsafe { self.launch(stream, launch, &mut args)? };
        let x = inp.xbc;
        let cum = scratch.cum.as_view();
        // SAFETY: x is the checked conv output (its x columns at ldu, its B
        // columns from b_off), states and cum have the scratch lengths.
        unsafe {
            self.ssd_chunk_states(
                stream,
                shape,
                (x, inp.ldu),
                (x, shape.b_off()),
                inp,
                &mut scratch.states,
                &cum,
                0,
            )
        }
    }

    /// `mamba_ssd_chunk_state` then `mamba_ssd_state_pass` into `out`:
    /// mode 0 (`X = x`, `Y = B`, forward pass) or 1 (`X = dy`, `Y = C`,
    /// reverse pass).
    ///
    /// # Safety
    /// `x` must hold `[rows, inner]` at leading dimension `ldx`; `y` a
    /// `[rows, ldu]` conv output whose columns `y_off + g * d_state + n`
    /// exist (`inp.ldu` is their leading dimension); `out` and `cum` the
    /// lengths of [`SsdShape::scratch_lens`]: the callers check them.
    #[allow(clippy::too_many_arguments)]
    unsafe fn ssd_chunk_states(
        &self,
        stream: &CudaStream,
        shape: &SsdShape,
        (x, ldx): (&CudaView<'_, f32>, usize),
        (y, y_off): (&CudaView<'_, f32>, usize),
        inp: &SsdInputs<'_>,
        out: &mut CudaViewMut<'_, f32>,
        cum: &CudaView<'_, f32>,
        mode: usize,
    ) -> Result<(), KernelError> {
        let (nbc, nc) = (shape.chunk_blocks(), shape.chunks());
        let tiles = shape.head_dim.div_ceil(STATE_TILE_P) * shape.d_state.div_ceil(STATE_TILE_N);
        let launch = Launch {
            kernel: "mamba_ssd_chunk_state",
            func: &self.f.ssd_chunk_state,
            grid: Grid::Dims(nbc, shape.heads, tiles),
            block: THREADS,
        };
        let mut args = [
            Arg::In(x),
            Arg::Long("ldx", ldx),
            Arg::In(y),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("y_off", y_off),
            Arg::In(inp.dt),
            Arg::In(cum),
            Arg::Out(out),
            Arg::Int("seq_len", shape.seq_len),
            Arg::Int("heads", shape.heads),
            Arg::Int("head_dim", shape.head_dim),
            Arg::Int("d_state", shape.d_state),
            Arg::Int("heads per group", shape.heads / shape.groups),
            Arg::Int("chunks", nc),
            Arg::Int("mode", mode),
        ];
        // SAFETY: matches mamba_ssd_chunk_state(const float* X, long long
        // ldx, const float* Y, long long ldy, int y_off, const float* dt,
        // const float* s, float* out, int T, int H, int P, int N, int hpg,
        // int nc, int mode); block (bc, h, tile) reads X and Y at its
        // chunk's rows (columns h*P + p < inner, y_off + g*N + n), dt and s
        // at [row, h], and writes out[bc][h][p][n] (p < P, n < N): the
        // extents of this function's contract.
        unsafe { self.launch(stream, launch, &mut args)? };
        let pn = shape.head_dim * shape.d_state;
        let launch = Launch {
            kernel: "mamba_ssd_state_pass",
            func: &self.f.ssd_state_pass,
            grid: Grid::Flat {
                n: shape.batch * shape.heads * pn,
            },
            block: THREADS,
        };
        let mut args = [
            Arg::Out(out),
            Arg::In(cum),
            Arg::Int("seq_len", shape.seq_len),
            Arg::Int("heads", shape.heads),
            Arg::Long("head_dim * d_state", pn),
            Arg::Int("chunks", nc),
            Arg::Int("batch", shape.batch),
            Arg::Int("reverse", mode),
        ];
        // SAFETY: matches mamba_ssd_state_pass(float* st, const float* s,
        // int T, int H, long long PN, int nc, int nbatch, int reverse); a
        // thread per (b, h, e < PN) touches st[((b*nc + c)*H + h)*PN + e]
        // for c < nc and s at the chunks' last rows: inside the buffers of
        // the contract.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// The SSD forward: `y` and `gate` from `inp` (module docs).
    pub fn ssd_forward(
        &self,
        stream: &CudaStream,
        shape: SsdShape,
        inp: SsdInputs<'_>,
        scratch: &mut SsdScratch<'_>,
        out: SsdForward<'_>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_ssd_chunk_out";
        self.check_stream(K, stream)?;
        shape.check(K)?;
        inp.check(K, &shape)?;
        scratch.check(K, &shape, true)?;
        let (rows, inner) = (shape.rows(), shape.inner());
        check::matrix(K, "z", out.z.len(), rows, inner, out.ldz)?;
        check::matrix(K, "y", out.y.len(), rows, inner, inner)?;
        check::matrix(K, "gate", out.gate.len(), rows, inner, inner)?;
        // SAFETY: all three were checked above.
        unsafe { self.ssd_entry_states(stream, &shape, &inp, scratch)? };
        let cum = scratch.cum.as_view();
        let states = scratch.states.as_view();
        let launch = Launch {
            kernel: K,
            func: &self.f.ssd_chunk_out,
            grid: Grid::Dims(shape.chunk_blocks(), shape.heads, 1),
            block: THREADS,
        };
        let mut args = [
            Arg::In(inp.xbc),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("b_off", shape.b_off()),
            Arg::Int("c_off", shape.c_off()),
            Arg::In(inp.dt),
            Arg::In(&cum),
            Arg::In(inp.d),
            Arg::In(&states),
            Arg::In(out.z),
            Arg::Long("ldz", out.ldz),
            Arg::Out(out.y),
            Arg::Out(out.gate),
            Arg::Int("seq_len", shape.seq_len),
            Arg::Int("heads", shape.heads),
            Arg::Int("head_dim", shape.head_dim),
            Arg::Int("d_state", shape.d_state),
            Arg::Int("heads per group", shape.heads / shape.groups),
            Arg::Int("chunks", shape.chunks()),
        ];
        // SAFETY: matches mamba_ssd_chunk_out(const float* xbc, long long
        // ldu, int b_off, int c_off, const float* dt, const float* s, const
        // float* dpar, const float* st, const float* z, long long ldz,
        // float* y, float* gate, int T, int H, int P, int N, int hpg, int
        // nc); block (bc, h) reads its chunk's rows of xbc (columns <
        // conv_channels), dt / s at [row, h], D[h], its state
        // st[bc][h][P][N], z at [row, h*P + p], and writes y / gate there:
        // all checked above.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// The SSD backward (module docs): d x, d B, d C into `out.dxbc`,
    /// `dL/d dt_raw` and `dL/dA_log`.
    pub fn ssd_backward(
        &self,
        stream: &CudaStream,
        shape: SsdShape,
        inp: SsdInputs<'_>,
        scratch: &mut SsdScratch<'_>,
        out: SsdBackward<'_>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_ssd_bwd";
        self.check_stream(K, stream)?;
        shape.check(K)?;
        inp.check(K, &shape)?;
        scratch.check(K, &shape, false)?;
        let (rows, inner, heads) = (shape.rows(), shape.inner(), shape.heads);
        check::matrix(K, "dy", out.dy.len(), rows, inner, inner)?;
        check::matrix(
            K,
            "dxbc",
            out.dxbc.len(),
            rows,
            shape.conv_channels(),
            out.lddx,
        )?;
        check::matrix(K, "ddt_raw", out.ddt_raw.len(), rows, heads, out.ld_ddt)?;
        check::len(K, "dA_log", out.da_log.len(), heads)?;
        // SAFETY: all three were checked above.
        unsafe { self.ssd_entry_states(stream, &shape, &inp, scratch)? };
        let SsdScratch {
            cum,
            states,
            dstates,
            chunk_m,
            chunk_p,
            chunk_psum,
            ds_in,
            ddt_in,
            rst,
            o_row,
            dsh,
            da_part,
        } = scratch;
        let (cum, states) = (cum.as_view(), states.as_view());
        // SAFETY: dy is [rows, inner] (checked), xbc has the C columns
        // (checked with inp), dstates and cum have the scratch lengths.
        unsafe {
            self.ssd_chunk_states(
                stream,
                &shape,
                (out.dy, inner),
                (inp.xbc, shape.c_off()),
                &inp,
                dstates,
                &cum,
                1,
            )?
        };
        let dstates = dstates.as_view();
        let (nbc, nc) = (shape.chunk_blocks(), shape.chunks());
        let per_chunk = |kernel, func| Launch {
            kernel,
            func,
            grid: Grid::Dims(nbc, heads, 1),
            block: THREADS,
        };
        let mut args = vec![
            Arg::In(inp.xbc),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("b_off", shape.b_off()),
            Arg::Int("c_off", shape.c_off()),
            Arg::In(inp.dt),
            Arg::In(&cum),
            Arg::In(out.dy),
            Arg::Out(chunk_m),
            Arg::Out(chunk_p),
            Arg::Out(ds_in),
            Arg::Out(ddt_in),
        ];
        args.extend(chunk_dims(&shape));
        // SAFETY: matches mamba_ssd_bwd_qq(const float* xbc, long long ldu,
        // int b_off, int c_off, const float* dt, const float* s, const
        // float* dy, float* Mq, float* Pq, float* ds_in, float* ddt_in, int
        // T, int H, int P, int N, int hpg, int nc); block (bc, h) reads its
        // chunk's rows of xbc, dy ([rows, inner]), dt and s, and writes
        // Mq / Pq[bc][h][Q][Q] and ds_in / ddt_in at [row, h]: checked.
        unsafe {
            self.launch(
                stream,
                per_chunk("mamba_ssd_bwd_qq", &self.f.ssd_bwd_qq),
                &mut args,
            )?
        };
        let chunk_m = chunk_m.as_view();
        let mut args = vec![
            Arg::In(inp.xbc),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("b_off", shape.b_off()),
            Arg::Int("c_off", shape.c_off()),
            Arg::In(inp.dt),
            Arg::In(&cum),
            Arg::In(inp.d),
            Arg::In(out.dy),
            Arg::In(&chunk_m),
            Arg::In(&states),
            Arg::In(&dstates),
            Arg::Out(out.dxbc),
            Arg::Long("lddx", out.lddx),
            Arg::Out(rst),
            Arg::Out(o_row),
            Arg::Out(dsh),
        ];
        args.extend(chunk_dims(&shape));
        // SAFETY: matches mamba_ssd_bwd_dx(const float* xbc, long long ldu,
        // int b_off, int c_off, const float* dt, const float* s, const
        // float* dpar, const float* dy, const float* Mq, const float* st,
        // const float* dst, float* dxbc, long long lddx, float* rst, float*
        // o_row, float* dsh, int T, int H, int P, int N, int hpg, int nc);
        // block (bc, h) reads its chunk's rows of xbc (B and C columns of
        // group h / hpg), dy, dt and s, Mq[bc][h], st / dst[bc][h], and
        // writes dxbc's x columns h*P + p of its rows, rst / o_row at [row,
        // h] and dsh[bc, h]: all checked above.
        unsafe {
            self.launch(
                stream,
                per_chunk("mamba_ssd_bwd_dx", &self.f.ssd_bwd_dx),
                &mut args,
            )?
        };
        let chunk_p = chunk_p.as_view();
        let psum_len = shape.group_matrix_len();
        let mut args = [
            Arg::In(&chunk_p),
            Arg::Out(chunk_psum),
            Arg::Int("heads", heads),
            Arg::Int("heads per group", heads / shape.groups),
            Arg::Long("group matrix elements", psum_len),
        ];
        let launch = Launch {
            kernel: "mamba_ssd_bwd_psum",
            func: &self.f.ssd_bwd_psum,
            grid: Grid::Flat { n: psum_len },
            block: THREADS,
        };
        // SAFETY: matches mamba_ssd_bwd_psum(const float* Pq, float* psum,
        // int H, int hpg, long long n); a thread per element idx < n of
        // psum ([nbc][G][Q][Q], checked) reads Pq[bc][h][i][j] for the
        // group's heads, inside chunk_p's checked [nbc][H][Q][Q].
        unsafe { self.launch(stream, launch, &mut args)? };
        let ntn = shape.dbc_tiles();
        let chunk_psum = chunk_psum.as_view();
        let mut args = vec![
            Arg::In(inp.xbc),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("b_off", shape.b_off()),
            Arg::Int("c_off", shape.c_off()),
            Arg::In(inp.dt),
            Arg::In(&cum),
            Arg::In(out.dy),
            Arg::In(&chunk_psum),
            Arg::In(&states),
            Arg::In(&dstates),
            Arg::Out(out.dxbc),
            Arg::Long("lddx", out.lddx),
        ];
        args.extend(chunk_dims(&shape));
        let launch = Launch {
            kernel: "mamba_ssd_bwd_dbc",
            func: &self.f.ssd_bwd_dbc,
            grid: Grid::Dims(nbc, shape.groups, 2 * ntn),
            block: THREADS,
        };
        // SAFETY: matches mamba_ssd_bwd_dbc(const float* xbc, long long
        // ldu, int b_off, int c_off, const float* dt, const float* s, const
        // float* dy, const float* psum, const float* st, const float* dst,
        // float* dxbc, long long lddx, int T, int H, int P, int N, int hpg,
        // int nc); block (bc, g, z) reads its chunk's rows of xbc, dy, dt
        // and s, psum[bc][g], and st / dst[bc][h] of the group's heads, and
        // writes dxbc's B (z even) or C (z odd) columns of group g, states
        // of tile z / 2, at its chunk's rows: inside the lengths checked
        // above.
        unsafe { self.launch(stream, launch, &mut args)? };
        let (ds_in, ddt_in, rst) = (ds_in.as_view(), ddt_in.as_view(), rst.as_view());
        let (o_row, dsh) = (o_row.as_view(), dsh.as_view());
        let mut args = [
            Arg::In(inp.dt),
            Arg::In(&cum),
            Arg::In(inp.a_log),
            Arg::In(&ds_in),
            Arg::In(&ddt_in),
            Arg::In(&rst),
            Arg::In(&o_row),
            Arg::In(&dsh),
            Arg::Out(out.ddt_raw),
            Arg::Long("ld_ddt", out.ld_ddt),
            Arg::Out(da_part),
            Arg::Int("seq_len", shape.seq_len),
            Arg::Int("heads", heads),
            Arg::Int("chunks", nc),
            Arg::Int("chunks of the batch", nbc),
        ];
        let launch = Launch {
            kernel: "mamba_ssd_bwd_dt",
            func: &self.f.ssd_bwd_dt,
            // One warp per (chunk, head).
            grid: Grid::Flat {
                n: nbc * heads * 32,
            },
            block: THREADS,
        };
        // SAFETY: matches mamba_ssd_bwd_dt(const float* dt, const float* s,
        // const float* a_log, const float* ds_in, const float* ddt_in, const
        // float* rst, const float* o_row, const float* dsh, float* ddt_raw,
        // long long ld_ddt, float* da_part, int T, int H, int nc, int nbc);
        // a warp per (chunk, head) reads and writes at [row, h] of its
        // chunk's rows, and reads dsh / writes da_part at [bc, h]: all
        // checked above.
        unsafe { self.launch(stream, launch, &mut args)? };
        let da_part = da_part.as_view();
        let mut args = [
            Arg::In(&da_part),
            Arg::In(inp.a_log),
            Arg::Out(out.da_log),
            Arg::Int("heads", heads),
            Arg::Int("chunks of the batch", nbc),
        ];
        let launch = Launch {
            kernel: "mamba_ssd_dalog",
            func: &self.f.ssd_dalog,
            grid: Grid::Flat { n: heads },
            block: THREADS,
        };
        // SAFETY: matches mamba_ssd_dalog(const float* da_part, const float*
        // a_log, float* da_log, int H, int nbc); a thread per head h reads
        // da_part[bc, h] for bc < nbc and a_log[h], writes da_log[h].
        unsafe { self.launch(stream, launch, &mut args) }
    }
}

/// The size arguments every per-chunk backward kernel ends with.
fn chunk_dims<'a>(shape: &SsdShape) -> [Arg<'a>; 6] {
    [
        Arg::Int("seq_len", shape.seq_len),
        Arg::Int("heads", shape.heads),
        Arg::Int("head_dim", shape.head_dim),
        Arg::Int("d_state", shape.d_state),
        Arg::Int("heads per group", shape.heads / shape.groups),
        Arg::Int("chunks", shape.chunks()),
    ]
}
