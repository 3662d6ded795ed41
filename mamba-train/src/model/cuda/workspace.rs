//! Device buffers of one forward/backward shape: the activations the
//! backward pass reads, and the scratch both passes share.
//!
//! In bf16 runs every GEMM operand has one bf16 copy, made where the operand
//! is made, that all the GEMMs reading it share (forward and backward): the
//! kernel producing an activation stores the copy itself ([`Store`]), and
//! only cuBLAS outputs (x_proj's and its gradient) are cast afterwards. An
//! activation read by GEMMs only (the norm output, the gated output, a loss
//! chunk's logits gradient) is stored in bf16 only ([`ActBuf::Bf16`]).
//! The copies round exactly as a GEMM casting its own operand would (the
//! same device function as `mamba_cast_bf16`), so the bits are those of
//! casting per GEMM; what changes is the passes over memory and the bytes
//! kept.
//!
//! bf16 runs also keep the block's other activations in bf16 alone (SPEC:
//! bf16 is the type of stored activations): in_proj's output `xz` (cuBLAS
//! writes it in bf16), `u` (the conv output, also x_proj's operand), `dt`
//! and `y`, each rounded once where it is made and read back widened to
//! f32, the scan's state and every sum staying f32. This changes the values
//! the later ops see (one bf16 rounding each), so it is a precision choice,
//! not a layout one: [`WorkspaceOptions::bf16_acts`] (on by default; off
//! keeps them in f32, the bits of the builds before it). A `d_inner` that
//! is odd keeps them in f32 (the scan stages bf16 columns two channels a
//! copy). Mamba-2 blocks keep their in_proj output `zx`, scan output `y`
//! and gated-norm input `g` in bf16 alone the same way, at any width
//! ([`SsdActs`]).
//!
//! Two activations are not kept per block at all, because remaking them is
//! a pass over memory that costs less than keeping them: the norm output
//! `xn` (in_proj's input; the backward runs the block's RMSNorm again on
//! the residual stream, which every block keeps) and the gated output `g`
//! (out_proj's input; the gate's backward remakes it with the device
//! function the scan's forward used, from the same kept `y` and `z`). Each
//! lives in one buffer all blocks share ([`Workspace::xn`],
//! [`Workspace::g`]), and the remade values are the same bits as the
//! forward's, so neither changes a result.
//!
//! Sized for one `(batch, seq_len)`; [`super::CudaModel`] rebuilds it when a
//! batch of another shape arrives (dropping the old one first, so the peak
//! is one workspace). Every buffer is zero-filled at allocation, so no
//! kernel can ever read uninitialised memory; after that each is fully
//! overwritten by the step that produces it before any step reads it.
//!
//! Over 450 lines: one struct holding every device buffer of a shape, with
//! the one allocation path that sizes them all (per precision, with and
//! without recompute); splitting it would split the sizes from the buffers.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, ValidAsZeroBits};
use kernels::mamba::{
    DeviceTokenCsr, LossScale, MambaKernels, ScanShape, SsdScratch, SsdScratchLens, SsdShape,
    SsdStates, Store, Stored, TokenCsr,
};

use super::blas::{Elems, GemmOut};
use super::graph::PassGraph;
use crate::config::ModelConfig;
use crate::error::{Result, TrainError};

/// An activation kept in f32, or in bf16 runs as its bf16 rounding only
/// (stored by its producer, see the module docs).
pub(crate) enum ActBuf {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl ActBuf {
    /// The elements the GEMMs read.
    pub fn elems(&self) -> Elems<'_> {
        match self {
            ActBuf::F32(x) => Elems::F32(x.as_view()),
            ActBuf::Bf16(h) => Elems::Bf16(h.as_view()),
        }
    }

    /// Where its producer stores it: the f32 values (with their bf16 copy
    /// into `copy` when given), or only their bf16 rounding (`copy` unused).
    pub fn produce_with<'b>(&'b mut self, copy: Option<CudaViewMut<'b, u16>>) -> Store<'b> {
        match self {
            ActBuf::F32(x) => Store::f32_and(x.as_view_mut(), copy),
            ActBuf::Bf16(h) => Store::Bf16(h.as_view_mut()),
        }
    }

