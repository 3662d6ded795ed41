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

/// Arithmetic precision of the CUDA model's GEMMs (`--precision`).
///
/// In every precision the master weights, the f32 gradient arena the
/// reducer sees and AdamW (moments, update) are f32 and the same code; so
/// are the scan state, the norms, the softmax/loss and every reduction. Only
/// the GEMMs' inputs differ:
/// - [`Precision::F32`] (the reference): plain f32 FMA GEMMs;
/// - [`Precision::Tf32`]: tensor-core GEMMs whose inputs are rounded to
///   TF32 (10 mantissa bits), accumulated and output in f32;
/// - [`Precision::Bf16`]: GEMM operands (weights and activations) rounded to
///   bf16 (round to nearest even), accumulated and output in f32.
///
/// Each is deterministic (run to run, and for every P at a fixed logical
/// world) and is part of the run's identity: the bits differ between
/// precisions, checkpoints record it, a resume in another is refused.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// f32 GEMMs (the reference).
    #[default]
    F32,
    /// TF32 tensor-core GEMMs, f32 accumulation.
    Tf32,
    /// bf16 GEMM operands, f32 accumulation and output.
    Bf16,
}

impl Precision {
    /// Every precision, in the order the flag's help lists them.
    pub const ALL: [Precision; 3] = [Precision::F32, Precision::Tf32, Precision::Bf16];

    /// The name the flag and checkpoints use (`f32`, `tf32`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Tf32 => "tf32",
            Precision::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Precision::ALL
            .into_iter()
            .find(|p| p.name() == s)
            .ok_or_else(|| format!("unknown precision {s:?}; expected f32 (default), tf32 or bf16"))
    }
}

#[cfg(test)]
mod precision_tests {
    use super::Precision;

    #[test]
    fn names_round_trip_and_unknown_ones_are_named() {
        for p in Precision::ALL {
            assert_eq!(p.name().parse::<Precision>(), Ok(p));
            assert_eq!(p.to_string(), p.name());
        }
        assert_eq!(Precision::default(), Precision::F32);
        let e = "fp16".parse::<Precision>().unwrap_err();
        assert!(
            e.contains("fp16") && e.contains("bf16") && e.contains("tf32"),
            "{e}"
        );
        assert_eq!(
            crate::checkpoint::PRECISION_F32,
            Precision::F32.name(),
            "checkpoints name f32 as the enum does"
        );
    }
}
