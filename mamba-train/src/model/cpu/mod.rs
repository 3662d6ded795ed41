//! CPU reference model: forward and backward written by hand over the flat
//! arenas of [`crate::params`], in f32 for training and, through the same
//! generic code, in f64 for gradient checks.
//!
//! Model (SPEC.md, Hugging Face `MambaForCausalLM`, slow path): embedding;
//! `n_layer` blocks of `x + Mixer(RMSNorm(x))`; final RMSNorm; LM head tied
//! to the embedding; mean cross-entropy over targets other than
//! [`IGNORE`](crate::model::IGNORE).
//!
//! Determinism: the result bits are a function of (params, batch) only.
//! Work runs on the caller's rayon pool, split over token chunks, sequences,
//! channels or GEMM row blocks, but every sum keeps one fixed order, so 1 or
//! 64 threads give the same bits. Hot loops are compiled three times
//! (baseline, AVX2, AVX-512F) and dispatched at run time; they vectorise
//! across independent elements only and never fuse a multiply-add, so the
//! instruction set does not change bits either ([`set_max_simd`] caps it,
//! for tests). `exp` and `ln_1p` in f32 are fixed polynomials
//! ([`exp_f32`], [`ln_1p_f32`]), not the system libm.
//!
//! Numerical contract, for implementations pinned against this one (the
//! module docs of `gemm`, `ops` and `scan` give every formula's order):
//! matrix products are one ascending chain over the inner dimension per
//! output; weight gradients sum over tokens in ascending (sequence, token)
//! order; the scan's dB/dC sum over channels by a 16-lane tree per block
//! then ascending blocks; dA_log/dD sum per sequence, then over sequences
//! ascending; the loss is the f64 sum of per-token f32 losses, ascending.

mod conv;
mod decode;
mod float;
mod gemm;
pub mod mamba2;
mod net;
mod ops;
mod scan;
mod simd;
mod workspace;

pub use decode::CpuDecoder;
pub use float::{exp_f32, ln_1p_f32, EXP_F32_HI, EXP_F32_LO};
pub use mamba2::Mamba2Model;
pub use simd::{set_max_simd, SimdLevel};

use std::sync::Mutex;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::{Batch, HostModel};
use crate::params::ParamLayout;
use float::Float;

/// The f32 CPU model.
///
/// It keeps the buffers of its last f32 pass (activations and backward
/// scratch, `O(batch * seq_len * d_inner * n_layer)` floats) for reuse by the
/// next call. Calls from several threads at once are fine: one of them gets
/// the cached buffers, the others allocate their own.
pub struct CpuModel {
    cfg: ModelConfig,
    layout: ParamLayout,
    cache: Mutex<Option<Box<net::Workspace<f32>>>>,
}