    /// Lent to the SSD kernels as the states they keep
    /// ([`SsdStates`]): f32, or bf16 alone.
    pub fn ssd_states(&mut self) -> SsdStates<'_> {
        match self {
            ActBuf::F32(x) => SsdStates::F32(x.as_view_mut()),
            ActBuf::Bf16(h) => SsdStates::Bf16(h.as_view_mut()),
        }
    }

    /// [`Self::produce_with`] without a copy.
    pub fn produce(&mut self) -> Store<'_> {
        self.produce_with(None)
    }

    /// [`Self::produce`] of its elements from `start` on (a column block
    /// of a matrix: dz, the second half of in_proj's output gradient).
    pub fn produce_from(&mut self, start: usize) -> Store<'_> {
        match self {
            ActBuf::F32(x) => Store::F32(x.slice_mut(start..)),
            ActBuf::Bf16(h) => Store::Bf16(h.slice_mut(start..)),
        }
    }

    /// A view of it, to lend kernels as [`Stored`] ([`ActView::stored`]).
    pub fn view(&self) -> ActView<'_> {
        self.view_from(0)
    }

    /// A view of its elements from `start` on (a column block of a matrix:
    /// z, the second half of in_proj's output).
    pub fn view_from(&self, start: usize) -> ActView<'_> {
        match self {
            ActBuf::F32(x) => ActView::F32(x.slice(start..)),
            ActBuf::Bf16(h) => ActView::Bf16(h.slice(start..)),
        }
    }

    /// Where a GEMM making it writes it (bf16 alone: cuBLAS rounds).
    pub fn gemm_out(&mut self) -> GemmOut<'_> {
        match self {
            ActBuf::F32(x) => GemmOut::F32(x.as_view_mut()),
            ActBuf::Bf16(h) => GemmOut::Bf16(h.as_view_mut()),
        }
    }
}

/// A view of an [`ActBuf`], owned so that [`Self::stored`] can lend the
/// `&CudaView` that kernels and GEMM operands take.
pub(crate) enum ActView<'a> {
    F32(CudaView<'a, f32>),
    Bf16(CudaView<'a, u16>),
}

impl ActView<'_> {
    /// As a kernel input.
    pub fn stored(&self) -> Stored<'_> {
        match self {
            ActView::F32(v) => Stored::F32(v),
            ActView::Bf16(v) => Stored::Bf16(v),
        }
    }
}

/// What one block's backward pass needs from its forward pass.
pub(crate) struct LayerActs {
    /// 1/rms of each row of the block's input, `[rows]`.
    pub rstd: CudaSlice<f32>,
    /// in_proj output, `[rows, 2 d_inner]`: x then z (bf16 alone with
    /// `bf16_acts`).
    pub xz: ActBuf,
    /// `SiLU(conv(x))`, `[rows, d_inner]` (the scan's and x_proj's input):
    /// bf16 alone with `bf16_acts`.
    pub u: ActBuf,
    /// bf16 runs keeping `u` in f32: its bf16 copy (x_proj's operand).
    pub u_h: Option<CudaSlice<u16>>,
    /// x_proj output, `[rows, dt_rank + 2 d_state]`: dt_raw, B, C.
    pub dbc: CudaSlice<f32>,
    /// bf16 runs: `dbc`'s bf16 copy (dt_proj reads its dt_raw columns).
    pub dbc_h: Option<CudaSlice<u16>>,
    /// `softplus(dt_proj(dt_raw) + bias)`, `[rows, d_inner]` (bf16 alone
    /// with `bf16_acts`, dt_proj's f32 output then passing through
    /// [`Workspace::ddtr`] on the way).
    pub dt: ActBuf,
    /// Scan output `C.h + D u`, `[rows, d_inner]` (bf16 alone with
    /// `bf16_acts`).
    pub y: ActBuf,
    /// The scan's chunk entry states ([`ScanShape::state_len`]).
    pub hin: CudaSlice<f32>,
}

