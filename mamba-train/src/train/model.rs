//! The model interface the trainer drives.
//!
//! The trainer needs only these operations over host arenas; the CPU model
//! implements them, and so does a test model inside this crate's unit tests.
//! (The CUDA model keeps its arenas on the device and gets its own driver.)

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::cpu::CpuModel;
use crate::model::Batch;
use crate::params::ParamLayout;

/// What the trainer asks of a model.
pub trait TrainModel {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;
    /// The arena layout.
    fn layout(&self) -> &ParamLayout;
    /// Initial weights from the seed law.
    fn init_params(&self, seed: u64) -> Vec<f32>;
    /// Mean loss over `batch`; overwrites `grads` with its gradient.
    /// `&mut self` so a model may own scratch memory or a device stream.
    fn forward_backward(&mut self, params: &[f32], batch: &Batch, grads: &mut [f32])
        -> Result<f32>;
    /// Logits `[batch, seq_len, vocab]`.
    fn logits(&mut self, params: &[f32], batch: &Batch) -> Result<Vec<f32>>;
}

impl TrainModel for CpuModel {
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