impl CpuModel {
    /// A model of shape `cfg` (validated).
    pub fn new(cfg: ModelConfig) -> Result<Self> {
        cfg.validate()?;
        cfg.require_mamba1("CpuModel", "use mamba2::Mamba2Model")?;
        let layout = ParamLayout::new(&cfg);
        Ok(CpuModel {
            cfg,
            layout,
            cache: Mutex::new(None),
        })
    }
    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// The arena layout.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }
    /// Reference initialisation from the seed law (`Domain::Init`); see
    /// [`crate::model::init`].
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        crate::model::init::init_params(&self.cfg, &self.layout, seed)
    }
    /// Mean loss over `batch`; *overwrites* `grads` (same layout as `params`)
    /// with d loss / d params. With no counted target the loss is 0 and the
    /// gradients are all 0.
    pub fn forward_backward(
        &self,
        params: &[f32],
        batch: &Batch,
        grads: &mut [f32],
    ) -> Result<f32> {
        let mut ws = self.take_cache();
        let r = self.forward_backward_in(params, batch, grads, &mut ws);
        self.put_cache(ws);
        r.map(|l| l as f32)
    }
    /// Mean loss only.
    pub fn loss(&self, params: &[f32], batch: &Batch) -> Result<f32> {
        let mut ws = self.take_cache();
        let r = self.loss_in(params, batch, &mut ws);
        self.put_cache(ws);
        r.map(|l| l as f32)
    }
    /// Logits `[batch, seq_len, vocab]`, row-major.
    pub fn logits(&self, params: &[f32], batch: &Batch) -> Result<Vec<f32>> {
        let mut ws = self.take_cache();
        let r = self.logits_in(params, batch, &mut ws);
        self.put_cache(ws);
        r
    }
    /// [`forward_backward`](Self::forward_backward) in f64: the same program
    /// (same operations, same order) over f64, the reference for gradient
    /// checks and for pinning other implementations.
    pub fn forward_backward_f64(
        &self,
        params: &[f64],
        batch: &Batch,
        grads: &mut [f64],
    ) -> Result<f64> {
        self.forward_backward_in(params, batch, grads, &mut net::Workspace::default())
    }
    /// [`loss`](Self::loss) in f64.
    pub fn loss_f64(&self, params: &[f64], batch: &Batch) -> Result<f64> {
        self.loss_in(params, batch, &mut net::Workspace::default())
    }
    /// [`logits`](Self::logits) in f64.
    pub fn logits_f64(&self, params: &[f64], batch: &Batch) -> Result<Vec<f64>> {
        self.logits_in(params, batch, &mut net::Workspace::default())
    }

    /// The cached f32 workspace, or a fresh one when another call holds it.
    fn take_cache(&self) -> Box<net::Workspace<f32>> {
        self.cache
            .try_lock()
            .ok()
            .and_then(|mut c| c.take())
            .unwrap_or_default()
    }

    fn put_cache(&self, ws: Box<net::Workspace<f32>>) {
        if let Ok(mut c) = self.cache.try_lock() {
            *c = Some(ws);
        }
    }

    fn forward_backward_in<F: Float>(
        &self,
        params: &[F],
        batch: &Batch,
        grads: &mut [F],
        ws: &mut net::Workspace<F>,
    ) -> Result<f64> {
        self.check_arena("params arena", params.len())?;
        self.check_arena("grads arena", grads.len())?;
        self.check_batch(batch)?;
        if batch.batch * batch.seq_len == 0 {
            grads.fill(F::ZERO);
            return Ok(0.0);
        }
        let (cfg, lay, toks) = (&self.cfg, &self.layout, &batch.tokens);
        net::forward(cfg, lay, params, toks, batch.batch, batch.seq_len, ws);
        Ok(net::backward(
            cfg,
            lay,
            params,
            toks,
            &batch.targets,
            batch.batch,
            batch.seq_len,
            ws,
            grads,
        ))
    }

    fn loss_in<F: Float>(
        &self,
        params: &[F],
        batch: &Batch,
        ws: &mut net::Workspace<F>,
    ) -> Result<f64> {
        self.check_arena("params arena", params.len())?;
        self.check_batch(batch)?;
        if batch.batch * batch.seq_len == 0 {
            return Ok(0.0);
        }
        net::forward(
            &self.cfg,
            &self.layout,
            params,
            &batch.tokens,
            batch.batch,
            batch.seq_len,
            ws,
        );
        Ok(net::loss(ws, &batch.targets, self.cfg.vocab_size))
    }

    fn logits_in<F: Float>(
        &self,
        params: &[F],
        batch: &Batch,
        ws: &mut net::Workspace<F>,
    ) -> Result<Vec<F>> {
        self.check_arena("params arena", params.len())?;
        self.check_batch(batch)?;
        if batch.batch * batch.seq_len == 0 {
            return Ok(Vec::new());
        }
        net::forward(
            &self.cfg,
            &self.layout,
            params,
            &batch.tokens,
            batch.batch,
            batch.seq_len,
            ws,
        );
        Ok(ws.logits.clone())
    }

    fn check_arena(&self, what: &str, len: usize) -> Result<()> {
        crate::model::check_arena_len(&self.cfg, &self.layout, what, len)
    }

    fn check_batch(&self, b: &Batch) -> Result<()> {
        b.validate(self.cfg.vocab_size).map(|_| ())
    }
}

impl HostModel for CpuModel {
    fn config(&self) -> &ModelConfig {
        CpuModel::config(self)
    }
    fn layout(&self) -> &ParamLayout {
        CpuModel::layout(self)
    }
    fn init_params(&self, seed: u64) -> Vec<f32> {
        CpuModel::init_params(self, seed)
    }
    fn forward_backward(
        &mut self,
        params: &[f32],
        batch: &Batch,
        grads: &mut [f32],
    ) -> Result<f32> {
        CpuModel::forward_backward(self, params, batch, grads)
    }
    fn logits(&mut self, params: &[f32], batch: &Batch) -> Result<Vec<f32>> {
        CpuModel::logits(self, params, batch)
    }
}
