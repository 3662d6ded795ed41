//! [`Dataset`]: a task ready to draw batches by the sample law (see the
//! [module doc](super)): the spec, plus for text and token files the loaded
//! corpus with its training and held-out spans.

use std::sync::Arc;

use super::tokens::Corpus;
use super::TaskSpec;
use crate::error::{Result, TrainError};
use crate::model::Batch;
use crate::seed::{self, Domain, Rng};

/// A task ready to draw batches: the spec plus, for text and token files,
/// the loaded corpus.
#[derive(Clone, Debug)]
pub struct Dataset {
    spec: TaskSpec,
    corpus: Option<Arc<Corpus>>,
    batch: usize,
}

impl Dataset {
    /// A dataset drawing `batch` rows per micro-batch. For text and token
    /// files, the corpus is read from the spec's paths and checked against
    /// its recorded identity.
    pub fn new(spec: TaskSpec, batch: usize) -> Result<Self> {
        spec.validate()?;
        let corpus = match &spec {
            TaskSpec::Text(c) => Some(Arc::new(c.reload()?)),
            TaskSpec::Tokens(c) => Some(Arc::new(c.reload()?)),
            _ => None,
        };
        Dataset::assemble(spec, corpus, batch)
    }

    /// A text or token-file dataset from an already loaded corpus (skips
    /// reading the files again); the corpus must be the spec's.
    pub fn with_corpus(spec: TaskSpec, corpus: Arc<Corpus>, batch: usize) -> Result<Self> {
        let (train, held) = match &spec {
            TaskSpec::Text(c) => (c.tokens - c.held_out_tokens, c.held_out_tokens),
            TaskSpec::Tokens(c) => (
                c.train.bytes / c.dtype.width() as u64,
                c.val.bytes / c.dtype.width() as u64,
            ),
            other => {
                return Err(TrainError::Config(format!(
                    "the {} task generates its data; it takes no corpus",
                    other.kind()
                )))
            }
        };
        if corpus.train.len() as u64 != train
            || corpus.held_out.len() as u64 != held
            || corpus.vocab != spec.token_vocab()
        {
            return Err(TrainError::Data(format!(
                "a corpus of {} training and {} held-out tokens (vocabulary {}) does not match \
                 the {} task ({train} and {held}, vocabulary {})",
                corpus.train.len(),
                corpus.held_out.len(),
                corpus.vocab,
                spec.kind(),
                spec.token_vocab()
            )));
        }
        corpus.check_rows_fit(spec.seq_len(), "the corpus")?;
        Dataset::assemble(spec, Some(corpus), batch)
    }

