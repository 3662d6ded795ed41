//! Training data: the Mamba paper's synthetic tasks, text (byte-level or
//! tokenized with a Hugging Face `tokenizer.json`) and pre-tokenized token
//! files, each language-model task with a held-out split training never
//! reads.
//!
//! **Sample law.** Row `r` of logical micro-batch `m` at step `s` is a pure
//! function of `(master seed, s, m, r)`: its generator is seeded with
//! `seed::derive(master, Domain::Data, &[s, m, r])`. Nothing takes a rank or a
//! world size, so a step's global batch (logical micro-batches `0..L`) is the
//! same however the L micro-batches are spread over processes, and a resumed
//! run needs only the step number to continue the stream. Evaluation rows use
//! `Domain::Eval` with `[index, r]` and never coincide with training rows;
//! for text and token files they are also cut from the held-out split
//! ([`tokens`]), which no training row touches.

pub mod accuracy;
pub mod bpe;
pub mod codec;
pub mod corpus;
mod dataset;
pub mod induction;
pub mod selective_copy;
pub mod text;
pub mod token_file;
pub mod tokenize;
pub mod tokens;

use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

pub use accuracy::{accuracy, Accuracy};
pub use codec::{Codec, TokenizerRecord};
pub use dataset::Dataset;
pub use induction::InductionConfig;
pub use selective_copy::SelectiveCopyConfig;
pub use text::TextConfig;
pub use token_file::TokenFilesConfig;
pub use tokens::{Corpus, TokenDtype};

/// The default model vocabulary of a tokenized run is the tokenizer's,
/// rounded up to a multiple of this (as the Mamba checkpoints of
/// `transformers` pad theirs: 50277 tokens, 50280 embedding rows). The
/// extra rows are never a target; the model learns to give them no mass.
pub const VOCAB_MULTIPLE: usize = 8;

/// The task names the CLI accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// Selective copying.
    SelectiveCopy,
    /// Induction heads.
    Induction,
    /// Text from a file or directory (byte-level or tokenized).
    Text,
    /// Pre-tokenized token files.
    Tokens,
}

impl TaskKind {
    /// Every task, in the order the help text lists them.
    pub const ALL: [TaskKind; 4] = [
        TaskKind::SelectiveCopy,
        TaskKind::Induction,
        TaskKind::Text,
        TaskKind::Tokens,
    ];

    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::SelectiveCopy => "selective-copy",
            TaskKind::Induction => "induction",
            TaskKind::Text => "text",
            TaskKind::Tokens => "tokens",
        }
    }
}

impl fmt::Display for TaskKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TaskKind {
    type Err = TrainError;
    fn from_str(s: &str) -> Result<Self> {
        TaskKind::ALL
            .into_iter()
            .find(|k| k.name() == s)
            .ok_or_else(|| {
                TrainError::Config(format!(
                    "unknown task {s:?}; expected one of selective-copy, induction, text, tokens"
                ))
            })
    }
}

/// A task and its shape: recorded in checkpoints, compared on resume.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum TaskSpec {
    /// Selective copying.
    SelectiveCopy(SelectiveCopyConfig),
    /// Induction heads.
    Induction(InductionConfig),
    /// Text, byte-level or tokenized at the start of the run.
    Text(TextConfig),
    /// Pre-tokenized token files.
    Tokens(TokenFilesConfig),
}

