//! The Mamba-2 language model on the CPU (Hugging Face `Mamba2ForCausalLM`,
//! the `torch_forward` path), forward and backward by hand over the flat
//! arena, generic over the same `Float` as the Mamba-1 reference beside
//! it: f32 for training, f64 for gradient checks, one program.
//!
//! Model: embedding; `n_layer` blocks of `x + Mixer(RMSNorm(x))`; final
//! RMSNorm; LM head tied to the embedding; mean cross-entropy over targets
//! other than [`IGNORE`](crate::model::IGNORE). Mixer: in_proj (no bias) to
//! z, x, B, C, dt; causal depthwise conv1d (with bias) + SiLU over x, B, C;
//! `dt = softplus(dt + dt_bias)`; `A = -exp(A_log)` one scalar per head; the
//! chunked SSD scan (`ssd`) over `d_inner / head_dim` heads, B and C shared
//! by the heads of a group; `y + D x`; gated RMSNorm `norm(y * silu(z))`
//! over all of `d_inner` (transformers' `MambaRMSNormGated`); out_proj (no
//! bias). Shapes and names: [`crate::params::SsdLayerOffsets`].
//!
//! Determinism: as the Mamba-1 reference (every sum in one fixed order,
//! work split only between independent outputs), so the bits are a function
//! of (params, batch, chunk_size) only, whatever the thread count. The
//! chunk size is part of the config because it decides the scan's order.

mod gate;
mod net;
pub(crate) mod ssd;
mod workspace;

use std::sync::Mutex;

use super::float::Float;
use crate::config::ModelConfig;
use crate::error::{Result, TrainError};
use crate::model::{Batch, HostModel};
use crate::params::ParamLayout;

/// The f32 CPU Mamba-2 model; a [`HostModel`], so the one engine
/// ([`Trainer`](crate::train::Trainer), data parallelism, checkpoints) runs
/// it as it runs [`CpuModel`](super::CpuModel).
///
/// It keeps the buffers of its last f32 pass for the next call; calls from
/// several threads at once are fine (one gets the cached buffers, the
/// others allocate).
pub struct Mamba2Model {
    cfg: ModelConfig,
    layout: ParamLayout,
    cache: Mutex<Option<Box<workspace::Workspace<f32>>>>,
}

impl Mamba2Model {
    /// A model of shape `cfg`, which must be a valid Mamba-2 config.
    pub fn new(cfg: ModelConfig) -> Result<Self> {
        cfg.validate()?;
        if cfg.ssd().is_none() {
            return Err(TrainError::Config(
                "Mamba2Model needs a Mamba-2 config (arch mamba2); this one is Mamba-1, \
                 which CpuModel runs"
                    .into(),
            ));
        }
        let layout = ParamLayout::new(&cfg);
        Ok(Mamba2Model {
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
    /// Reference initialisation from the seed law; see
    /// [`crate::model::init`].
    pub fn init_params(&self, seed: u64) -> Vec<f32> {
        crate::model::init::init_params(&self.cfg, &self.layout, seed)
    }
    /// Mean loss over `batch`; *overwrites* `grads` with d loss / d params
    /// (all 0, and loss 0, when no target counts).
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
        let r = self.forward_in(params, batch, &mut ws).map(|ok| {
            if ok {
                loss_of(&ws, &batch.targets, self.cfg.vocab_size)
            } else {
                0.0
            }
        });
        self.put_cache(ws);
        r.map(|l| l as f32)
    }
    /// Logits `[batch, seq_len, vocab]`, row-major.
    pub fn logits(&self, params: &[f32], batch: &Batch) -> Result<Vec<f32>> {
        let mut ws = self.take_cache();
        let r = self.forward_in(params, batch, &mut ws).map(|ok| {
            if ok {
                ws.logits.clone()
            } else {
                Vec::new()
            }
        });
        self.put_cache(ws);
        r
    }
    /// [`forward_backward`](Self::forward_backward) in f64 (the same
    /// program over f64), for gradient checks.
    pub fn forward_backward_f64(
        &self,
        params: &[f64],
        batch: &Batch,
        grads: &mut [f64],
    ) -> Result<f64> {
        self.forward_backward_in(params, batch, grads, &mut workspace::Workspace::default())
    }
    /// [`loss`](Self::loss) in f64.
    pub fn loss_f64(&self, params: &[f64], batch: &Batch) -> Result<f64> {
        let mut ws = workspace::Workspace::default();
        let ok = self.forward_in(params, batch, &mut ws)?;
        Ok(if ok {
            loss_of(&ws, &batch.targets, self.cfg.vocab_size)
        } else {
            0.0
        })
    }

    fn take_cache(&self) -> Box<workspace::Workspace<f32>> {
        self.cache
            .try_lock()
            .ok()
            .and_then(|mut c| c.take())
            .unwrap_or_default()
    }

    fn put_cache(&self, ws: Box<workspace::Workspace<f32>>) {
        if let Ok(mut c) = self.cache.try_lock() {
            *c = Some(ws);
        }
    }

    fn check<F>(&self, params: &[F], batch: &Batch) -> Result<()> {
        crate::model::check_arena_len(&self.cfg, &self.layout, "params arena", params.len())?;
        batch.validate(self.cfg.vocab_size).map(|_| ())
    }

    /// The forward into `ws`; `false` (and nothing run) for an empty batch.
    fn forward_in<F: Float>(
        &self,
        params: &[F],
        batch: &Batch,
        ws: &mut workspace::Workspace<F>,
    ) -> Result<bool> {
        self.check(params, batch)?;
        if batch.batch * batch.seq_len == 0 {
            return Ok(false);
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
        Ok(true)
    }

    fn forward_backward_in<F: Float>(
        &self,
        params: &[F],
        batch: &Batch,
        grads: &mut [F],
        ws: &mut workspace::Workspace<F>,
    ) -> Result<f64> {
        crate::model::check_arena_len(&self.cfg, &self.layout, "grads arena", grads.len())?;
        if !self.forward_in(params, batch, ws)? {
            grads.fill(F::ZERO);
            return Ok(0.0);
        }
        Ok(net::backward(
            &self.cfg,
            &self.layout,
            params,
            &batch.tokens,
            &batch.targets,
            batch.batch,
            batch.seq_len,
            ws,
            grads,
        ))
    }
}

/// Mean cross-entropy of the forward pass in `ws` (0 when no target counts).
fn loss_of<F: Float>(ws: &workspace::Workspace<F>, targets: &[i32], v: usize) -> f64 {
    let count = targets.iter().filter(|&&t| t >= 0).count();
    if count == 0 {
        return 0.0;
    }
    super::ops::cross_entropy(&ws.logits, targets, v, None) / count as f64
}

impl HostModel for Mamba2Model {
    fn config(&self) -> &ModelConfig {
        Mamba2Model::config(self)
    }
    fn layout(&self) -> &ParamLayout {
        Mamba2Model::layout(self)
    }
    fn init_params(&self, seed: u64) -> Vec<f32> {
        Mamba2Model::init_params(self, seed)
    }
    fn forward_backward(
        &mut self,
        params: &[f32],
        batch: &Batch,
        grads: &mut [f32],
    ) -> Result<f32> {
        Mamba2Model::forward_backward(self, params, batch, grads)
    }
    fn logits(&mut self, params: &[f32], batch: &Batch) -> Result<Vec<f32>> {
        Mamba2Model::logits(self, params, batch)
    }
}
