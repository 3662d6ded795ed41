//! Model shape. Field names follow the Mamba reference; `checkpoint::hf_config::hf_config_json`
//! writes the Hugging Face `MambaConfig` spelling.
//!
//! One [`ModelConfig`] describes both architectures: [`Arch::Mamba1`] (the
//! default) and [`Arch::Mamba2`] (the SSD mixer, with its own
//! [`SsdConfig`]). The engine reads the model's shape only here (through
//! [`crate::train::RunConfig::model`]), so a new architecture needs no
//! second trainer. A Mamba-1 config serializes and fingerprints exactly as
//! before the architecture existed: the `arch` field is left out of its
//! JSON, and an absent field reads back as Mamba-1.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Shape of a Mamba language model (Mamba-1 or Mamba-2, by [`Self::arch`]).
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
    /// Mamba-2 has no dt projection and ignores it (Hugging Face's
    /// `Mamba2Config.time_step_rank` is likewise unused by its model).
    pub dt_rank: usize,
    /// The block architecture; Mamba-1 when absent from the JSON, and never
    /// written for Mamba-1 (so Mamba-1 configs keep their old bytes).
    #[serde(default, skip_serializing_if = "Arch::is_mamba1")]
    pub arch: Arch,
}

/// Which mixer the blocks use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// The selective scan of Mamba (`MambaForCausalLM`).
    #[default]
    Mamba1,
    /// The state-space-duality mixer of Mamba-2 (`Mamba2ForCausalLM`).
    Mamba2(SsdConfig),
}

impl Arch {
    /// Whether this is Mamba-1 (the default, never serialized).
    pub fn is_mamba1(&self) -> bool {
        matches!(self, Arch::Mamba1)
    }
    /// The name the command line and checkpoints use (`mamba1`, `mamba2`).
    pub fn name(&self) -> &'static str {
        match self {
            Arch::Mamba1 => "mamba1",
            Arch::Mamba2(_) => "mamba2",
        }
    }
}

/// The Mamba-2 fields of a [`ModelConfig`] (Hugging Face `Mamba2Config`
/// spelling). The number of heads is derived: `d_inner / head_dim`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SsdConfig {
    /// Channels per head (`head_dim`, P); divides `d_inner`.
    pub head_dim: usize,
    /// Groups of heads sharing one B and one C (`n_groups`, G); divides the
    /// number of heads.
    pub n_groups: usize,
    /// Tokens per chunk of the SSD scan (`chunk_size`, Q). It decides the
    /// summation order of the scan, so it is part of the run's identity.
    pub chunk_size: usize,
}

