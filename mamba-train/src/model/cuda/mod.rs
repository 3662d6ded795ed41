//! The Mamba models on one CUDA device: the kernels of
//! `kernels::mamba` for every non-GEMM op, cuBLAS (fixed configuration,
//! [`blas`]) for the GEMMs, over the same flat arenas and layout as the CPU
//! model ([`crate::params::ParamLayout`]: one parameter arena, one gradient
//! arena, Hugging Face names and shapes).
//!
//! Determinism: one stream, no atomics, every reduction in a fixed order that
//! depends only on the shapes, cuBLAS pinned ([`blas`]; the tf32 and bf16
//! GEMMs through cuBLASLt with one algorithm per problem, chosen once). The same parameters
//! and batch give the same loss and gradient bits on every run of the same
//! build on the same GPU model, in each precision. Results agree with
//! [`super::cpu::CpuModel`] within the precision's tolerance (f32: f32
//! rounding of different summation orders and of the FMAs nvcc contracts in
//! the model's kernel files), not bit for bit; the optimizer's arithmetic
//! (`optim`, its kernel file built without contraction) does match the
//! CPU's bit for bit.
//!
//! The tied LM head and the loss run over chunks of rows ([`head`],
//! [`CudaModel::set_loss_chunk_rows`], 1024 by default), so one chunk's
//! logits exist at a time; the chunk size is part of the configuration
//! like the batch shape (a batch within one chunk is the unchunked head).
//!
//! Precision ([`Precision`], `--precision`; chosen when the model is built,
//! [`CudaModel::with_stream_in`]). What every precision keeps: the master
//! weights, the gradient arena (what the reducer sees) and AdamW are f32
//! and the same code; the embedding, the norms, the conv, the scan (its
//! state `h` and every product in it), the gate, softmax/cross-entropy, the
//! loss mean, every column sum and the gradient norm run in f32 in all
//! three. Stored activations are f32, except in bf16: in_proj's output and
//! the scan's `u`, `dt` and `y` are kept in bf16 alone (each rounded once
//! where it is made, read widened to f32; [`CudaModel::set_bf16_acts`]),
//! and the norm output and the gated output, which only GEMMs read, are
//! their bf16 GEMM operand. Those two are not kept per block in any
//! precision: the backward makes them again with the forward's bits
//! (`workspace`'s docs). What changes is the GEMMs (all of them:
//! in_proj, x_proj, dt_proj, out_proj, the tied LM head, forward and
//! backward) and, in bf16, those three roundings:
//! - `f32`: cuBLAS SGEMM, f32 FMA (the reference; the bits of earlier
//!   builds);
//! - `tf32`: tensor cores with inputs rounded to TF32 (10-bit mantissa),
//!   f32 accumulation and output;
//! - `bf16`: both operands rounded to bf16 (8-bit mantissa; round to
//!   nearest even, `kernels::mamba::cast`), f32 accumulation and output. The
//!   weights are cast once per pass from the f32 arena into a bf16 copy
//!   (that is, after each AdamW update); an activation or activation
//!   gradient has one bf16 copy, stored by the kernel that makes it (cast
//!   afterwards only for cuBLAS outputs), that every GEMM reading it shares
//!   (the same bits as each GEMM casting its own:
//!   [`CudaModel::set_bf16_copies`]).
//!
//! Mamba-2 ([`crate::config::Arch::Mamba2`], any number of groups of B and
//! C) runs through the same passes, workspace, graph and optimizer: its
//! blocks are `ssd`'s, over the chunked SSD kernels
//! ([`kernels::mamba::ssd`]). bf16 runs keep its in_proj output, conv
//! output (the SSD's x, B and C), scan output `y` and its gradient, and
//! gated-norm input in bf16 alone (as Mamba-1's,
//! [`CudaModel::set_bf16_acts`]), and so the SSD's entry states and their
//! gradients between its kernels (as the
//! reference keeps its passed states in the input's type;
//! [`kernels::mamba::SsdStates`]); its `dt` stays f32; the GEMMs
//! take the precision, and so do the scan's chunk products: f32
//! FMAs in f32 runs, tf32 tensor cores in tf32 and bf16 runs
//! ([`SsdProducts`]). Its chunk length is the kernels' constant, so it
//! agrees with the CPU's chunked SSD within tolerance and its bits do not
//! depend on `chunk_size`; [`CudaDecoder`] decodes it too.
//!
//! Memory: every block's activations are kept for the backward pass unless
//! [`CudaModel::set_recompute`] (`--recompute`) keeps one block's and
//! recomputes the others' during the backward, with the same bits.
//!
//! Launches: [`CudaModel::set_cuda_graph`] replays the pass
//! ([`CudaModel::forward_backward`]) as a CUDA graph captured from the
//! eager pass (the CLI's default; `--no-cuda-graph` runs it eagerly), with
//! the same bits: everything that varies with the batch is uploaded into
//! buffers of fixed address and size (`graph`'s docs).
//!
//! Each precision is deterministic in the sense above (same bits run to
//! run; the reducer then makes every P at fixed L the same bits), and the
//! bits differ between precisions: a run's precision is part of its
//! identity.
//!
//! ```no_run
//! # fn main() -> mamba_train::Result<()> {
//! use mamba_train::model::{cuda::CudaModel, Batch};
//! let mut model = CudaModel::new(mamba_train::ModelConfig::new(256, 64, 2), 0)?;
//! let params = model.init_params(7)?;
//! let mut grads = model.zeros_arena()?;
//! let batch = Batch { tokens: vec![1, 2, 3, 4], targets: vec![2, 3, 4, -100], batch: 1, seq_len: 4 };
//! let loss = model.forward_backward(&params, &batch, &mut grads)?;
//! # let _ = loss; Ok(()) }
//! ```
//!
//! Over 450 lines: the model's state and its one constructor path (config
//! checks, the precision's GEMM setup, the workspace) with its public
//! passes; forward, the head and loss, backward, decoding and the optimizer
//! are already their own files.

