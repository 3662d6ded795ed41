//! `mamba-train`: Mamba-1 (CPU reference, CUDA path) and Mamba-2 (SSD; CPU
//! reference, and a CUDA path over the chunked SSD kernels) language models,
//! AdamW,
//! data (synthetic tasks, byte-level or tokenized text, memory-mapped token
//! files, with held-out splits), checkpoints with Hugging Face names, the
//! deterministic data-parallel trainer, and text generation by recurrent
//! decoding (both architectures, on the CPU and on CUDA).

// Lets code shared with the integration tests (`tests/common/bpe.rs`, also
// compiled into the unit tests) name this crate the same way in both.
extern crate self as mamba_train;

pub mod checkpoint;
pub mod cli;
pub mod config;
pub mod data;
pub mod dp;
pub mod error;
pub mod generate;
pub mod metrics;
pub mod model;
pub mod optim;
pub mod params;
pub mod plot;
pub mod run_config;
pub mod seed;
pub mod train;

pub use config::ModelConfig;
pub use error::{Result, TrainError};
pub use params::ParamLayout;