/// The blocks' activations: one set per block, or with `--recompute` one
/// set that all blocks share. Shared, the forward pass leaves the last
/// block's activations in it and the backward pass recomputes each earlier
/// block's from its input on the residual stream (kept for every block)
/// just before its backward: one block's activations in memory instead of
/// `n_layer`, for one more forward pass of the blocks. The recomputation
/// runs the same kernels on the same inputs, so the bits are the same.
pub(crate) struct BlockActs<A = LayerActs> {
    sets: Vec<A>,
    shared: bool,
    /// The block whose activations the sets hold when shared (`None`: none
    /// yet); the forward pass sets it, the backward's recomputation too.
    pub resident: Option<usize>,
}

impl<A> BlockActs<A> {
    /// `sets` (one per block, or one shared when `shared`), none resident.
    fn new(sets: Vec<A>, shared: bool) -> Self {
        BlockActs {
            sets,
            shared,
            resident: None,
        }
    }

    /// Whether one set is shared by all blocks (`--recompute`).
    pub fn shared(&self) -> bool {
        self.shared
    }

    /// Block `l`'s activations (the shared set when shared: see
    /// `resident` for whose they are).
    pub fn slot(&self, l: usize) -> &A {
        &self.sets[if self.shared { 0 } else { l }]
    }

    /// Block `l`'s activations, to write.
    pub fn slot_mut(&mut self, l: usize) -> &mut A {
        &mut self.sets[if self.shared { 0 } else { l }]
    }
}

/// What one Mamba-2 block's backward pass needs from its forward pass
/// (`cd = d_inner + 2 n_groups d_state` conv channels, in_proj width `w =
/// d_inner + cd + heads`). `zx`, `uc`, `y` and `g` are bf16 alone in bf16
/// runs with `bf16_acts` (f32 otherwise); `dt` is f32 in every precision.
/// The scan keeps nothing of its own: its backward recomputes the chunk
/// states (into the shared [`SsdScanScratch`], in bf16 in those same runs,
/// as `uc`: [`kernels::mamba::SsdStates`]).
pub(crate) struct SsdActs {
    /// 1/rms of each row of the block's input, `[rows]`.
    pub rstd: CudaSlice<f32>,
    /// in_proj output, `[rows, w]`: z, then x, B, C, then dt_raw.
    pub zx: ActBuf,
    /// `SiLU(conv(x | B | C))`, `[rows, cd]` (the scan's x, B and C).
    pub uc: ActBuf,
    /// `softplus(dt_raw + dt_bias)` per head, `[rows, heads]`.
    pub dt: CudaSlice<f32>,
    /// Scan output `y` (with `D x`), `[rows, d_inner]` (the gate's backward).
    pub y: ActBuf,
    /// `y SiLU(z)`, `[rows, d_inner]`: the gated norm's input.
    pub g: ActBuf,
    /// 1/rms of each row of `g`, `[rows]`.
    pub rstd_g: CudaSlice<f32>,
}

/// The SSD kernels' scratch ([`kernels::mamba::SsdScratch`]): shared by
/// every block, rewritten by each scan call before it is read. The entry
/// states and their gradients, its largest buffers, are kept as the
/// block's activations are: bf16 alone in bf16 runs with `bf16_acts`
/// ([`kernels::mamba::SsdStates`]), f32 otherwise.
pub(crate) struct SsdScanScratch {
    cum: CudaSlice<f32>,
    states: ActBuf,
    dstates: ActBuf,
    chunk_m: CudaSlice<f32>,
    chunk_p: CudaSlice<f32>,
    chunk_psum: CudaSlice<f32>,
    ds_in: CudaSlice<f32>,
    ddt_in: CudaSlice<f32>,
    rst: CudaSlice<f32>,
    o_row: CudaSlice<f32>,
    dsh: CudaSlice<f32>,
    da_part: CudaSlice<f32>,
}