mod backend;
mod backward;
pub mod blas;
mod blas_lt;
mod decode;
mod forward;
mod graph;
pub mod head;
mod optim;
mod ssd;
mod workspace;

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use kernels::mamba::{LossScale, MambaKernels, SsdProducts, TokenCsr, MAX_CONV_WIDTH, MAX_D_STATE};

use crate::config::ModelConfig;
pub use crate::config::Precision;
use crate::error::{Result, TrainError};
use crate::model::Batch;
use crate::params::ParamLayout;
use blas::Blas;
pub use decode::CudaDecoder;
pub use graph::GraphStats;
use workspace::{Workspace, WorkspaceOptions};

/// What every pass needs: the stream all work is ordered on, the kernels,
/// the cuBLAS handle bound to that stream and the Mamba-2 scan's products
/// of the run's precision.
pub(crate) struct Engine {
    pub stream: Arc<CudaStream>,
    pub kernels: MambaKernels,
    pub blas: Blas,
    /// SIMT f32 in f32 runs; tf32 tensor cores in tf32 and bf16 runs.
    pub ssd_products: SsdProducts,
}

/// The f32 Mamba model on a CUDA device.
///
/// Owns its activation workspace (sized for the last batch shape; rebuilt
/// when the shape changes) and the optimizer's scratch, which is why the
/// passes take `&mut self`. All work is enqueued on one stream
/// ([`Self::stream`]); calls that return a host value (loss, logits,
/// downloads) synchronize it.
///
/// It is the engine's CUDA [`Backend`](crate::train::Backend) (arenas are
/// `CudaSlice<f32>`) and, for the optimizer, an
/// [`ArenaMath`](crate::optim::ArenaMath) bit-identical to the CPU's.
pub struct CudaModel {
    cfg: ModelConfig,
    layout: ParamLayout,
    precision: Precision,
    engine: Engine,
    ws: Option<Workspace>,
    optim: Option<optim::OptimScratch>,
    /// bf16 runs: the parameter arena cast to bf16, the weights' GEMM
    /// operands (rewritten at the start of every pass).
    params_bf16: Option<CudaSlice<u16>>,
    /// The loss chunk, recompute mode and bf16 copies the workspace is
    /// built with ([`Self::set_loss_chunk_rows`], [`Self::set_recompute`],
    /// [`Self::set_bf16_copies`]).
    options: WorkspaceOptions,
    /// Whether `forward_backward` replays a captured graph
    /// ([`Self::set_cuda_graph`]), and what it did so far.
    graph_on: bool,
    graph_stats: GraphStats,
}

