//! [`Backend`]: what the one training engine
//! ([`Trainer`](crate::train::Trainer)) asks of a device, and [`HostModel`],
//! the smaller interface of a model over host arenas (the CPU Mamba, or a
//! test model) that is a backend as it stands. Defined here, with the
//! models, so that the models implement them and the engine above uses
//! them (no import cycle between `model` and `train`).
//!
//! The engine never touches an arena's contents itself, so the arenas may
//! live anywhere the backend keeps them ([`ArenaMath::Arena`]): host
//! `Vec<f32>` for a [`HostModel`], device memory for the CUDA model
//! (`crate::model::cuda`). A new device, precision or architecture lands
//! as one more implementation; resume, stepping, skipping, checkpoints and
//! evaluation stay in the engine, once.

use std::borrow::Cow;

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::Batch;
use crate::optim::{ArenaMath, HostMath};
use crate::params::ParamLayout;

/// One device's model: arenas of [`ArenaMath::Arena`], the forward and
/// backward pass over them, and (as [`ArenaMath`]) the optimizer's
/// arithmetic.
///
/// Contract: deterministic — the same weights and micro-batch give the same
/// loss and gradient bits, the same gradient gives the same update; every
/// arena the backend hands out has [`Self::layout`]'s length, and an arena
/// of another length passed in is an error, never undefined behaviour.
pub trait Backend: ArenaMath {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;

    /// The arena layout (the same on every device).
    fn layout(&self) -> &ParamLayout;

    /// The device's name for descriptions (`cpu`, `cuda`).
    fn device_name(&self) -> &'static str;

    /// The arithmetic precision of the training step, as checkpoints record
    /// it (`f32`, `tf32`, `bf16`): part of the run's identity.
    fn precision_name(&self) -> &'static str {
        crate::config::Precision::F32.name()
    }

    /// A zero-filled arena.
    fn zeros(&mut self) -> Result<Self::Arena>;

    /// An arena holding `host` (of the layout's length).
    fn upload(&mut self, host: &[f32]) -> Result<Self::Arena>;

    /// The contents of `arena` on the host: borrowed where the arena already
    /// is host memory, downloaded (synchronizing the device) otherwise.
    fn to_host<'a>(&mut self, arena: &'a Self::Arena) -> Result<Cow<'a, [f32]>>;

    /// An arena of `host.len()` elements, any length: the moments of one
    /// ZeRO-1 shard (an empty shard is a valid, empty one). The only
    /// arenas not of the layout's length.
    fn upload_shard(&mut self, host: &[f32]) -> Result<Self::Arena>;

    /// The first `len` elements of a shard arena (from
    /// [`Self::upload_shard`]) on the host; an error when it holds fewer.
    fn shard_to_host<'a>(&mut self, arena: &'a Self::Arena, len: usize) -> Result<Cow<'a, [f32]>>;

    /// Initial weights from the seed law.
    fn init_params(&mut self, seed: u64) -> Result<Self::Arena>;

    /// Mean loss over `batch`; overwrites `grads` with its gradient.
    fn forward_backward(
        &mut self,
        params: &Self::Arena,
        batch: &Batch,
        grads: &mut Self::Arena,
    ) -> Result<f32>;

    /// Logits `[batch, seq_len, vocab]` on the host.
    fn logits(&mut self, params: &Self::Arena, batch: &Batch) -> Result<Vec<f32>>;

    /// Whether every element of `grads` is finite. A backend may answer
    /// `true` without reading the arena when a non-finite element is caught
    /// later anyway (it survives the reduction and makes the global norm
    /// non-finite, which skips the step on every rank alike); it must say so.
    fn all_finite(&mut self, grads: &Self::Arena) -> Result<bool>;
}