impl SsdScanScratch {
    /// Buffers of the lengths `lens` gives; the states in bf16 when
    /// `half_states`.
    fn new(a: &mut Alloc<'_>, lens: SsdScratchLens, half_states: bool) -> Result<Self> {
        Ok(SsdScanScratch {
            cum: a.zeros("SSD decay sums", lens.row_heads)?,
            states: a.act(half_states, "SSD chunk states", lens.states)?,
            dstates: a.act(half_states, "SSD chunk state gradients", lens.states)?,
            chunk_m: a.zeros("SSD chunk weights", lens.chunk_matrix)?,
            chunk_p: a.zeros("SSD chunk B/C weights", lens.chunk_matrix)?,
            chunk_psum: a.zeros("SSD chunk B/C weights per group", lens.group_matrix)?,
            ds_in: a.zeros("SSD decay-sum gradients", lens.row_heads)?,
            ddt_in: a.zeros("SSD dt gradients (diagonal)", lens.row_heads)?,
            rst: a.zeros("SSD dt gradients (state)", lens.row_heads)?,
            o_row: a.zeros("SSD dt gradients (output state)", lens.row_heads)?,
            dsh: a.zeros("SSD state-decay sums", lens.chunk_heads)?,
            da_part: a.zeros("SSD dA partials", lens.chunk_heads)?,
        })
    }

    /// The views one scan call takes.
    pub fn views(&mut self) -> SsdScratch<'_> {
        SsdScratch {
            cum: self.cum.as_view_mut(),
            states: self.states.ssd_states(),
            dstates: self.dstates.ssd_states(),
            chunk_m: self.chunk_m.as_view_mut(),
            chunk_p: self.chunk_p.as_view_mut(),
            chunk_psum: self.chunk_psum.as_view_mut(),
            ds_in: self.ds_in.as_view_mut(),
            ddt_in: self.ddt_in.as_view_mut(),
            rst: self.rst.as_view_mut(),
            o_row: self.o_row.as_view_mut(),
            dsh: self.dsh.as_view_mut(),
            da_part: self.da_part.as_view_mut(),
        }
    }
}

/// The Mamba-2 backward's own gradient buffers, shared by every block.
pub(crate) struct SsdGradBufs {
    /// bf16 runs: the scan output's gradient `[rows, d_inner]` kept in bf16
    /// alone, as the SSD keeps its other tensors (the gated norm's backward
    /// writes it; the SSD's backward and D's column sum read it); otherwise
    /// it is [`Workspace::dy`].
    pub dy_h: Option<CudaSlice<u16>>,
    /// The gradient of `uc`, `[rows, cd]` (the scan writes its x, B and C
    /// columns; the conv's one-pass backward reads it). The gradient of
    /// `g` has no buffer: the gated norm's backward hands it to the gate's
    /// in registers (`MambaKernels::gated_norm_bwd`).
    pub duc: CudaSlice<f32>,
    /// d D per channel, before its sums per head.
    pub dd_e: CudaSlice<f32>,
    /// in_proj's output gradient, `[rows, w]`, f32 (the scan writes its dt
    /// columns, which dt_bias's column sum reads; in bf16 runs only those).
    pub dzx: CudaSlice<f32>,
    /// bf16 runs: `dzx`'s bf16 rounding, which in_proj's two backward GEMMs
    /// share, written by the kernels that make its columns (the gate's dz
    /// in the gated norm's backward, the conv's input gradient, the scan's
    /// d dt_raw beside its f32), not cast
    /// from `dzx`. (`dzx` could then shrink to its dt columns; it keeps
    /// their leading dimension `w` so one store writes both.)
    pub dzx_h: Option<CudaSlice<u16>>,
    /// The gated norm's 1/rms as the remade norm writes it (the kept
    /// `rstd_g` bits again; the kept buffer is only read).
    pub rstd_again: CudaSlice<f32>,
}

/// The Mamba-2 blocks' buffers beside the ones both architectures share
/// ([`Workspace::ssd`]).
pub(crate) struct SsdBufs {
    pub acts: BlockActs<SsdActs>,
    pub scan: SsdScanScratch,
    pub grads: SsdGradBufs,
}

/// How a workspace is laid out, besides the batch shape (the model's
/// settings; a change rebuilds the workspace at the next pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct WorkspaceOptions {
    /// Rows of one loss chunk (at least 1).
    pub loss_chunk_rows: usize,
    /// One set of block activations for all blocks ([`BlockActs`]).
    pub recompute: bool,
    /// bf16 runs: the shared bf16 copies of the module docs; without them
    /// each GEMM casts its own operands (the reference path: the same bits,
    /// more casts and more memory).
    pub bf16_copies: bool,
    /// bf16 runs: `u`, `dt` and `y` kept in bf16 alone (the module docs);
    /// off, in f32.
    pub bf16_acts: bool,
}