    fn assemble(spec: TaskSpec, corpus: Option<Arc<Corpus>>, batch: usize) -> Result<Self> {
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

    /// The loaded corpus of a text or token-file task.
    pub fn corpus(&self) -> Option<&Corpus> {
        self.corpus.as_deref()
    }

    /// The bytes of the data's `tokenizer.json`, when known (what a
    /// checkpoint copies).
    pub fn tokenizer_json(&self) -> Option<&[u8]> {
        self.corpus
            .as_ref()
            .and_then(|c| c.tokenizer_json.as_deref())
            .map(Vec::as_slice)
    }

    /// Rows per micro-batch.
    pub fn batch_rows(&self) -> usize {
        self.batch
    }

    /// Tokens in one micro-batch.
    pub fn tokens_per_batch(&self) -> usize {
        self.batch * self.spec.seq_len()
    }

    /// Logical micro-batch `micro` of step `step`, from the training split.
    /// Fails only on a token file holding an id outside its vocabulary.
    pub fn train_batch(&self, master: u64, step: u64, micro: u64) -> Result<Batch> {
        self.draw(self.batch, false, |row| {
            seed::derive(master, Domain::Data, &[step, micro, row])
        })
    }

    /// Held-out batch number `index` with `rows` rows (`Domain::Eval`, and
    /// for text and token files the held-out split).
    pub fn eval_batch(&self, master: u64, index: u64, rows: usize) -> Result<Batch> {
        self.draw(rows, true, |row| {
            seed::derive(master, Domain::Eval, &[index, row])
        })
    }

    fn draw(&self, rows: usize, held_out: bool, row_seed: impl Fn(u64) -> u64) -> Result<Batch> {
        let t = self.spec.seq_len();
        let mut tokens = vec![0u32; rows * t];
        let mut targets = vec![0i32; rows * t];
        for (r, (tok, tgt)) in tokens.chunks_mut(t).zip(targets.chunks_mut(t)).enumerate() {
            let mut rng = Rng::new(row_seed(r as u64));
            match (&self.spec, &self.corpus) {
                (TaskSpec::SelectiveCopy(c), _) => c.fill_row(&mut rng, tok, tgt),
                (TaskSpec::Induction(c), _) => c.fill_row(&mut rng, tok, tgt),
                (TaskSpec::Text(_) | TaskSpec::Tokens(_), Some(corpus)) => {
                    let span = if held_out {
                        &corpus.held_out
                    } else {
                        &corpus.train
                    };
                    span.fill_row(&mut rng, corpus.vocab, tok, tgt)?;
                }
                (spec, None) => {
                    return Err(TrainError::Data(format!(
                        "the {} task has no corpus loaded",
                        spec.kind()
                    )))
                }
            }
        }
        Ok(Batch {
            tokens,
            targets,
            batch: rows,
            seq_len: t,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{InductionConfig, SelectiveCopyConfig, TaskKind};
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
        let a = d.train_batch(11, 5, 2).unwrap();
        assert_eq!(a, d.train_batch(11, 5, 2).unwrap());
        assert_ne!(
            a,
            d.train_batch(11, 5, 3).unwrap(),
            "micro-batches must differ"
        );
        assert_ne!(a, d.train_batch(11, 6, 2).unwrap(), "steps must differ");
        assert_ne!(a, d.train_batch(12, 5, 2).unwrap(), "seeds must differ");
        assert_ne!(
            a.tokens,
            d.eval_batch(11, 5, 3).unwrap().tokens,
            "eval rows are their own stream"
        );
        assert_eq!(a.targets.iter().filter(|&&t| t != IGNORE).count(), 3 * 4);
    }

    proptest! {
        // Row r of a micro-batch does not depend on how many rows are drawn
        // with it: a process drawing a slice of rows sees the same rows.
        #[test]
        fn a_row_depends_only_on_its_own_index(batch in 1usize..6, extra in 1usize..4, step in 0u64..1000) {
            let small = Dataset::new(copy_spec(), batch).unwrap().train_batch(3, step, 1).unwrap();
            let big = Dataset::new(copy_spec(), batch + extra).unwrap().train_batch(3, step, 1).unwrap();
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
        let b = d.eval_batch(3, 2, 1).unwrap();
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
        let b = d.eval_batch(3, 1, 1).unwrap();
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

    /// A byte-level text task over a stream whose token `i` is `i`, so a
    /// row's tokens say where it was cut: `n` (at most 256) tokens, the
    /// last `held` held out.
    fn positional(n: usize, held: usize, seq_len: usize) -> Dataset {
        use crate::data::tokens::{TokenSpan, TokenStore};
        let store = Arc::new(TokenStore::Ids((0..n as u32).collect()));
        let spec = TaskSpec::Text(crate::data::TextConfig {
            path: "positions".into(),
            seq_len,
            val_fraction: held as f64 / n as f64,
            tokenizer: None,
            documents: 1,
            corpus_bytes: n as u64,
            corpus_sha256: String::new(),
            tokens: n as u64,
            held_out_tokens: held as u64,
        });
        let corpus = Corpus {
            train: TokenSpan::range(store.clone(), 0, n - held),
            held_out: TokenSpan::range(store, n - held, n),
            vocab: n,
            tokenizer_json: None,
        };
        Dataset::with_corpus(spec, Arc::new(corpus), 4).unwrap()
    }

    proptest! {
        // No training row reads a held-out token (not even as the last
        // target), and every evaluation row lies inside the held-out tail.
        #[test]
        fn training_rows_never_touch_the_held_out_split(
            held in 20usize..60, t in 2usize..16, seed: u64, step in 0u64..1000, micro in 0u64..8,
        ) {
            let n = 256;
            let d = positional(n, held, t);
            let cut = (n - held) as i32;
            let b = d.train_batch(seed, step, micro).unwrap();
            prop_assert!(b.targets.iter().all(|&y| y < cut), "a training row reached the tail");
            let e = d.eval_batch(seed, step, 3).unwrap();
            prop_assert!(e.tokens.iter().all(|&x| x as i32 >= cut), "an eval row left the tail");
        }
    }

    #[test]
    fn training_rows_cover_the_whole_training_split() {
        // Negative control for the property above: rows do reach the end
        // of the training split (so the bound is the split, not an
        // accident of a few seeds).
        let d = positional(256, 40, 8);
        let max = (0..200)
            .map(|s| {
                d.train_batch(1, s, 0)
                    .unwrap()
                    .targets
                    .into_iter()
                    .max()
                    .unwrap()
            })
            .max()
            .unwrap();
        assert_eq!(max, 256 - 40 - 1);
    }

    #[test]
    fn zero_batch_is_refused() {
        let e = Dataset::new(copy_spec(), 0).unwrap_err().to_string();
        assert!(e.contains("batch"), "{e}");
    }
}
