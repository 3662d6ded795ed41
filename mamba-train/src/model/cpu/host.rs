//! The host model around the shared frame, written once for every CPU
//! architecture: [`Net`] checks arenas and batches, keeps the f32
//! workspace between calls, and runs [`frame`](super::frame) over the
//! architecture's [`Blocks`] in f32 or f64; [`cpu_model_api!`] gives a
//! public model type (`CpuModel`, `Mamba2Model`) its methods and its
//! [`HostModel`](crate::model::HostModel) impl by delegating to its `Net`.
//!
//! The same checks in the same order for both architectures: params
//! arena, grads arena, batch; an empty batch gives loss 0, zero gradients
//! and no logits without running anything.

use std::sync::Mutex;

use super::float::Float;
use super::frame::{self, Blocks, Pass, Workspace};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::Batch;
use crate::params::ParamLayout;

/// An architecture: which block stack it runs (in each float type) and
/// which configs it accepts.
pub(crate) trait Arch {
    /// The block stack (and its buffers) in `F`.
    type Stack<F: Float>: Blocks<F>;
    /// Refuse a config of another architecture, naming the model to use.
    fn check(cfg: &ModelConfig) -> Result<()>;
}

/// The f32 workspace a [`Net`] caches.
type Cached<A> = Box<Workspace<f32, <A as Arch>::Stack<f32>>>;

/// A CPU model of architecture `A` over the flat arenas.
///
/// It keeps the buffers of its last f32 pass for the next call. Calls from
/// several threads at once are fine: one of them gets the cached buffers,
/// the others allocate their own.
pub(crate) struct Net<A: Arch> {
    pub(crate) cfg: ModelConfig,
    pub(crate) layout: ParamLayout,
    cache: Mutex<Option<Cached<A>>>,
}

impl<A: Arch> Net<A> {
    /// A model of shape `cfg`, validated and of architecture `A`.
    pub(crate) fn new(cfg: ModelConfig) -> Result<Self> {
        cfg.validate()?;
        A::check(&cfg)?;
        let layout = ParamLayout::new(&cfg);
        Ok(Net {
            cfg,
            layout,
            cache: Mutex::new(None),
        })
    }

    /// Run `f` on the cached f32 workspace (a fresh one when another call
    /// holds it), then put it back.
    pub(crate) fn with_cache<R>(
        &self,
        f: impl FnOnce(&Self, &mut Workspace<f32, A::Stack<f32>>) -> R,
    ) -> R {
        let mut ws: Cached<A> = self
            .cache
            .try_lock()
            .ok()
            .and_then(|mut c| c.take())
            .unwrap_or_default();
        let r = f(self, &mut ws);
        if let Ok(mut c) = self.cache.try_lock() {
            *c = Some(ws);
        }
        r
    }

    fn pass<'a, F>(&'a self, params: &'a [F], batch: &Batch) -> Pass<'a, F> {
        Pass {
            cfg: &self.cfg,
            lay: &self.layout,
            p: params,
            nseq: batch.batch,
            l: batch.seq_len,
        }
    }

    fn check_arena(&self, what: &str, len: usize) -> Result<()> {
        crate::model::check_arena_len(&self.cfg, &self.layout, what, len)
    }

    /// Mean loss; overwrites `grads` with its gradient.
    pub(crate) fn forward_backward_in<F: Float>(
        &self,
        params: &[F],
        batch: &Batch,
        grads: &mut [F],
        ws: &mut Workspace<F, A::Stack<F>>,
    ) -> Result<f64> {
        self.check_arena("params arena", params.len())?;
        self.check_arena("grads arena", grads.len())?;
        batch.validate(self.cfg.vocab_size)?;
        if batch.batch * batch.seq_len == 0 {
            grads.fill(F::ZERO);
            return Ok(0.0);
        }
        let pass = self.pass(params, batch);
        frame::forward(&pass, &batch.tokens, ws);
        Ok(frame::backward(
            &pass,
            &batch.tokens,
            &batch.targets,
            ws,
            grads,
        ))
    }

    /// The forward into `ws`; `false` (and nothing run) for an empty batch.
    fn forward_in<F: Float>(
        &self,
        params: &[F],
        batch: &Batch,
        ws: &mut Workspace<F, A::Stack<F>>,
    ) -> Result<bool> {
        self.check_arena("params arena", params.len())?;
        batch.validate(self.cfg.vocab_size)?;
        if batch.batch * batch.seq_len == 0 {
            return Ok(false);
        }
        frame::forward(&self.pass(params, batch), &batch.tokens, ws);
        Ok(true)
    }