/// All device buffers of one shape.
pub(crate) struct Workspace {
    pub batch: usize,
    pub seq_len: usize,
    pub options: WorkspaceOptions,
    /// Residual stream: `resid[l]` enters block `l`, `resid[n_layer]` leaves
    /// the last one; each `[rows, d_model]`.
    pub resid: Vec<CudaSlice<f32>>,
    /// Mamba-1 blocks' activations (no sets in a Mamba-2 workspace).
    pub acts: BlockActs,
    /// Mamba-2's own buffers (`None` for Mamba-1).
    pub ssd: Option<SsdBufs>,
    /// One block's RMSNorm output `[rows, d_model]` (in_proj's input; bf16
    /// alone in bf16 runs), shared by every block (module docs).
    pub xn: ActBuf,
    /// The block whose norm output `xn` holds (`None`: none yet).
    pub xn_of: Option<usize>,
    /// One block's gated output `y SiLU(z)` `[rows, d_inner]` (out_proj's
    /// input; bf16 alone in bf16 runs): the forward's scan writes it, the
    /// gate's backward writes it again (module docs). In a Mamba-2
    /// workspace it holds out_proj's input too, the gated norm's output,
    /// remade in the backward from the kept `SsdActs::g`.
    pub g: ActBuf,
    /// Final norm's 1/rms `[rows]` and output `[rows, d_model]`.
    pub rstd_f: CudaSlice<f32>,
    pub xf: CudaSlice<f32>,
    /// bf16 runs: `xf`'s bf16 copy (the head's GEMMs read it).
    pub xf_h: Option<CudaSlice<u16>>,
    /// bf16 runs: the bf16 copies of output gradients the two GEMMs of one
    /// linear layer's backward share: `dres`'s (`[rows, d_model]`),
    /// `ddtr`'s (`[rows, d_inner]`),
    /// `ddbc`'s (`[rows, dt_rank + 2 d_state]`), and one loss chunk's
    /// logits gradient (`[loss_rows, vocab]`, the only copy of it: the
    /// cross-entropy stores it there and leaves the logits).
    pub dres_h: Option<CudaSlice<u16>>,
    pub ddtr_h: Option<CudaSlice<u16>>,
    pub ddbc_h: Option<CudaSlice<u16>>,
    pub dlogits_h: Option<CudaSlice<u16>>,
    /// Rows of one loss chunk (`min(rows, the model's loss chunk)`): the
    /// head and the loss run over the rows this many at a time
    /// ([`super::head`]).
    pub loss_rows: usize,
    /// One chunk's logits `[loss_rows, vocab]`; the cross-entropy turns them
    /// into their gradient in place (into `dlogits_h` instead in bf16 runs).
    pub logits: CudaSlice<f32>,
    /// The scan backward's d A partials ([`ScanShape::da_partial_len`]).
    pub da_part: CudaSlice<f32>,
    /// d B / d C partials ([`ScanShape::dbc_partial_len`]).
    pub dbc_part: CudaSlice<f32>,
    /// The scan's per-segment scratch ([`ScanShape::segment_scratch_len`]),
    /// shared by every block's forward and backward scan.
    pub scan_seg: CudaSlice<f32>,
    /// Column-sum partials (the largest any column sum of the model needs).
    pub colsum: CudaSlice<f32>,
    pub row_loss: CudaSlice<f32>,
    pub loss: CudaSlice<f32>,
    /// Backward buffers, reused by every block.
    pub dres: CudaSlice<f32>,
    pub dxn: CudaSlice<f32>,
    pub dout: CudaSlice<f32>,
    /// The scan output's gradient, `[rows, d_inner]` (one element when a
    /// Mamba-2 bf16 run keeps it in bf16 alone: [`SsdGradBufs::dy_h`]).
    pub dy: CudaSlice<f32>,
    /// in_proj's output gradient `[rows, 2 d_inner]` (dx from the conv's
    /// backward, dz from the gate's): only in_proj's two backward GEMMs read
    /// it, so bf16 runs keep it in bf16 alone, as the GEMMs read it (the
    /// kernels store the rounding they would have stored as its copy).
    pub dxz: ActBuf,
    pub ddtr: CudaSlice<f32>,
    pub du: CudaSlice<f32>,
    pub ddbc: CudaSlice<f32>,
    /// The batch on the device: its tokens, targets, the tokens grouped
    /// for the embedding's backward (padded to the shape's capacity) and
    /// the loss scale ([`kernels::mamba::LossScale`]). Every pass uploads
    /// into these same buffers, so a captured graph of the step reads each
    /// batch from the addresses it was captured with.
    pub tokens: CudaSlice<u32>,
    pub targets: CudaSlice<i32>,
    pub csr: DeviceTokenCsr,
    pub loss_scale: CudaSlice<f32>,
    /// The training pass's CUDA graph over these buffers (`graph`), dropped
    /// with them.
    pub graph: PassGraph,
    /// Bytes allocated above.
    pub bytes: usize,
}

