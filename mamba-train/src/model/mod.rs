//! The Mamba language models: a CPU reference ([`cpu`]; Mamba-1 and
//! Mamba-2) and a CUDA path ([`cuda`]; Mamba-1), both over the flat arenas
//! of [`crate::params`], each with a recurrent decoder for generation
//! ([`decode`]).

use crate::config::ModelConfig;
use crate::error::{Result, TrainError};
use crate::params::ParamLayout;

pub mod backend;
pub mod cpu;
pub mod cuda;
pub mod decode;
pub mod init;

pub use backend::{Backend, HostModel};
pub use decode::{DecodeState, Decoder};

/// Target value that contributes nothing to the loss (Hugging Face's
/// `ignore_index`).
pub const IGNORE: i32 = -100;

/// One micro-batch of token sequences.
///
/// `tokens` and `targets` are row-major `[batch, seq_len]`. A target of
/// [`IGNORE`] is skipped; the loss is the mean cross-entropy over the other
/// positions (0 when there are none).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    /// Input token ids, each `< vocab_size`.
    pub tokens: Vec<u32>,
    /// Next-token targets or [`IGNORE`].
    pub targets: Vec<i32>,
    /// Number of sequences.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
}

impl Batch {
    /// Check the batch against a vocabulary of `vocab` tokens, for every
    /// model (CPU and CUDA apply the same rules): `batch * seq_len` tokens
    /// and targets, tokens below `vocab`, targets below it or [`IGNORE`].
    /// Returns the number of counted (not ignored) targets.
    pub fn validate(&self, vocab: usize) -> Result<usize> {
        let n = self.batch.checked_mul(self.seq_len).ok_or_else(|| {
            TrainError::Data(format!(
                "batch {} x seq_len {} overflows",
                self.batch, self.seq_len
            ))
        })?;
        if self.tokens.len() != n || self.targets.len() != n {
            return Err(TrainError::Data(format!(
                "batch of {} x {} needs {n} tokens and {n} targets, got {} and {}",
                self.batch,
                self.seq_len,
                self.tokens.len(),
                self.targets.len()
            )));
        }
        if let Some((i, &tok)) = self
            .tokens
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(TrainError::Data(format!(
                "token {tok} at position {i} is outside the vocabulary (size {vocab})"
            )));
        }
        let mut counted = 0;
        for (i, &t) in self.targets.iter().enumerate() {
            if t == IGNORE {
                continue;
            }
            if t < 0 || t as usize >= vocab {
                return Err(TrainError::Data(format!(
                    "target {t} at position {i} is neither in 0..{vocab} nor the ignore value {IGNORE}"
                )));
            }
            counted += 1;
        }
        Ok(counted)
    }
}

/// Refuse an arena (`what`, e.g. "params arena") whose length is not the
/// layout's, naming the model it was meant for.
pub(crate) fn check_arena_len(
    cfg: &ModelConfig,
    layout: &ParamLayout,
    what: &str,
    len: usize,
) -> Result<()> {
    if len != layout.len() {
        return Err(TrainError::Config(format!(
            "{what} has {len} elements; this model ({} layers, d_model {}, vocab {}) needs {}",
            cfg.n_layer,
            cfg.d_model,
            cfg.vocab_size,
            layout.len()
        )));
    }
    Ok(())
}