    /// Mean loss only.
    pub(crate) fn loss_in<F: Float>(
        &self,
        params: &[F],
        batch: &Batch,
        ws: &mut Workspace<F, A::Stack<F>>,
    ) -> Result<f64> {
        let ran = self.forward_in(params, batch, ws)?;
        Ok(if ran {
            frame::loss(ws, &batch.targets, self.cfg.vocab_size)
        } else {
            0.0
        })
    }

    /// Logits `[batch, seq_len, vocab]` (empty for an empty batch).
    pub(crate) fn logits_in<F: Float>(
        &self,
        params: &[F],
        batch: &Batch,
        ws: &mut Workspace<F, A::Stack<F>>,
    ) -> Result<Vec<F>> {
        let ran = self.forward_in(params, batch, ws)?;
        Ok(if ran { ws.logits.clone() } else { Vec::new() })
    }
}

/// The public API of a CPU model type `$model(Net<_>)`: shape, layout,
/// init, and the passes in f32 (cached workspace) and f64 (fresh one), plus
/// its [`HostModel`](crate::model::HostModel) impl. One definition, so the
/// architectures cannot drift apart in what they offer.
macro_rules! cpu_model_api {
    ($model:ident) => {
        impl $model {
            /// The model's shape.
            pub fn config(&self) -> &$crate::config::ModelConfig {
                &self.0.cfg
            }
            /// The arena layout.
            pub fn layout(&self) -> &$crate::params::ParamLayout {
                &self.0.layout
            }
            /// Reference initialisation from the seed law (`Domain::Init`);
            /// see [`crate::model::init`].
            pub fn init_params(&self, seed: u64) -> Vec<f32> {
                $crate::model::init::init_params(&self.0.cfg, &self.0.layout, seed)
            }
            /// Mean loss over `batch`; *overwrites* `grads` (same layout as
            /// `params`) with d loss / d params. With no counted target the
            /// loss is 0 and the gradients are all 0.
            pub fn forward_backward(
                &self,
                params: &[f32],
                batch: &$crate::model::Batch,
                grads: &mut [f32],
            ) -> $crate::error::Result<f32> {
                self.0
                    .with_cache(|n, ws| n.forward_backward_in(params, batch, grads, ws))
                    .map(|l| l as f32)
            }
            /// Mean loss only.
            pub fn loss(
                &self,
                params: &[f32],
                batch: &$crate::model::Batch,
            ) -> $crate::error::Result<f32> {
                self.0
                    .with_cache(|n, ws| n.loss_in(params, batch, ws))
                    .map(|l| l as f32)
            }
            /// Logits `[batch, seq_len, vocab]`, row-major.
            pub fn logits(
                &self,
                params: &[f32],
                batch: &$crate::model::Batch,
            ) -> $crate::error::Result<Vec<f32>> {
                self.0.with_cache(|n, ws| n.logits_in(params, batch, ws))
            }
            /// [`forward_backward`](Self::forward_backward) in f64: the same
            /// program (same operations, same order) over f64, the reference
            /// for gradient checks and for pinning other implementations.
            pub fn forward_backward_f64(
                &self,
                params: &[f64],
                batch: &$crate::model::Batch,
                grads: &mut [f64],
            ) -> $crate::error::Result<f64> {
                let mut ws = Default::default();
                self.0.forward_backward_in(params, batch, grads, &mut ws)
            }
            /// [`loss`](Self::loss) in f64.
            pub fn loss_f64(
                &self,
                params: &[f64],
                batch: &$crate::model::Batch,
            ) -> $crate::error::Result<f64> {
                self.0.loss_in(params, batch, &mut Default::default())
            }
            /// [`logits`](Self::logits) in f64.
            pub fn logits_f64(
                &self,
                params: &[f64],
                batch: &$crate::model::Batch,
            ) -> $crate::error::Result<Vec<f64>> {
                self.0.logits_in(params, batch, &mut Default::default())
            }
        }

        impl $crate::model::HostModel for $model {
            fn config(&self) -> &$crate::config::ModelConfig {
                $model::config(self)
            }
            fn layout(&self) -> &$crate::params::ParamLayout {
                $model::layout(self)
            }
            fn init_params(&self, seed: u64) -> Vec<f32> {
                $model::init_params(self, seed)
            }
            fn forward_backward(
                &mut self,
                params: &[f32],
                batch: &$crate::model::Batch,
                grads: &mut [f32],
            ) -> $crate::error::Result<f32> {
                $model::forward_backward(self, params, batch, grads)
            }
            fn logits(
                &mut self,
                params: &[f32],
                batch: &$crate::model::Batch,
            ) -> $crate::error::Result<Vec<f32>> {
                $model::logits(self, params, batch)
            }
        }
    };
}
pub(crate) use cpu_model_api;