/// Allocates zero-filled buffers and counts their bytes.
struct Alloc<'a> {
    stream: &'a Arc<CudaStream>,
    bytes: usize,
}

impl Alloc<'_> {
    /// The token CSR of a batch of `rows` tokens over `vocab`.
    fn csr(&mut self, rows: usize, vocab: usize) -> Result<DeviceTokenCsr> {
        let csr = DeviceTokenCsr::alloc(self.stream, rows, vocab)?;
        let cap = TokenCsr::capacity(rows, vocab);
        self.bytes += (cap.max(1) + cap + 1 + rows.max(1)) * std::mem::size_of::<u32>();
        Ok(csr)
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &mut self,
        what: &str,
        len: usize,
    ) -> Result<CudaSlice<T>> {
        let len = len.max(1);
        let s = self
            .stream
            .alloc_zeros::<T>(len)
            .map_err(|e| TrainError::Cuda {
                what: format!("allocating {what} ({len} elements)"),
                detail: format!("{e}; the batch may be too large for this GPU's memory"),
            })?;
        self.bytes += len * std::mem::size_of::<T>();
        Ok(s)
    }

    /// An activation of `len` elements: bf16 alone when `half`, else f32.
    fn act(&mut self, half: bool, what: &str, len: usize) -> Result<ActBuf> {
        Ok(if half {
            ActBuf::Bf16(self.zeros(&format!("{what} (bf16)"), len)?)
        } else {
            ActBuf::F32(self.zeros(what, len)?)
        })
    }

    /// [`Self::zeros`] when `wanted`, nothing otherwise.
    fn zeros_if<T: DeviceRepr + ValidAsZeroBits>(
        &mut self,
        wanted: bool,
        what: &str,
        len: usize,
    ) -> Result<Option<CudaSlice<T>>> {
        wanted.then(|| self.zeros(what, len)).transpose()
    }
}

impl Workspace {
    /// The scan's extents for this model and shape.
    pub fn scan_shape(cfg: &ModelConfig, batch: usize, seq_len: usize) -> ScanShape {
        ScanShape {
            batch,
            seq_len,
            d_inner: cfg.d_inner(),
            d_state: cfg.d_state,
        }
    }

