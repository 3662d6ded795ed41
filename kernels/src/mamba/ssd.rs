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
//! The chunk products (the chunk states, the chunk outputs and the
//! backward's Q x Q, d x and d B / d C kernels) come in two sets, chosen per
//! call by [`SsdProducts`]: SIMT f32 (`mamba_ssd.cu`) and tf32 tensor cores
//! (`mamba_ssd_tc.cu`, the same arguments and outputs; its chunk states are
//! passed by the kernel that makes them, where the SIMT set stores them for
//! the state pass). The kernels without a product are shared. The kept
//! tensors, the conv output x, B, C ([`SsdInputs::xbc`]), `dy`
//! ([`SsdBackward::dy`]) and the entry states and their gradients
//! ([`SsdScratch::states`]), are f32 or their bf16 rounding alone, all
//! alike ([`SsdStates`]); the tensor-core set's
//! `_h` twins read and store the bf16 ones (those f32 pointers become
//! `unsigned short*`; the SAFETY arguments below, which name the f32
//! kernels, hold for them as written, over the same elements).
//!
//! The kernels' twin on the host is `kernels/emu/ssd_check.cpp` (the same
//! sources compiled as C++ and checked against a sequential f64 recurrence,
//! each set at its tolerances, `ssd_emu_tests.rs`); on the device,
//! `mamba-train/tests/cuda_mamba2.rs` pins the trainer's use of them to the
//! CPU model.
//!
//! The shapes and buffers the launches take, and their checks, are in
//! `ssd_shape.rs`; the two sets of product kernels in `ssd_products.rs`. Over 450 lines: the launches of one algorithm in their
//! order, each with the SAFETY argument it rests on.

use cudarc::driver::{CudaFunction, CudaStream, CudaView};

use super::check;
use super::launcher::{Arg, Grid, Launch};
use super::ssd_products::{ChunkStates, Products};
use super::ssd_shape::{STATE_SCAN_SMEM_BYTES, STATE_TILE_N, STATE_TILE_P, THREADS};
use super::{MambaKernels, Stored};
use crate::error::KernelError;