/// A model over host arenas; every `HostModel` is a [`Backend`] with
/// `Arena = Vec<f32>` and the CPU's arithmetic ([`HostMath`]).
pub trait HostModel {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// The arena layout.
    fn layout(&self) -> &ParamLayout;
    /// Initial weights from the seed law.
    fn init_params(&self, seed: u64) -> Vec<f32>;
    /// Mean loss over `batch`; overwrites `grads` with its gradient.
    /// `&mut self` so a model may own scratch memory.
    fn forward_backward(&mut self, params: &[f32], batch: &Batch, grads: &mut [f32])
        -> Result<f32>;
    /// Logits `[batch, seq_len, vocab]`.
    fn logits(&mut self, params: &[f32], batch: &Batch) -> Result<Vec<f32>>;
}

/// A boxed host model is one, so that a caller can choose the model at run
/// time (e.g. by architecture) and still drive the one engine:
/// `Box<dyn HostModel + Send>` is a [`Backend`].
impl<M: HostModel + ?Sized> HostModel for Box<M> {
    fn config(&self) -> &ModelConfig {
        (**self).config()
    }
    fn layout(&self) -> &ParamLayout {
        (**self).layout()
    }
    fn init_params(&self, seed: u64) -> Vec<f32> {
        (**self).init_params(seed)
    }
    fn forward_backward(
        &mut self,
        params: &[f32],
        batch: &Batch,
        grads: &mut [f32],
    ) -> Result<f32> {
        (**self).forward_backward(params, batch, grads)
    }
    fn logits(&mut self, params: &[f32], batch: &Batch) -> Result<Vec<f32>> {
        (**self).logits(params, batch)
    }
}

impl<M: HostModel> ArenaMath for M {
    type Arena = Vec<f32>;

    fn norm_partials(
        &mut self,
        grads: &Vec<f32>,
        shard: std::ops::Range<usize>,
    ) -> Result<Vec<f64>> {
        HostMath.norm_partials(grads, shard)
    }

    fn adamw(
        &mut self,
        k: &kernels::mamba::AdamWStep,
        decayed: &[std::ops::Range<usize>],
        shard: std::ops::Range<usize>,
        params: &mut Vec<f32>,
        grads: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
    ) -> Result<()> {
        HostMath.adamw(k, decayed, shard, params, grads, m, v)
    }
}

impl<M: HostModel> Backend for M {
    fn config(&self) -> &ModelConfig {
        HostModel::config(self)
    }
    fn layout(&self) -> &ParamLayout {
        HostModel::layout(self)
    }
    fn device_name(&self) -> &'static str {
        "cpu"
    }
    fn zeros(&mut self) -> Result<Vec<f32>> {
        Ok(vec![0.0; HostModel::layout(self).len()])
    }
    fn upload(&mut self, host: &[f32]) -> Result<Vec<f32>> {
        let cfg = HostModel::config(self);
        crate::model::check_arena_len(cfg, HostModel::layout(self), "arena", host.len())?;
        Ok(host.to_vec())
    }
    fn to_host<'a>(&mut self, arena: &'a Vec<f32>) -> Result<Cow<'a, [f32]>> {
        Ok(Cow::Borrowed(arena))
    }
    fn upload_shard(&mut self, host: &[f32]) -> Result<Vec<f32>> {
        Ok(host.to_vec())
    }
    fn shard_to_host<'a>(&mut self, arena: &'a Vec<f32>, len: usize) -> Result<Cow<'a, [f32]>> {
        arena.get(..len).map(Cow::Borrowed).ok_or_else(|| {
            crate::error::TrainError::Config(format!(
                "an optimizer shard arena holds {} elements, expected {len}",
                arena.len()
            ))
        })
    }
    fn init_params(&mut self, seed: u64) -> Result<Vec<f32>> {
        Ok(HostModel::init_params(self, seed))
    }
    fn forward_backward(
        &mut self,
        params: &Vec<f32>,
        batch: &Batch,
        grads: &mut Vec<f32>,
    ) -> Result<f32> {
        HostModel::forward_backward(self, params, batch, grads)
    }
    fn logits(&mut self, params: &Vec<f32>, batch: &Batch) -> Result<Vec<f32>> {
        HostModel::logits(self, params, batch)
    }
    fn all_finite(&mut self, grads: &Vec<f32>) -> Result<bool> {
        Ok(grads.iter().all(|g| g.is_finite()))
    }
}