impl SsdConfig {
    /// The reference defaults: `head_dim` 64, one group, chunks of 256.
    pub const DEFAULT: SsdConfig = SsdConfig {
        head_dim: 64,
        n_groups: 1,
        chunk_size: 256,
    };
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
            arch: Arch::Mamba1,
        }
    }

    /// A Mamba-2 config with the reference defaults (d_state 128, d_conv 4,
    /// expand 2, and [`SsdConfig::DEFAULT`] but with `head_dim` capped at
    /// `d_inner` so that tiny models stay valid: `min(64, 2 * d_model)`).
    pub fn mamba2(vocab_size: usize, d_model: usize, n_layer: usize) -> Self {
        let mut c = ModelConfig::new(vocab_size, d_model, n_layer);
        c.d_state = 128;
        c.arch = Arch::Mamba2(SsdConfig {
            head_dim: SsdConfig::DEFAULT.head_dim.min(c.d_inner().max(1)),
            ..SsdConfig::DEFAULT
        });
        c
    }

    /// The Mamba-2 fields, when this is a Mamba-2 config.
    pub fn ssd(&self) -> Option<&SsdConfig> {
        match &self.arch {
            Arch::Mamba1 => None,
            Arch::Mamba2(s) => Some(s),
        }
    }

    /// Number of SSD heads (`d_inner / head_dim`); 0 for Mamba-1.
    pub fn num_heads(&self) -> usize {
        self.ssd().map_or(0, |s| self.d_inner() / s.head_dim.max(1))
    }

    /// Refuse a Mamba-2 config in a model that implements Mamba-1 only
    /// (`what`, e.g. "the CUDA model", and `instead`, what to use), rather
    /// than running it as something else.
    pub fn require_mamba1(&self, what: &str, instead: &str) -> Result<()> {
        match self.arch {
            Arch::Mamba1 => Ok(()),
            Arch::Mamba2(_) => Err(TrainError::Config(format!(
                "{what} implements Mamba-1 only, and this config is Mamba-2; {instead}"
            ))),
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
        let Some(s) = self.ssd() else { return Ok(()) };
        for (name, v) in [
            ("head_dim", s.head_dim),
            ("n_groups", s.n_groups),
            ("chunk_size", s.chunk_size),
        ] {
            if v == 0 {
                return Err(TrainError::setting(name, "must be at least 1, got 0"));
            }
        }
        if self.d_inner() % s.head_dim != 0 {
            return Err(TrainError::setting(
                "head_dim",
                format!(
                    "must divide d_inner = expand x d_model = {}, got {}",
                    self.d_inner(),
                    s.head_dim
                ),
            ));
        }
        if self.num_heads() % s.n_groups != 0 {
            return Err(TrainError::setting(
                "n_groups",
                format!(
                    "must divide the number of heads d_inner / head_dim = {}, got {}",
                    self.num_heads(),
                    s.n_groups
                ),
            ));
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

#[cfg(test)]
mod arch_tests {
    use super::*;

    #[test]
    fn mamba1_json_has_no_arch_and_old_json_reads_as_mamba1() {
        let c = ModelConfig::new(50, 32, 2);
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(
            json,
            r#"{"vocab_size":50,"d_model":32,"n_layer":2,"d_state":16,"d_conv":4,"expand":2,"dt_rank":2}"#
        );
        let back: ModelConfig = serde_json::from_str(&json).unwrap();
        assert_eq!(back, c);
        assert!(back.arch.is_mamba1() && back.ssd().is_none() && back.num_heads() == 0);
    }

    #[test]
    fn mamba2_round_trips_with_its_fields_and_defaults() {
        let c = ModelConfig::mamba2(50, 32, 2);
        assert_eq!(c.d_state, 128);
        assert_eq!(c.ssd().unwrap().head_dim, 64);
        assert_eq!(c.num_heads(), 1);
        let json = serde_json::to_string(&c).unwrap();
        assert!(
            json.contains(r#""arch":{"mamba2":{"head_dim":64,"n_groups":1,"chunk_size":256}}"#),
            "{json}"
        );
        assert_eq!(serde_json::from_str::<ModelConfig>(&json).unwrap(), c);
        c.validate().unwrap();
        assert_eq!(c.arch.name(), "mamba2");
        let e = c
            .require_mamba1("the CUDA model", "use the CPU")
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("the CUDA model implements Mamba-1 only"),
            "{e}"
        );
        ModelConfig::new(5, 8, 1).require_mamba1("x", "y").unwrap();
        // Tiny widths cap head_dim at d_inner.
        assert_eq!(ModelConfig::mamba2(5, 8, 1).ssd().unwrap().head_dim, 16);
    }

    #[test]
    fn mamba2_shapes_that_cannot_work_are_named() {
        let with = |f: &dyn Fn(&mut SsdConfig)| {
            let mut c = ModelConfig::mamba2(50, 32, 2);
            if let Arch::Mamba2(s) = &mut c.arch {
                s.head_dim = 16;
                f(s);
            }
            c.validate().map_err(|e| e.to_string())
        };
        assert!(with(&|_| {}).is_ok(), "4 heads of 16");
        let e = with(&|s| s.head_dim = 24).unwrap_err();
        assert!(e.contains("head_dim") && e.contains("64"), "{e}");
        let e = with(&|s| s.n_groups = 3).unwrap_err();
        assert!(e.contains("n_groups") && e.contains('4'), "{e}");
        assert!(with(&|s| s.n_groups = 4).is_ok());
        for f in [
            &(|s: &mut SsdConfig| s.chunk_size = 0) as &dyn Fn(&mut SsdConfig),
            &|s| s.n_groups = 0,
            &|s| s.head_dim = 0,
        ] {
            assert!(with(f).unwrap_err().contains("at least 1"));
        }
    }
}
