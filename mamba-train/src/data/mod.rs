//! Training data: the Mamba paper's synthetic tasks and byte-level text.
//!
//! **Sample law.** Row `r` of logical micro-batch `m` at step `s` is a pure
//! function of `(master seed, s, m, r)`: its generator is seeded with
//! `seed::derive(master, Domain::Data, &[s, m, r])`. Nothing takes a rank or a
//! world size, so a step's global batch (logical micro-batches `0..L`) is the
//! same however the L micro-batches are spread over processes, and a resumed
//! run needs only the step number to continue the stream. Evaluation rows use
//! `Domain::Eval` with `[index, r]` and never coincide with training rows.

pub mod accuracy;
pub mod induction;
pub mod selective_copy;
pub mod text;

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::model::Batch;
use crate::seed::{self, Domain, Rng};

pub use accuracy::{accuracy, Accuracy};
pub use induction::InductionConfig;
pub use selective_copy::SelectiveCopyConfig;
pub use text::TextConfig;

/// The task names the CLI accepts.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskKind {
    /// Selective copying.
    SelectiveCopy,
    /// Induction heads.
    Induction,
    /// Byte-level text from a file.
    Text,
}

impl TaskKind {
    /// Every task, in the order the help text lists them.
    pub const ALL: [TaskKind; 3] = [TaskKind::SelectiveCopy, TaskKind::Induction, TaskKind::Text];

    /// The CLI spelling.
    pub fn name(self) -> &'static str {
        match self {
            TaskKind::SelectiveCopy => "selective-copy",
            TaskKind::Induction => "induction",
            TaskKind::Text => "text",
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
                    "unknown task {s:?}; expected one of selective-copy, induction, text"
                ))
            })
    }
}

/// A task and its shape: recorded in checkpoints, compared on resume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum TaskSpec {
    /// Selective copying.
    SelectiveCopy(SelectiveCopyConfig),
    /// Induction heads.
    Induction(InductionConfig),
    /// Byte-level text.
    Text(TextConfig),
}

impl TaskSpec {
    /// Which task this is.
    pub fn kind(&self) -> TaskKind {
        match self {
            TaskSpec::SelectiveCopy(_) => TaskKind::SelectiveCopy,
            TaskSpec::Induction(_) => TaskKind::Induction,
            TaskSpec::Text(_) => TaskKind::Text,
        }
    }

    /// Tokens per row.
    pub fn seq_len(&self) -> usize {
        match self {
            TaskSpec::SelectiveCopy(c) => c.seq_len,
            TaskSpec::Induction(c) => c.seq_len,
            TaskSpec::Text(c) => c.seq_len,
        }
    }

    /// The vocabulary the model must have.
    pub fn vocab_size(&self) -> usize {
        match self {
            TaskSpec::SelectiveCopy(c) => c.vocab_size(),
            TaskSpec::Induction(c) => c.vocab_size(),
            TaskSpec::Text(_) => text::BYTE_VOCAB,
        }
    }

    /// Accuracy of uniform guessing among the possible answers.
    pub fn chance_accuracy(&self) -> f64 {
        match self {
            TaskSpec::SelectiveCopy(c) => 1.0 / c.alphabet as f64,
            TaskSpec::Induction(c) => 1.0 / c.alphabet as f64,
            TaskSpec::Text(_) => 1.0 / text::BYTE_VOCAB as f64,
        }
    }

    /// What the accuracy is measured on, for reports.
    pub fn scored_positions(&self) -> &'static str {
        match self {
            TaskSpec::SelectiveCopy(_) => "answer positions",
            TaskSpec::Induction(_) => "recall positions",
            TaskSpec::Text(_) => "next-byte positions",
        }
    }

    /// Refuse a shape that cannot hold the task.
    pub fn validate(&self) -> Result<()> {
        match self {
            TaskSpec::SelectiveCopy(c) => c.validate(),
            TaskSpec::Induction(c) => c.validate(),
            TaskSpec::Text(c) if c.seq_len == 0 => Err(TrainError::Config(
                "text seq_len must be at least 1, got 0".into(),
            )),
            TaskSpec::Text(_) => Ok(()),
        }
    }
}

/// A task ready to draw batches: the spec plus, for text, the loaded corpus.
#[derive(Clone, Debug)]
pub struct Dataset {
    spec: TaskSpec,
    corpus: Option<Arc<Vec<u8>>>,
    batch: usize,
}

impl Dataset {
    /// A dataset drawing `batch` rows per micro-batch. For text, the corpus is
    /// read from the spec's path and checked against its recorded digest.
    pub fn new(spec: TaskSpec, batch: usize) -> Result<Self> {
        spec.validate()?;
        if batch == 0 {
            return Err(TrainError::Config(
                "batch must be at least 1 row, got 0".into(),
            ));
        }
        let corpus = match &spec {
            TaskSpec::Text(c) => Some(c.reload()?),
            _ => None,
        };
        Ok(Dataset {
            spec,
            corpus,
            batch,
        })
    }

    /// A text dataset from an already loaded corpus (skips re-reading the file).
    pub fn with_corpus(spec: TextConfig, corpus: Arc<Vec<u8>>, batch: usize) -> Result<Self> {
        if corpus.len() as u64 != spec.file_len || corpus.len() < spec.seq_len + 1 {
            return Err(TrainError::Data(format!(
                "corpus of {} bytes does not match the text task ({} bytes, rows of {})",
                corpus.len(),
                spec.file_len,
                spec.seq_len
            )));
        }
        Dataset::new_unchecked(TaskSpec::Text(spec), Some(corpus), batch)
    }