impl CudaModel {
    /// A model of shape `cfg` on device `ordinal`, working on that device's
    /// default stream.
    pub fn new(cfg: ModelConfig, ordinal: usize) -> Result<Self> {
        Self::new_in(cfg, Precision::F32, ordinal)
    }

    /// A model of shape `cfg` in `precision` on device `ordinal`.
    pub fn new_in(cfg: ModelConfig, precision: Precision, ordinal: usize) -> Result<Self> {
        let ctx = kernels::open_context(ordinal)?;
        Self::with_stream_in(cfg, precision, ctx.default_stream())
    }

    /// A model of shape `cfg` working on `stream` (e.g. the communicator's,
    /// so that gradient reduction is ordered after the backward pass with no
    /// host synchronization).
    pub fn with_stream(cfg: ModelConfig, stream: Arc<CudaStream>) -> Result<Self> {
        Self::with_stream_in(cfg, Precision::F32, stream)
    }

    /// [`Self::with_stream`] in `precision` (see [`Precision`]: only the
    /// GEMMs' inputs change; arenas, optimizer and reductions are f32).
    pub fn with_stream_in(
        cfg: ModelConfig,
        precision: Precision,
        stream: Arc<CudaStream>,
    ) -> Result<Self> {
        cfg.validate()?;
        // Mamba-1's selective scan holds a channel's states in one warp's
        // lanes; Mamba-2's SSD kernels tile any d_state, and the decoder's
        // scan step walks it.
        if cfg.arch.is_mamba1() && cfg.d_state > MAX_D_STATE {
            return Err(TrainError::Config(format!(
                "d_state {} is above the CUDA Mamba-1 scan's limit of {MAX_D_STATE}",
                cfg.d_state
            )));
        }
        if cfg.d_conv > MAX_CONV_WIDTH {
            return Err(TrainError::Config(format!(
                "d_conv {} is above the CUDA conv kernels' limit of {MAX_CONV_WIDTH}",
                cfg.d_conv
            )));
        }
        let kernels = MambaKernels::load(stream.context())?;
        let blas = Blas::with_precision(&stream, precision, Some(kernels.clone()))?;
        let layout = ParamLayout::new(&cfg);
        Ok(CudaModel {
            cfg,
            layout,
            precision,
            engine: Engine {
                stream,
                kernels,
                blas,
                ssd_products: match precision {
                    Precision::F32 => SsdProducts::F32,
                    Precision::Tf32 | Precision::Bf16 => SsdProducts::Tf32,
                },
            },
            ws: None,
            optim: None,
            params_bf16: None,
            options: WorkspaceOptions {
                loss_chunk_rows: head::LOSS_CHUNK_ROWS,
                recompute: false,
                bf16_copies: true,
                bf16_acts: true,
            },
            graph_on: false,
            graph_stats: GraphStats::default(),
        })
    }

    /// Rows the head and the loss take at a time ([`head`]): a batch of
    /// more rows runs them in chunks of this many, in order.
    pub fn loss_chunk_rows(&self) -> usize {
        self.options.loss_chunk_rows
    }

    /// Set [`Self::loss_chunk_rows`] (at least 1; 0 is taken as 1). It is
    /// part of the configuration like the batch shape: another value gives
    /// other bits (the GEMMs' shapes and the order d E is summed in), the
    /// same value the same bits. The workspace is rebuilt at the next pass.
    pub fn set_loss_chunk_rows(&mut self, rows: usize) {
        self.set_options(WorkspaceOptions {
            loss_chunk_rows: rows.max(1),
            ..self.options
        });
    }

    /// A workspace layout: the current workspace is dropped if it differs
    /// (rebuilt at the next pass).
    fn set_options(&mut self, options: WorkspaceOptions) {
        if options != self.options {
            self.options = options;
            self.ws = None;
        }
    }

    /// Whether the backward pass recomputes the blocks' activations
    /// ([`Self::set_recompute`]).
    pub fn recompute(&self) -> bool {
        self.options.recompute
    }