pub use super::ssd_products::SsdProducts;
pub use super::ssd_shape::{
    SsdBackward, SsdForward, SsdInputs, SsdScratch, SsdScratchLens, SsdShape, SsdStates, SSD_CHUNK,
};

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
        products: &Products<'_>,
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
        let cum = scratch.cum.as_view();
        // SAFETY: x is the checked conv output (its x columns at ldu, its B
        // columns from b_off), states and cum have the scratch lengths.
        unsafe {
            self.ssd_chunk_states(
                stream,
                products,
                shape,
                (inp.xbc, inp.ldu),
                shape.b_off(),
                inp,
                &mut scratch.states,
                &cum,
                0,
            )
        }
    }

    /// The entry states (mode 0: `X = x`, `Y = B`, forward pass) or their
    /// gradients (mode 1: `X = dy`, `Y = C`, reverse pass) into `out`, by
    /// the products' [`ChunkStates`]: `mamba_ssd_chunk_state` then
    /// `mamba_ssd_state_pass`, or `mamba_ssd_state_scan_tc` alone. Y is
    /// read from `inp.xbc`'s columns from `y_off`.
    ///
    /// # Safety
    /// `x` must hold `[rows, inner]` at leading dimension `ldx`, kept as
    /// the products' set keeps them (bf16 for the `_h` set); `inp.xbc`'s
    /// columns `y_off + g * d_state + n` must exist; `out` and `cum` the
    /// lengths of [`SsdShape::scratch_lens`]: the callers check them.
    #[allow(clippy::too_many_arguments)]
    unsafe fn ssd_chunk_states(
        &self,
        stream: &CudaStream,
        products: &Products<'_>,
        shape: &SsdShape,
        (x, ldx): (Stored<'_>, usize),
        y_off: usize,
        inp: &SsdInputs<'_>,
        out: &mut SsdStates<'_>,
        cum: &CudaView<'_, f32>,
        mode: usize,
    ) -> Result<(), KernelError> {
        let (nbc, nc) = (shape.chunk_blocks(), shape.chunks());
        let tiles = shape.head_dim.div_ceil(STATE_TILE_P) * shape.d_state.div_ceil(STATE_TILE_N);
        let launch = match products.states {
            ChunkStates::TwoPass((kernel, func)) => Launch {
                kernel,
                func,
                grid: Grid::Dims(nbc, shape.heads, tiles),
                block: THREADS,
            },
            ChunkStates::Scan((kernel, func)) => {
                let mut cfg = check::grid(kernel, (shape.batch, shape.heads, tiles), THREADS)?;
                cfg.shared_mem_bytes = STATE_SCAN_SMEM_BYTES as u32;
                Launch {
                    kernel,
                    func,
                    grid: Grid::Checked(cfg),
                    block: THREADS,
                }
            }
        };
        let mut args = [
            x.kept_arg(),
            Arg::Long("ldx", ldx),
            inp.xbc.kept_arg(),
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
        // int nc, int mode), whose signature mamba_ssd_state_scan_tc shares
        // (X, Y and out `unsigned short*` in its _h twin, which products()
        // picks exactly when they are all kept in bf16: the callers check
        // x's type, kept_bf16 xbc's and the states');
        // block (bc, h, tile) of the one, or (b, h, tile) of the other for
        // each chunk bc = b * nc + c in turn, reads X and Y at the chunk's
        // rows (columns h*P + p < inner, y_off + g*N + n), dt and s at [row,
        // h], and writes out[bc][h][p][n] (p < P, n < N): the extents of
        // this function's contract. The scan's dynamic shared memory is the
        // size its attribute was raised to when the module was loaded.
        unsafe { self.launch(stream, launch, &mut args)? };
        if matches!(products.states, ChunkStates::Scan(_)) {
            return Ok(());
        }
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

    /// The SSD forward: `y` and `gate` from `inp` (module docs), its
    /// products by `products`.
    pub fn ssd_forward(
        &self,
        stream: &CudaStream,
        products: SsdProducts,
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
        let bf16_kept = inp.kept_bf16(K, &scratch.states)?;
        let (rows, inner) = (shape.rows(), shape.inner());
        check::matrix(K, "z", out.z.len(), rows, inner, out.ldz)?;
        let n = check::mul(K, "y", rows, inner)?;
        out.y
            .check_each("y", |what, have| check::len(K, what, have, n))?;
        out.gate
            .check_each("gate", |what, have| check::len(K, what, have, n))?;
        let products = self.products(K, products, bf16_kept)?;
        if products.cb.is_some() {
            let need = shape.group_matrix_len();
            check::len(K, "chunk_psum", scratch.chunk_psum.len(), need)?;
        }
        // SAFETY: all three were checked above, and chunk_psum's length for
        // the products that write it.
        unsafe {
            self.ssd_entry_states(stream, &products, &shape, &inp, scratch)?;
            self.ssd_group_cb(stream, &products, &shape, &inp, &mut scratch.chunk_psum)?;
        }
        let cum = scratch.cum.as_view();
        let states = scratch.states.as_view();
        let group_cb = scratch.chunk_psum.as_view();
        let (kernel, func) = products.chunk_out;
        let mut cfg = check::grid(kernel, (shape.chunk_blocks(), shape.heads, 1), THREADS)?;
        cfg.shared_mem_bytes = products.staged_smem;
        let launch = Launch {
            kernel,
            func,
            grid: Grid::Checked(cfg),
            block: THREADS,
        };
        let [z_f32, z_bf16] = out.z.args();
        let (mut y, mut gate) = (out.y, out.gate);
        let [y_f32, y_bf16] = y.args();
        let [gate_f32, gate_bf16] = gate.args();
        let mut args = [
            inp.xbc.kept_arg(),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("b_off", shape.b_off()),
            Arg::Int("c_off", shape.c_off()),
            Arg::In(inp.dt),
            Arg::In(&cum),
            Arg::In(inp.d),
            Arg::In(&states),
            z_f32,
            z_bf16,
            Arg::Long("ldz", out.ldz),
            y_f32,
            y_bf16,
            gate_f32,
            gate_bf16,
            Arg::Int("seq_len", shape.seq_len),
            Arg::Int("heads", shape.heads),
            Arg::Int("head_dim", shape.head_dim),
            Arg::Int("d_state", shape.d_state),
            Arg::Int("heads per group", shape.heads / shape.groups),
            Arg::Int("chunks", shape.chunks()),
        ]
        .into_iter()
        .chain(products.cb.map(|_| Arg::In(&group_cb)))
        .collect::<Vec<_>>();
        // SAFETY: matches mamba_ssd_chunk_out(const float* xbc, long long
        // ldu, int b_off, int c_off, const float* dt, const float* s, const
        // float* dpar, const float* st, const float* z, const unsigned
        // short* zh (one of the two null: Stored), long long ldz, float* y,
        // unsigned short* yh, float* gate, unsigned short* gateh (either of
        // each pair null: Store), int T, int H, int P, int N, int hpg, int
        // nc) (xbc and st `const unsigned short*` in the _h twin, picked
        // exactly when both are kept in bf16); block (bc, h) reads its
        // chunk's rows of xbc (columns < conv_channels), dt / s at [row, h],
        // D[h], its state
        // st[bc][h][P][N], z at [row, h*P + p], and writes y / gate there:
        // all checked above. Its dynamic shared memory (none for the SIMT
        // kernel) is the size the tensor-core kernel's attribute was raised
        // to when the module was loaded.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// The SSD backward (module docs): d x, d B, d C into `out.dxbc`,
    /// `dL/d dt_raw` and `dL/dA_log`, its products by `products` (those of
    /// the forward whose gradients these are).
    pub fn ssd_backward(
        &self,
        stream: &CudaStream,
        products: SsdProducts,
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
        let bf16_kept = inp.kept_bf16(K, &scratch.states)?;
        let (rows, inner, heads) = (shape.rows(), shape.inner(), shape.heads);
        check::matrix(K, "dy", out.dy.len(), rows, inner, inner)?;
        if out.dy.is_bf16() != bf16_kept {
            return Err(KernelError::invalid(
                K,
                "dy must be kept as the conv output xbc and the states are (all f32 or all \
                 bf16)",
            ));
        }
        check::matrix(
            K,
            "dxbc",
            out.dxbc.len(),
            rows,
            shape.conv_channels(),
            out.lddx,
        )?;
        out.ddt_raw.check_each("ddt_raw", |what, have| {
            check::matrix(K, what, have, rows, heads, out.ld_ddt)
        })?;
        check::len(K, "dA_log", out.da_log.len(), heads)?;
        let products = self.products(K, products, bf16_kept)?;
        // SAFETY: all three were checked above.
        unsafe { self.ssd_entry_states(stream, &products, &shape, &inp, scratch)? };
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
                &products,
                &shape,
                (out.dy, inner),
                shape.c_off(),
                &inp,
                dstates,
                &cum,
                1,
            )?
        };
        let dstates = dstates.as_view();
        // SAFETY: checked above (chunk_psum has the group matrices' length).
        unsafe { self.ssd_group_cb(stream, &products, &shape, &inp, chunk_psum)? };
        let (nbc, nc) = (shape.chunk_blocks(), shape.chunks());
        fn per_chunk<'f>(
            (kernel, func): (&'static str, &'f CudaFunction),
            (nbc, heads): (usize, usize),
            smem: u32,
        ) -> Result<Launch<'f>, KernelError> {
            let mut cfg = check::grid(kernel, (nbc, heads, 1), THREADS)?;
            cfg.shared_mem_bytes = smem;
            Ok(Launch {
                kernel,
                func,
                grid: Grid::Checked(cfg),
                block: THREADS,
            })
        }
        let mut args = vec![
            inp.xbc.kept_arg(),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("b_off", shape.b_off()),
            Arg::Int("c_off", shape.c_off()),
            Arg::In(inp.dt),
            Arg::In(&cum),
            out.dy.kept_arg(),
            Arg::Out(chunk_m),
            Arg::Out(chunk_p),
            Arg::Out(ds_in),
            Arg::Out(ddt_in),
        ];
        args.extend(chunk_dims(&shape));
        let group_cb = chunk_psum.as_view();
        args.extend(products.cb.map(|_| Arg::In(&group_cb)));
        let launch = per_chunk(products.bwd_qq, (nbc, heads), 0)?;
        // SAFETY: matches mamba_ssd_bwd_qq(const float* xbc, long long ldu,
        // int b_off, int c_off, const float* dt, const float* s, const
        // float* dy, float* Mq, float* Pq, float* ds_in, float* ddt_in, int
        // T, int H, int P, int N, int hpg, int nc); block (bc, h) reads its
        // chunk's rows of xbc, dy ([rows, inner]), dt and s, and writes
        // Mq / Pq[bc][h][Q][Q] and ds_in / ddt_in at [row, h]: checked.
        unsafe { self.launch(stream, launch, &mut args)? };
        let chunk_m = chunk_m.as_view();
        let mut args = vec![
            inp.xbc.kept_arg(),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("b_off", shape.b_off()),
            Arg::Int("c_off", shape.c_off()),
            Arg::In(inp.dt),
            Arg::In(&cum),
            Arg::In(inp.d),
            out.dy.kept_arg(),
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
        let launch = per_chunk(products.bwd_dx, (nbc, heads), products.staged_smem)?;
        // SAFETY: matches mamba_ssd_bwd_dx(const float* xbc, long long ldu,
        // int b_off, int c_off, const float* dt, const float* s, const
        // float* dpar, const float* dy, const float* Mq, const float* st,
        // const float* dst, float* dxbc, long long lddx, float* rst, float*
        // o_row, float* dsh, int T, int H, int P, int N, int hpg, int nc);
        // block (bc, h) reads its chunk's rows of xbc (B and C columns of
        // group h / hpg), dy, dt and s, Mq[bc][h], st / dst[bc][h], and
        // writes dxbc's x columns h*P + p of its rows, rst / o_row at [row,
        // h] and dsh[bc, h]: all checked above. The tensor-core kernel's
        // dynamic shared memory is the size its attribute was raised to when
        // the module was loaded.
        unsafe { self.launch(stream, launch, &mut args)? };
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
            inp.xbc.kept_arg(),
            Arg::Long("ldu", inp.ldu),
            Arg::Int("b_off", shape.b_off()),
            Arg::Int("c_off", shape.c_off()),
            Arg::In(inp.dt),
            Arg::In(&cum),
            out.dy.kept_arg(),
            Arg::In(&chunk_psum),
            Arg::In(&states),
            Arg::In(&dstates),
            Arg::Out(out.dxbc),
            Arg::Long("lddx", out.lddx),
        ];
        args.extend(chunk_dims(&shape));
        let launch = Launch {
            kernel: products.bwd_dbc.0,
            func: products.bwd_dbc.1,
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
        let mut ddt_raw = out.ddt_raw;
        let [ddt_f32, ddt_bf16] = ddt_raw.args();
        let mut args = [
            Arg::In(inp.dt),
            Arg::In(&cum),
            Arg::In(inp.a_log),
            Arg::In(&ds_in),
            Arg::In(&ddt_in),
            Arg::In(&rst),
            Arg::In(&o_row),
            Arg::In(&dsh),
            ddt_f32,
            ddt_bf16,
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
        // unsigned short* ddt_h (either null: Store), long long ld_ddt,
        // float* da_part, int T, int H, int nc, int nbc); a warp per (chunk,
        // head) reads and writes at [row, h] of its chunk's rows (each given
        // ddt output checked at ld_ddt), and reads dsh / writes da_part at
        // [bc, h]: all checked above.
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
