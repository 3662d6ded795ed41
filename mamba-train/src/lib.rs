//! `mamba-train`: a Mamba-1 language model (CPU reference, CUDA path), AdamW,
//! synthetic and byte-level data, checkpoints, and the deterministic
//! data-parallel trainer.

pub mod config;
pub mod error;
pub mod model;
pub mod params;
pub mod seed;

pub use config::ModelConfig;
pub use error::{Result, TrainError};
pub use params::ParamLayout;