    /// Keep one block's activations instead of every block's, and
    /// recompute each block's from its input (the residual stream, still
    /// kept for every block) just before its backward: the activation
    /// memory of one block instead of `n_layer`, for one more forward pass
    /// of the blocks per training step. Not part of the configuration's
    /// bits: the recomputation runs the same kernels on the same inputs, so
    /// losses and gradients are the same bits either way. The workspace is
    /// rebuilt at the next pass.
    pub fn set_recompute(&mut self, on: bool) {
        self.set_options(WorkspaceOptions {
            recompute: on,
            ..self.options
        });
    }

    /// bf16 runs: whether each GEMM operand has one bf16 copy, stored by
    /// its producer, that all the GEMMs reading it share, with the
    /// activations that only GEMMs read kept in bf16 alone (on, the
    /// default), or each GEMM casts
    /// its own operands (off: the reference path, kept to show the copies
    /// give the same bits). No effect in the other precisions. The
    /// workspace is rebuilt at the next pass.
    pub fn set_bf16_copies(&mut self, on: bool) {
        self.set_options(WorkspaceOptions {
            bf16_copies: on,
            ..self.options
        });
    }

    /// bf16 runs: whether the block's activations (Mamba-1: in_proj's
    /// output `xz`, the scan's `u`, `dt`, `y`; Mamba-2: in_proj's output,
    /// the conv output `uc` (the SSD's x, B, C), `y` and its gradient, the
    /// gated-norm input `g` and the SSD's entry states) are kept in bf16
    /// alone, each rounded
    /// once where it is made (on, the default: SPEC's stored activations in
    /// bf16), or in f32 (off). Unlike [`Self::set_bf16_copies`] this
    /// changes values (one more bf16 rounding of each), so the two settings
    /// give different bits, each deterministic; the checkpoint's precision
    /// is `bf16` either way. A Mamba-1 model with an odd `d_inner` keeps
    /// them in f32. No effect in the other precisions. The workspace is
    /// rebuilt at the next pass.
    pub fn set_bf16_acts(&mut self, on: bool) {
        self.set_options(WorkspaceOptions {
            bf16_acts: on,
            ..self.options
        });
    }

    /// Whether [`Self::forward_backward`] runs as a CUDA graph: the first
    /// pass with a given pair of arenas (and batch shape) runs eagerly, the
    /// second is captured, every later one replays the capture (the same
    /// launches on the same addresses, so the same bits as the eager pass;
    /// `graph`'s docs). Off by default. Only a model on a stream of its own
    /// can capture ([`Self::with_stream_in`]; the legacy default stream of
    /// [`Self::new`] cannot be captured: an error).
    ///
    /// Turning it on turns off cudarc's event tracking in the model's
    /// context (a capture cannot wait on events recorded outside it), for
    /// every buffer of that context, the model's arenas included, from now
    /// on: cudarc then no longer orders uses of one buffer on different
    /// streams.
    ///
    /// # Safety
    /// From this call on, the caller must order by hand (events or stream
    /// synchronization) every use of a buffer of the model's context on a
    /// stream other than [`Self::stream`], and no other thread may rely on
    /// the context's event tracking. A trainer whose model, reducer and
    /// optimizer all work on the model's one stream (the communicator's
    /// stream of `dp::cuda`) meets this trivially.
    pub unsafe fn set_cuda_graph(&mut self, on: bool) -> Result<()> {
        if on {
            if self.engine.stream.cu_stream().is_null() {
                return Err(TrainError::Config(
                    "a CUDA graph needs the model on a stream of its own (CudaModel::with_stream_in); \
                     the device's legacy default stream cannot be captured"
                        .to_string(),
                ));
            }
            // SAFETY: the caller's contract above.
            unsafe { self.engine.stream.context().disable_event_tracking() };
        }
        self.graph_on = on;
        if let Some(ws) = self.ws.as_mut() {
            ws.graph = Default::default();
        }
        Ok(())
    }

    /// Whether [`Self::set_cuda_graph`] is on.
    pub fn cuda_graph(&self) -> bool {
        self.graph_on
    }

    /// How many passes were captured and replayed as CUDA graphs.
    pub fn graph_stats(&self) -> GraphStats {
        self.graph_stats
    }