    /// Allocate every buffer for `batch` sequences of `seq_len` tokens,
    /// laid out as `options` say (the bf16 copies only if `bf16`, a bf16
    /// run, and `options.bf16_copies`).
    pub fn new(
        stream: &Arc<CudaStream>,
        cfg: &ModelConfig,
        batch: usize,
        seq_len: usize,
        options: WorkspaceOptions,
        bf16: bool,
    ) -> Result<Workspace> {
        let WorkspaceOptions {
            loss_chunk_rows,
            recompute,
            bf16_copies,
            bf16_acts,
        } = options;
        // Mamba-1's scan stages bf16 columns in pairs; Mamba-2's kernels
        // read them one at a time.
        let ssd_half_acts = bf16 && bf16_acts;
        let half_acts = ssd_half_acts && cfg.d_inner() % 2 == 0;
        let bf16 = bf16 && bf16_copies;
        let rows = batch * seq_len;
        let loss_rows = rows.min(loss_chunk_rows.max(1));
        let (d, di, v) = (cfg.d_model, cfg.d_inner(), cfg.vocab_size);
        let ldbc = cfg.dt_rank + 2 * cfg.d_state;
        let shape = Self::scan_shape(cfg, batch, seq_len);
        let sl = shape.state_len();
        let mut a = Alloc { stream, bytes: 0 };
        let mut resid = Vec::with_capacity(cfg.n_layer + 1);
        for l in 0..=cfg.n_layer {
            resid.push(a.zeros(&format!("residual stream {l}"), rows * d)?);
        }
        let sets = if recompute {
            1.min(cfg.n_layer)
        } else {
            cfg.n_layer
        };
        let label = |l: usize, s: &str| {
            if recompute {
                format!("shared block activations: {s}")
            } else {
                format!("layer {l} {s}")
            }
        };
        let ssd = cfg.ssd().is_some();
        let mut layers = Vec::with_capacity(if ssd { 0 } else { sets });
        for l in 0..if ssd { 0 } else { sets } {
            let w = |s: &str| label(l, s);
            let (xz, u, dt, y) = (
                a.act(half_acts, &w("in_proj output"), rows * 2 * di)?,
                a.act(half_acts, &w("conv output"), rows * di)?,
                a.act(half_acts, &w("dt"), rows * di)?,
                a.act(half_acts, &w("scan output"), rows * di)?,
            );
            layers.push(LayerActs {
                rstd: a.zeros(&w("rstd"), rows)?,
                xz,
                u_h: a.zeros_if(bf16 && !half_acts, &w("conv output (bf16 copy)"), rows * di)?,
                u,
                dbc: a.zeros(&w("x_proj output"), rows * ldbc)?,
                dbc_h: a.zeros_if(bf16, &w("x_proj output (bf16)"), rows * ldbc)?,
                dt,
                y,
                hin: a.zeros(&w("scan chunk states"), sl)?,
            });
        }
        let ssd_bufs = if ssd {
            Some(ssd_bufs(
                &mut a,
                cfg,
                (batch, seq_len),
                (sets, recompute),
                (bf16, ssd_half_acts),
                &label,
            )?)
        } else {
            None
        };
        // Mamba-1's x_proj and dt_proj buffers, which a Mamba-2 block has no
        // use for, are left at one element there.
        let m1 = |len: usize| if ssd { 0 } else { len };
        let xn = a.act(bf16, "norm output of one block", rows * d)?;
        let g = a.act(bf16, "gated output of one block", rows * di)?;
        let conv_channels = if ssd { ssd_conv_channels(cfg) } else { di };
        let colsum = MambaKernels::colsum_scratch_len(rows, d.max(di)).max(
            MambaKernels::conv_wgrad_scratch_len(rows, conv_channels, cfg.d_conv),
        );
        let ws = Workspace {
            batch,
            seq_len,
            options,
            resid,
            acts: BlockActs::new(layers, recompute),
            ssd: ssd_bufs,
            xn,
            xn_of: None,
            g,
            rstd_f: a.zeros("final rstd", rows)?,
            xf: a.zeros("final norm output", rows * d)?,
            xf_h: a.zeros_if(bf16, "final norm output (bf16)", rows * d)?,
            dres_h: a.zeros_if(bf16, "residual gradient (bf16)", rows * d)?,
            ddtr_h: a.zeros_if(bf16 && !ssd, "dt_proj output gradient (bf16)", rows * di)?,
            ddbc_h: a.zeros_if(bf16 && !ssd, "x_proj output gradient (bf16)", rows * ldbc)?,
            dlogits_h: a.zeros_if(bf16, "logits gradient (bf16)", loss_rows * v)?,
            loss_rows,
            logits: a.zeros("logits of one loss chunk", loss_rows * v)?,
            da_part: a.zeros("scan dA partials", m1(shape.da_partial_len()))?,
            dbc_part: a.zeros("scan dB/dC partials", m1(shape.dbc_partial_len()))?,
            scan_seg: a.zeros("scan segment scratch", m1(shape.segment_scratch_len()))?,
            colsum: a.zeros("column-sum partials", colsum)?,
            row_loss: a.zeros("row losses", rows)?,
            loss: a.zeros("loss", 1)?,
            dres: a.zeros("residual gradient", rows * d)?,
            dxn: a.zeros("norm output gradient", rows * d)?,
            dout: a.zeros("gated output gradient", rows * di)?,
            dy: a.zeros(
                "scan output gradient",
                if ssd && ssd_half_acts { 1 } else { rows * di },
            )?,
            dxz: a.act(bf16, "in_proj output gradient", m1(rows * 2 * di))?,
            ddtr: a.zeros("dt_proj output gradient", m1(rows * di))?,
            du: a.zeros("conv output gradient", m1(rows * di))?,
            ddbc: a.zeros("x_proj output gradient", m1(rows * ldbc))?,
            tokens: a.zeros("tokens", rows)?,
            targets: a.zeros("targets", rows)?,
            csr: a.csr(rows, v)?,
            loss_scale: a.zeros("loss scale", LossScale::LEN)?,
            graph: PassGraph::default(),
            bytes: 0,
        };
        Ok(Workspace {
            bytes: a.bytes,
            ..ws
        })
    }
}

