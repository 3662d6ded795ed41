//! The Mamba-1 language model: a CPU reference ([`cpu`]) and, later, a CUDA
//! path, both over the flat arenas of [`crate::params`].

pub mod cpu;
pub mod cuda;
pub mod init;

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