    /// The precision of the model's GEMMs.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The record of the GEMM algorithms chosen so far ([`Blas::algorithms`]:
    /// one line per tf32 / bf16 problem, chosen once at its first call).
    pub fn gemm_algorithms(&self) -> Vec<String> {
        self.engine.blas.algorithms()
    }

    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// The arena layout (the same as the CPU model's).
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }
    /// The stream all work is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.engine.stream
    }
    /// The device context.
    pub fn context(&self) -> &Arc<CudaContext> {
        self.engine.stream.context()
    }
    /// The loaded kernels.
    pub fn kernels(&self) -> &MambaKernels {
        &self.engine.kernels
    }
    /// Bytes of the current activation workspace (0 before the first pass).
    pub fn workspace_bytes(&self) -> usize {
        self.ws.as_ref().map_or(0, |w| w.bytes)
    }
    /// Rows (sequences) of the current activation workspace, if one exists.
    pub fn workspace_rows(&self) -> Option<usize> {
        self.ws.as_ref().map(|w| w.batch)
    }
    /// Free the activation workspace (the next pass rebuilds it).
    pub fn release_workspace(&mut self) {
        self.ws = None;
    }

    /// Copy a host arena (parameters or gradients) to the device.
    pub fn upload(&self, host: &[f32]) -> Result<CudaSlice<f32>> {
        self.check_arena("arena", host.len())?;
        self.engine
            .stream
            .clone_htod(host)
            .map_err(|e| cuda("uploading an arena", e))
    }
    /// Copy a device arena back (synchronizes the stream).
    pub fn download(&self, dev: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.check_arena("arena", dev.len())?;
        self.engine
            .stream
            .clone_dtoh(dev)
            .map_err(|e| cuda("downloading an arena", e))
    }
    /// A zero-filled arena on the device.
    pub fn zeros_arena(&self) -> Result<CudaSlice<f32>> {
        self.engine
            .stream
            .alloc_zeros::<f32>(self.layout.len())
            .map_err(|e| cuda("allocating an arena", e))
    }
    /// Reference initialisation (the CPU's, [`crate::model::init`]), uploaded.
    pub fn init_params(&self, seed: u64) -> Result<CudaSlice<f32>> {
        self.upload(&crate::model::init::init_params(
            &self.cfg,
            &self.layout,
            seed,
        ))
    }

    /// Mean loss over `batch`; *overwrites* `grads` (same layout as
    /// `params`) with d loss / d params. With no counted target (or an empty
    /// batch) the loss is 0 and the gradients are all 0, as on the CPU.
    /// Synchronizes the stream (to return the loss).
    pub fn forward_backward(
        &mut self,
        params: &CudaSlice<f32>,
        batch: &Batch,
        grads: &mut CudaSlice<f32>,
    ) -> Result<f32> {
        self.check_arena("params arena", params.len())?;
        self.check_arena("grads arena", grads.len())?;
        let counted = self.check_batch(batch)?;
        if batch.batch * batch.seq_len == 0 || counted == 0 {
            self.engine
                .stream
                .memset_zeros(grads)
                .map_err(|e| cuda("zeroing the gradients", e))?;
            return Ok(0.0);
        }
        bf16_slot(
            &self.engine,
            self.precision,
            &mut self.params_bf16,
            params.len(),
        )?;
        let ws = prepare(
            &self.engine,
            &self.cfg,
            &mut self.ws,
            batch,
            self.options,
            counted,
        )?;
        let (e, cfg, lay) = (&self.engine, &self.cfg, &self.layout);
        let key = graph::Key::of(&e.stream, params, grads, self.params_bf16.as_ref());
        let mut state = std::mem::take(&mut ws.graph);
        let slot = &mut self.params_bf16;
        let mut pass = || -> Result<()> {
            cast_params(e, slot.as_mut(), params)?;
            let pb = slot.as_ref();
            forward::forward(e, cfg, lay, params, pb, ws)?;
            head::head_loss(
                e,
                cfg,
                lay,
                params,
                pb,
                ws,
                head::HeadOutput::LossAndGrad(grads),
            )?;
            backward::backward(e, cfg, lay, params, pb, ws, grads)
        };
        let ran = if self.graph_on {
            graph::run(&e.stream, &mut state, &mut self.graph_stats, key, &mut pass)
        } else {
            pass()
        };
        let ws = self
            .ws
            .as_mut()
            .ok_or_else(|| cuda("finishing the pass", "the workspace is gone"))?;
        ws.graph = state;
        ran?;
        read_loss(&self.engine, ws)
    }

    /// Mean loss only (0 with no counted target). Synchronizes the stream.
    pub fn loss(&mut self, params: &CudaSlice<f32>, batch: &Batch) -> Result<f32> {
        self.check_arena("params arena", params.len())?;
        let counted = self.check_batch(batch)?;
        if batch.batch * batch.seq_len == 0 || counted == 0 {
            return Ok(0.0);
        }
        self.forward_only(params, batch, counted)?;
        let (e, cfg, lay) = (&self.engine, &self.cfg, &self.layout);
        let ws = self
            .ws
            .as_mut()
            .ok_or_else(|| cuda("the loss", "no workspace"))?;
        let pb = self.params_bf16.as_ref();
        head::head_loss(e, cfg, lay, params, pb, ws, head::HeadOutput::Loss)?;
        read_loss(e, ws)
    }

    /// Logits `[batch, seq_len, vocab]`, row-major, on the host.
    pub fn logits(&mut self, params: &CudaSlice<f32>, batch: &Batch) -> Result<Vec<f32>> {
        self.check_arena("params arena", params.len())?;
        let counted = self.check_batch(batch)?;
        if batch.batch * batch.seq_len == 0 {
            return Ok(Vec::new());
        }
        self.forward_only(params, batch, counted)?;
        let (e, cfg, lay) = (&self.engine, &self.cfg, &self.layout);
        let ws = self
            .ws
            .as_mut()
            .ok_or_else(|| cuda("the logits", "no workspace"))?;
        head::head_logits(e, cfg, lay, params, self.params_bf16.as_ref(), ws)
    }

    /// The eager forward pass of [`Self::loss`] and [`Self::logits`]: the
    /// weights' bf16 copy (bf16 runs), the workspace with `batch` uploaded
    /// (`counted` targets), then the blocks and the final norm, leaving
    /// `self.ws` ready for the head.
    fn forward_only(
        &mut self,
        params: &CudaSlice<f32>,
        batch: &Batch,
        counted: usize,
    ) -> Result<()> {
        bf16_slot(
            &self.engine,
            self.precision,
            &mut self.params_bf16,
            params.len(),
        )?;
        let ws = prepare(
            &self.engine,
            &self.cfg,
            &mut self.ws,
            batch,
            self.options,
            counted,
        )?;
        let (e, cfg, lay) = (&self.engine, &self.cfg, &self.layout);
        cast_params(e, self.params_bf16.as_mut(), params)?;
        forward::forward(e, cfg, lay, params, self.params_bf16.as_ref(), ws)
    }

    /// [`Self::forward_backward`] over host arenas: uploads `params`, runs,
    /// downloads the gradients into `grads`.
    pub fn forward_backward_host(
        &mut self,
        params: &[f32],
        batch: &Batch,
        grads: &mut [f32],
    ) -> Result<f32> {
        self.check_arena("grads arena", grads.len())?;
        let p = self.upload(params)?;
        let mut g = self.zeros_arena()?;
        let loss = self.forward_backward(&p, batch, &mut g)?;
        self.engine
            .stream
            .memcpy_dtoh(&g, grads)
            .map_err(|e| cuda("downloading the gradients", e))?;
        self.engine
            .stream
            .synchronize()
            .map_err(|e| cuda("waiting for the gradients", e))?;
        Ok(loss)
    }
    /// [`Self::loss`] over a host parameter arena.
    pub fn loss_host(&mut self, params: &[f32], batch: &Batch) -> Result<f32> {
        let p = self.upload(params)?;
        self.loss(&p, batch)
    }
    /// [`Self::logits`] over a host parameter arena.
    pub fn logits_host(&mut self, params: &[f32], batch: &Batch) -> Result<Vec<f32>> {
        let p = self.upload(params)?;
        self.logits(&p, batch)
    }

    fn check_arena(&self, what: &str, len: usize) -> Result<()> {
        crate::model::check_arena_len(&self.cfg, &self.layout, what, len)
    }

    fn check_batch(&self, b: &Batch) -> Result<usize> {
        b.validate(self.cfg.vocab_size)
    }
}