/// Conv channels of a Mamba-2 block: x, then B and C of every group.
pub(crate) fn ssd_conv_channels(cfg: &ModelConfig) -> usize {
    cfg.d_inner() + 2 * cfg.ssd().map_or(1, |s| s.n_groups) * cfg.d_state
}

/// in_proj's output width of a Mamba-2 block: z, the conv channels, dt.
pub(crate) fn ssd_in_width(cfg: &ModelConfig) -> usize {
    cfg.d_inner() + ssd_conv_channels(cfg) + cfg.num_heads()
}

/// The Mamba-2 buffers of a workspace: `sets` block activation sets
/// (shared by all blocks when `shared`; `label` names them), the scan's
/// scratch and the backward's buffers ([`SsdBufs`]); `bf16`: the bf16 GEMM
/// operand copies; `half_acts`: `zx`, `uc`, `y`, `g` and the scan's states
/// in bf16 alone.
fn ssd_bufs(
    a: &mut Alloc<'_>,
    cfg: &ModelConfig,
    (batch, seq_len): (usize, usize),
    (sets, shared): (usize, bool),
    (bf16, half_acts): (bool, bool),
    label: &dyn Fn(usize, &str) -> String,
) -> Result<SsdBufs> {
    let rows = batch * seq_len;
    let (di, heads) = (cfg.d_inner(), cfg.num_heads());
    let (cd, w) = (ssd_conv_channels(cfg), ssd_in_width(cfg));
    let mut acts = Vec::with_capacity(sets);
    for l in 0..sets {
        let w_ = |s: &str| label(l, s);
        acts.push(SsdActs {
            rstd: a.zeros(&w_("rstd"), rows)?,
            zx: a.act(half_acts, &w_("in_proj output"), rows * w)?,
            uc: a.act(half_acts, &w_("conv output"), rows * cd)?,
            dt: a.zeros(&w_("dt"), rows * heads)?,
            y: a.act(half_acts, &w_("scan output"), rows * di)?,
            g: a.act(half_acts, &w_("gated norm input"), rows * di)?,
            rstd_g: a.zeros(&w_("gated norm rstd"), rows)?,
        });
    }
    let shape = SsdShape {
        batch,
        seq_len,
        heads,
        head_dim: cfg.ssd().map_or(1, |s| s.head_dim),
        d_state: cfg.d_state,
        groups: cfg.ssd().map_or(1, |s| s.n_groups),
    };
    Ok(SsdBufs {
        acts: BlockActs::new(acts, shared),
        scan: SsdScanScratch::new(a, shape.scratch_lens(), half_acts)?,
        grads: SsdGradBufs {
            dy_h: a.zeros_if(half_acts, "scan output gradient (bf16)", rows * di)?,
            duc: a.zeros("conv output gradient", rows * cd)?,
            dd_e: a.zeros("D gradient per channel", di)?,
            dzx: a.zeros("in_proj output gradient", rows * w)?,
            dzx_h: a.zeros_if(bf16, "in_proj output gradient (bf16)", rows * w)?,
            rstd_again: a.zeros("gated norm rstd (remade)", rows)?,
        },
    })
}
