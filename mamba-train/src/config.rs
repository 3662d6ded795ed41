//! Model shape. Field names follow the Mamba reference; `checkpoint::hf_config::hf_config_json`
//! writes the Hugging Face `MambaConfig` spelling.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Shape of a Mamba-1 language model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Vocabulary size (rows of the tied embedding / LM head).
    pub vocab_size: usize,
    /// Residual width.
    pub d_model: usize,
    /// Number of blocks.
    pub n_layer: usize,
    /// SSM state size N.
    pub d_state: usize,
    /// Causal depthwise conv width.
    pub d_conv: usize,
    /// `d_inner = expand * d_model`.
    pub expand: usize,
    /// Rank of the dt projection; the reference uses `ceil(d_model / 16)`.
    pub dt_rank: usize,
}

/// RMSNorm epsilon (the reference's `layer_norm_epsilon`).
pub const RMS_EPS: f32 = 1e-5;

impl ModelConfig {
    /// A config with the reference defaults (d_state 16, d_conv 4, expand 2,
    /// dt_rank ceil(d_model/16)).
    pub fn new(vocab_size: usize, d_model: usize, n_layer: usize) -> Self {
        ModelConfig {
            vocab_size,
            d_model,
            n_layer,
            d_state: 16,
            d_conv: 4,
            expand: 2,
            dt_rank: d_model.div_ceil(16),
        }
    }

    /// Inner (expanded) width.
    pub fn d_inner(&self) -> usize {
        self.expand * self.d_model
    }

    /// Refuse shapes the model cannot run, naming the field.
    pub fn validate(&self) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("d_model", self.d_model),
            ("n_layer", self.n_layer),
            ("d_state", self.d_state),
            ("d_conv", self.d_conv),
            ("expand", self.expand),
            ("dt_rank", self.dt_rank),
        ];
        for (name, v) in positive {
            if v == 0 {
                return Err(TrainError::setting(name, "must be at least 1, got 0"));
            }
        }
        Ok(())
    }
}