/// bf16 runs: the buffer of the weights' bf16 copy in `slot`, allocated
/// once for `n` parameters (`None` in the other precisions), so that a pass
/// allocates nothing ([`cast_params`] fills it; a captured graph replays
/// that cast).
fn bf16_slot(
    e: &Engine,
    precision: Precision,
    slot: &mut Option<CudaSlice<u16>>,
    n: usize,
) -> Result<()> {
    if precision != Precision::Bf16 {
        *slot = None;
        return Ok(());
    }
    if slot.as_ref().is_none_or(|s| s.len() != n.max(1)) {
        *slot = None;
        *slot = Some(
            e.stream
                .alloc_zeros::<u16>(n.max(1))
                .map_err(|err| cuda("allocating the bf16 weights", err))?,
        );
    }
    Ok(())
}

/// bf16 runs: `params` cast to bf16 into `half` (from [`bf16_slot`]), the
/// weights' GEMM operands for one pass; nothing in the other precisions.
///
/// Once per pass, not per GEMM: a weight read by several GEMMs (the
/// forward's and the backward's, the tied embedding's three) reads the same
/// copy. Since the arena is read as it is when the pass starts, this is the
/// copy of the weights after the latest AdamW update (or upload). Casting
/// per pass instead of inside the optimizer step keeps the copy right
/// whoever wrote the arena (a checkpoint load, ZeRO-1's all-gather); it
/// costs one read of the arena per micro-batch.
fn cast_params(
    e: &Engine,
    half: Option<&mut CudaSlice<u16>>,
    params: &CudaSlice<f32>,
) -> Result<()> {
    let (Some(half), n) = (half, params.len()) else {
        return Ok(());
    };
    if n > 0 {
        e.kernels
            .cast_bf16(&e.stream, &params.as_view(), &mut half.slice_mut(0..n), n)?;
    }
    Ok(())
}