    fn new_unchecked(spec: TaskSpec, corpus: Option<Arc<Vec<u8>>>, batch: usize) -> Result<Self> {
        spec.validate()?;
        if batch == 0 {
            return Err(TrainError::Config(
                "batch must be at least 1 row, got 0".into(),
            ));
        }
        Ok(Dataset {
            spec,
            corpus,
            batch,
        })
    }

    /// The task.
    pub fn spec(&self) -> &TaskSpec {
        &self.spec
    }

    /// Rows per micro-batch.
    pub fn batch_rows(&self) -> usize {
        self.batch
    }

    /// Tokens in one micro-batch.
    pub fn tokens_per_batch(&self) -> usize {
        self.batch * self.spec.seq_len()
    }

    /// Logical micro-batch `micro` of step `step`.
    pub fn train_batch(&self, master: u64, step: u64, micro: u64) -> Batch {
        self.draw(self.batch, |row| {
            seed::derive(master, Domain::Data, &[step, micro, row])
        })
    }

    /// Held-out batch number `index` with `rows` rows (`Domain::Eval`).
    pub fn eval_batch(&self, master: u64, index: u64, rows: usize) -> Batch {
        self.draw(rows, |row| {
            seed::derive(master, Domain::Eval, &[index, row])
        })
    }

    fn draw(&self, rows: usize, row_seed: impl Fn(u64) -> u64) -> Batch {
        let t = self.spec.seq_len();
        let mut tokens = vec![0u32; rows * t];
        let mut targets = vec![0i32; rows * t];
        for (r, (tok, tgt)) in tokens.chunks_mut(t).zip(targets.chunks_mut(t)).enumerate() {
            let mut rng = Rng::new(row_seed(r as u64));
            match &self.spec {
                TaskSpec::SelectiveCopy(c) => c.fill_row(&mut rng, tok, tgt),
                TaskSpec::Induction(c) => c.fill_row(&mut rng, tok, tgt),
                TaskSpec::Text(c) => {
                    // `new`/`with_corpus` always load the corpus of a text task.
                    let corpus = self.corpus.as_deref().map(Vec::as_slice).unwrap_or(&[]);
                    c.fill_row(corpus, &mut rng, tok, tgt)
                }
            }
        }
        Batch {
            tokens,
            targets,
            batch: rows,
            seq_len: t,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::IGNORE;
    use proptest::prelude::*;

    fn copy_spec() -> TaskSpec {
        TaskSpec::SelectiveCopy(SelectiveCopyConfig {
            seq_len: 20,
            n_memorize: 4,
            alphabet: 8,
        })
    }

    #[test]
    fn batches_are_pure_functions_of_seed_step_micro() {
        let d = Dataset::new(copy_spec(), 3).unwrap();
        let a = d.train_batch(11, 5, 2);
        assert_eq!(a, d.train_batch(11, 5, 2));
        assert_ne!(a, d.train_batch(11, 5, 3), "micro-batches must differ");
        assert_ne!(a, d.train_batch(11, 6, 2), "steps must differ");
        assert_ne!(a, d.train_batch(12, 5, 2), "seeds must differ");
        assert_ne!(
            a.tokens,
            d.eval_batch(11, 5, 3).tokens,
            "eval rows are their own stream"
        );
        assert_eq!(a.targets.iter().filter(|&&t| t != IGNORE).count(), 3 * 4);
    }

    proptest! {
        // Row r of a micro-batch does not depend on how many rows are drawn
        // with it: a process drawing a slice of rows sees the same rows.
        #[test]
        fn a_row_depends_only_on_its_own_index(batch in 1usize..6, extra in 1usize..4, step in 0u64..1000) {
            let small = Dataset::new(copy_spec(), batch).unwrap().train_batch(3, step, 1);
            let big = Dataset::new(copy_spec(), batch + extra).unwrap().train_batch(3, step, 1);
            let n = small.tokens.len();
            prop_assert_eq!(&small.tokens[..], &big.tokens[..n]);
            prop_assert_eq!(&small.targets[..], &big.targets[..n]);
        }
    }

    /// The sample law is part of the run format (checkpoints resume into it,
    /// `tests/hf_load.py` re-implements it): pin a few rows.
    #[test]
    fn sample_law_is_pinned() {
        let d = Dataset::new(copy_spec(), 1).unwrap();
        let b = d.eval_batch(3, 2, 1);
        assert_eq!(
            b.tokens,
            [0, 0, 0, 0, 0, 0, 0, 7, 0, 4, 5, 5, 0, 0, 0, 0, 1, 1, 1, 1]
        );
        assert_eq!(&b.targets[16..], [7, 4, 5, 5]);
        let d = Dataset::new(
            TaskSpec::Induction(InductionConfig {
                seq_len: 10,
                alphabet: 5,
            }),
            1,
        )
        .unwrap();
        let b = d.eval_batch(3, 1, 1);
        assert_eq!(b.tokens, [4, 4, 0, 1, 5, 1, 0, 4, 3, 5]);
        assert_eq!(b.targets[9], 1);
    }

    #[test]
    fn task_names_round_trip_and_unknown_is_clear() {
        for k in TaskKind::ALL {
            assert_eq!(k.name().parse::<TaskKind>().unwrap(), k);
        }
        let e = "copying".parse::<TaskKind>().unwrap_err().to_string();
        assert!(e.contains("copying") && e.contains("selective-copy"), "{e}");
    }

    #[test]
    fn spec_serializes_with_a_kind_tag() {
        let j = serde_json::to_string(&copy_spec()).unwrap();
        assert!(j.contains("\"kind\":\"selective-copy\""), "{j}");
        let back: TaskSpec = serde_json::from_str(&j).unwrap();
        assert_eq!(back, copy_spec());
    }

    #[test]
    fn zero_batch_is_refused() {
        let e = Dataset::new(copy_spec(), 0).unwrap_err().to_string();
        assert!(e.contains("batch"), "{e}");
    }
}
