//! CPU reference model (issue 5 fills this in; signatures are the contract the
//! trainer codes against).

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::Batch;
use crate::params::ParamLayout;

/// The f32 CPU model.
pub struct CpuModel {
    cfg: ModelConfig,
    layout: ParamLayout,
}

impl CpuModel {
    /// A model of shape `cfg` (validated).
    pub fn new(cfg: ModelConfig) -> Result<Self> {
        cfg.validate()?;
        let layout = ParamLayout::new(&cfg);
        Ok(CpuModel { cfg, layout })
    }
    /// The model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    /// The arena layout.
    pub fn layout(&self) -> &ParamLayout {
        &self.layout
    }
    /// Reference initialisation from the seed law (`Domain::Init`).
    pub fn init_params(&self, _seed: u64) -> Vec<f32> {
        todo!("issue 5")
    }
    /// Mean loss over `batch`; *overwrites* `grads` (same layout as `params`)
    /// with d loss / d params.
    pub fn forward_backward(&self, _params: &[f32], _batch: &Batch, _grads: &mut [f32]) -> Result<f32> {
        todo!("issue 5")
    }
    /// Mean loss only.
    pub fn loss(&self, _params: &[f32], _batch: &Batch) -> Result<f32> {
        todo!("issue 5")
    }
    /// Logits `[batch, seq_len, vocab]`, row-major.
    pub fn logits(&self, _params: &[f32], _batch: &Batch) -> Result<Vec<f32>> {
        todo!("issue 5")
    }
}