/// The workspace for `batch`'s shape in `slot` (rebuilt if the shape or
/// the recompute mode changed), with the batch uploaded into its fixed
/// buffers: tokens, targets, the token CSR and the loss scale of `counted`
/// targets. A kept workspace still holds a block's activations from the
/// previous pass, which are stale for this one: the forward pass rewrites
/// them (and `resident`) before anything reads them.
fn prepare<'w>(
    e: &Engine,
    cfg: &ModelConfig,
    slot: &'w mut Option<Workspace>,
    batch: &Batch,
    options: WorkspaceOptions,
    counted: usize,
) -> Result<&'w mut Workspace> {
    let same = slot.as_ref().is_some_and(|w| {
        w.batch == batch.batch && w.seq_len == batch.seq_len && w.options == options
    });
    if !same {
        *slot = None; // free the old one first: the peak is one workspace
        *slot = Some(Workspace::new(
            &e.stream,
            cfg,
            batch.batch,
            batch.seq_len,
            options,
            e.blas.precision() == Precision::Bf16,
        )?);
    }
    let ws = slot
        .as_mut()
        .ok_or_else(|| cuda("preparing the workspace", "it was not built"))?;
    let s = &e.stream;
    s.memcpy_htod(&batch.tokens, &mut ws.tokens)
        .map_err(|err| cuda("uploading the tokens", err))?;
    s.memcpy_htod(&batch.targets, &mut ws.targets)
        .map_err(|err| cuda("uploading the targets", err))?;
    TokenCsr::build(&batch.tokens, cfg.vocab_size)?.upload_into(s, &mut ws.csr)?;
    s.memcpy_htod(&LossScale::of(counted).0, &mut ws.loss_scale)
        .map_err(|err| cuda("uploading the loss scale", err))?;
    Ok(ws)
}

/// Copy `ws.loss` to the host; synchronizes the stream, so every pass
/// enqueued before it has finished.
fn read_loss(e: &Engine, ws: &Workspace) -> Result<f32> {
    let loss = e
        .stream
        .clone_dtoh(&ws.loss)
        .map_err(|err| cuda("reading the loss", err))?;
    Ok(loss[0])
}

fn cuda(what: &str, detail: impl std::fmt::Display) -> TrainError {
    TrainError::Cuda {
        what: what.to_string(),
        detail: detail.to_string(),
    }
}