impl TaskSpec {
    /// Which task this is.
    pub fn kind(&self) -> TaskKind {
        match self {
            TaskSpec::SelectiveCopy(_) => TaskKind::SelectiveCopy,
            TaskSpec::Induction(_) => TaskKind::Induction,
            TaskSpec::Text(_) => TaskKind::Text,
            TaskSpec::Tokens(_) => TaskKind::Tokens,
        }
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> usize {
        match self {
            TaskSpec::SelectiveCopy(c) => c.seq_len,
            TaskSpec::Induction(c) => c.seq_len,
            TaskSpec::Text(c) => c.seq_len,
            TaskSpec::Tokens(c) => c.seq_len,
        }
    }

    /// Every token id of the data is below this.
    pub fn token_vocab(&self) -> usize {
        match self {
            TaskSpec::SelectiveCopy(c) => c.vocab_size(),
            TaskSpec::Induction(c) => c.vocab_size(),
            TaskSpec::Text(c) => c.token_vocab(),
            TaskSpec::Tokens(c) => c.vocab_size,
        }
    }

    /// The tokenizer of the data, if it has one.
    pub fn tokenizer(&self) -> Option<&TokenizerRecord> {
        match self {
            TaskSpec::Text(c) => c.tokenizer.as_ref(),
            TaskSpec::Tokens(c) => c.tokenizer.as_ref(),
            _ => None,
        }
    }

    /// True when the model's vocabulary may exceed the data's (a
    /// tokenizer's or a token file's ids); the synthetic tasks and
    /// byte-level text fix it.
    pub fn vocab_is_open(&self) -> bool {
        matches!(self, TaskSpec::Tokens(_)) || self.tokenizer().is_some()
    }

    /// The model vocabulary a run of this task gets by default: the data's,
    /// rounded up to [`VOCAB_MULTIPLE`] when it is open.
    pub fn vocab_size(&self) -> usize {
        let v = self.token_vocab();
        if self.vocab_is_open() {
            v.div_ceil(VOCAB_MULTIPLE) * VOCAB_MULTIPLE
        } else {
            v
        }
    }

    /// Refuse a model vocabulary that cannot hold the data's ids (or, for
    /// a fixed vocabulary, is not it), naming the flags.
    pub fn check_model_vocab(&self, model_vocab: usize) -> Result<()> {
        let data = self.token_vocab();
        if self.vocab_is_open() {
            if model_vocab < data {
                let source = match self.tokenizer() {
                    Some(t) => format!("the tokenizer's (--tokenizer {})", t.path.display()),
                    None => "the token files' (--data)".to_string(),
                };
                return Err(TrainError::Config(format!(
                    "the model's vocabulary of {model_vocab} (--vocab-size) is smaller than \
                     {source} {data}: every token id needs an embedding row; use --vocab-size \
                     {data} or more (default: {})",
                    self.vocab_size()
                )));
            }
        } else if model_vocab < data {
            // A larger vocabulary is a pretrained model's (`--init-from`):
            // the task's tokens are its first ids, the rest stay unused.
            return Err(TrainError::setting(
                "vocab_size",
                format!(
                    "of the model is {model_vocab} but the {} task's tokens need at least {data}",
                    self.kind()
                ),
            ));
        }
        Ok(())
    }

    /// Accuracy of uniform guessing among the possible answers.
    pub fn chance_accuracy(&self) -> f64 {
        match self {
            TaskSpec::SelectiveCopy(c) => 1.0 / c.alphabet as f64,
            TaskSpec::Induction(c) => 1.0 / c.alphabet as f64,
            _ => 1.0 / self.token_vocab() as f64,
        }
    }

    /// What the accuracy is measured on, for reports.
    pub fn scored_positions(&self) -> &'static str {
        match self {
            TaskSpec::SelectiveCopy(_) => "answer positions",
            TaskSpec::Induction(_) => "recall positions",
            TaskSpec::Text(c) if c.tokenizer.is_none() => "next-byte positions",
            TaskSpec::Text(_) | TaskSpec::Tokens(_) => "next-token positions",
        }
    }

    /// Refuse a shape that cannot hold the task.
    pub fn validate(&self) -> Result<()> {
        match self {
            TaskSpec::SelectiveCopy(c) => c.validate(),
            TaskSpec::Induction(c) => c.validate(),
            TaskSpec::Text(_) | TaskSpec::Tokens(_) if self.seq_len() == 0 => Err(
                TrainError::Config(format!("{} seq_len must be at least 1, got 0", self.kind())),
            ),
            TaskSpec::Text(_) | TaskSpec::Tokens(_) => Ok(()),
        }
    }

    /// The codec that turns this task's text into its tokens and back, for
    /// `generate` and `eval`: the byte codec for byte-level text, the
    /// tokenizer for tokenized data. `tokenizer_json` is the copy a
    /// checkpoint holds ([`crate::checkpoint::Checkpoint::tokenizer_json`],
    /// read from `origin`); it must be the tokenizer the task records. The
    /// synthetic tasks have no text and give an error.
    pub fn codec(&self, tokenizer_json: Option<&[u8]>, origin: &Path) -> Result<Codec> {
        match (self.tokenizer(), tokenizer_json) {
            (Some(rec), Some(json)) => {
                let codec = Codec::from_json(json.to_vec(), origin)?;
                let sha = codec
                    .record()
                    .map(|r| r.sha256.as_str())
                    .unwrap_or_default();
                if sha != rec.sha256 {
                    return Err(TrainError::Data(format!(
                        "{} is not the run's tokenizer (sha256 {sha}, the run's {})",
                        origin.display(),
                        rec.sha256
                    )));
                }
                Ok(codec)
            }
            (Some(rec), None) => Err(TrainError::Data(format!(
                "{} holds no tokenizer.json, but the run was trained with the tokenizer {} \
                 (sha256 {}); pass --tokenizer with that file",
                origin.display(),
                rec.path.display(),
                rec.sha256
            ))),
            (None, _) => match self {
                TaskSpec::Text(_) => Ok(Codec::bytes()),
                TaskSpec::Tokens(_) => Err(TrainError::Data(format!(
                    "the run of {} trained on token files without a known tokenizer; pass \
                     --tokenizer tokenizer.json to turn text into its tokens",
                    origin.display()
                ))),
                _ => Err(TrainError::Data(format!(
                    "the run of {} trained on the synthetic {} task, which has no text",
                    origin.display(),
                    self.kind()
                ))),
            },
        }
    }
}
