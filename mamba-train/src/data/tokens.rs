//! Token streams and the rows cut from them: the storage behind the text
//! and token-file tasks, the held-out rule, and the row law.
//!
//! **Row law.** A row of `seq_len` tokens starts at an offset drawn
//! uniformly from `0..=len-(seq_len+1)` of its span (the training span for
//! training rows, the held-out span for evaluation rows), by the row's own
//! generator; the target at each position is the next token. A span is a
//! half-open range of one stream, and a row never leaves its span, so a
//! training row never reads a held-out token.
//!
//! **Held-out rule.** Of a stream of `n` tokens the last
//! `ceil(n * fraction)` are held out ([`held_out_len`]); the same rule cuts
//! an on-the-fly text corpus and the `train.bin`/`val.bin` pair that
//! `mamba-train tokenize` writes, so both see the same split.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::seed::Rng;

/// Width of the tokens of a token file (little-endian, no header).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TokenDtype {
    /// Two bytes per token: vocabularies of at most 65536 (nanoGPT's layout).
    #[default]
    U16,
    /// Four bytes per token.
    U32,
}

impl TokenDtype {
    /// Bytes per token.
    pub fn width(self) -> usize {
        match self {
            TokenDtype::U16 => 2,
            TokenDtype::U32 => 4,
        }
    }

    /// The `--token-dtype` spelling.
    pub fn name(self) -> &'static str {
        match self {
            TokenDtype::U16 => "u16",
            TokenDtype::U32 => "u32",
        }
    }

    /// The largest vocabulary whose ids fit.
    pub fn max_vocab(self) -> u64 {
        match self {
            TokenDtype::U16 => 1 << 16,
            TokenDtype::U32 => 1 << 32,
        }
    }

    /// The narrowest width that holds every id of a vocabulary of `vocab`.
    pub fn for_vocab(vocab: usize) -> TokenDtype {
        if vocab as u64 <= TokenDtype::U16.max_vocab() {
            TokenDtype::U16
        } else {
            TokenDtype::U32
        }
    }

    /// Append `id` in this width (little-endian). The caller has checked
    /// that the vocabulary fits ([`TokenDtype::max_vocab`]).
    pub fn push(self, id: u32, out: &mut Vec<u8>) {
        match self {
            TokenDtype::U16 => out.extend_from_slice(&(id as u16).to_le_bytes()),
            TokenDtype::U32 => out.extend_from_slice(&id.to_le_bytes()),
        }
    }
}

impl fmt::Display for TokenDtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for TokenDtype {
    type Err = TrainError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "u16" => Ok(TokenDtype::U16),
            "u32" => Ok(TokenDtype::U32),
            other => Err(TrainError::Config(format!(
                "unknown --token-dtype {other:?}; expected u16 or u32"
            ))),
        }
    }
}

/// Tokens held out of a stream of `n` with `fraction` (in `(0, 1)`): the
/// last `ceil(n * fraction)`, at most `n`.
pub fn held_out_len(n: u64, fraction: f64) -> u64 {
    ((n as f64 * fraction).ceil() as u64).min(n)
}

/// Refuse a held-out fraction outside `(0, 1)`, naming `flag`.
pub fn check_val_fraction(fraction: f64, flag: &str) -> Result<()> {
    if fraction > 0.0 && fraction < 1.0 {
        Ok(())
    } else {
        Err(TrainError::Config(format!(
            "{flag} must be strictly between 0 and 1 (the share of the tokens held out for \
             evaluation), got {fraction}"
        )))
    }
}

/// The tokens of one stream, in memory or memory-mapped.
pub enum TokenStore {
    /// Byte-level text: each byte is a token.
    Bytes(Vec<u8>),
    /// Text tokenized when the run started.
    Ids(Vec<u32>),
    /// A token file, memory-mapped read-only (see [`super::token_file`] for
    /// the contract that the file is not truncated while mapped).
    Mapped {
        /// The file's mapping; its length is a multiple of the width.
        map: Mmap,
        /// Width of its tokens.
        dtype: TokenDtype,
        /// The file, for errors.
        path: PathBuf,
    },
}

impl fmt::Debug for TokenStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TokenStore::Bytes(b) => write!(f, "Bytes({} tokens)", b.len()),
            TokenStore::Ids(v) => write!(f, "Ids({} tokens)", v.len()),
            TokenStore::Mapped { path, dtype, map } => write!(
                f,
                "Mapped({}, {dtype}, {} tokens)",
                path.display(),
                map.len() / dtype.width()
            ),
        }
    }
}

impl TokenStore {
    /// Tokens in the stream.
    pub fn len(&self) -> usize {
        match self {
            TokenStore::Bytes(b) => b.len(),
            TokenStore::Ids(v) => v.len(),
            TokenStore::Mapped { map, dtype, .. } => map.len() / dtype.width(),
        }
    }

    /// True when the stream holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token `i` (`i < len`).
    pub fn get(&self, i: usize) -> u32 {
        match self {
            TokenStore::Bytes(b) => b[i] as u32,
            TokenStore::Ids(v) => v[i],
            TokenStore::Mapped { map, dtype, .. } => match dtype {
                TokenDtype::U16 => u16::from_le_bytes([map[2 * i], map[2 * i + 1]]) as u32,
                TokenDtype::U32 => {
                    let b = &map[4 * i..4 * i + 4];
                    u32::from_le_bytes([b[0], b[1], b[2], b[3]])
                }
            },
        }
    }

    /// What to call the stream in an error.
    fn origin(&self) -> String {
        match self {
            TokenStore::Mapped { path, .. } => format!("the token file {}", path.display()),
            _ => "the tokenized corpus".into(),
        }
    }
}

/// A half-open range `start..end` of a token stream: the part of a corpus
/// that one kind of row (training or held-out) is cut from.
#[derive(Clone, Debug)]
pub struct TokenSpan {
    store: Arc<TokenStore>,
    start: usize,
    end: usize,
}

impl TokenSpan {
    /// The whole of `store`.
    pub fn whole(store: Arc<TokenStore>) -> TokenSpan {
        let end = store.len();
        TokenSpan {
            store,
            start: 0,
            end,
        }
    }

    /// Tokens `start..end` of `store` (clamped to its length).
    pub fn range(store: Arc<TokenStore>, start: usize, end: usize) -> TokenSpan {
        let end = end.min(store.len());
        TokenSpan {
            store,
            start: start.min(end),
            end,
        }
    }

    /// Tokens in the span.
    pub fn len(&self) -> usize {
        self.end - self.start
    }

    /// True when the span holds no token.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the span lies in its stream.
    pub fn bounds(&self) -> std::ops::Range<usize> {
        self.start..self.end
    }

    /// Token `i` of the span.
    pub fn get(&self, i: usize) -> u32 {
        self.store.get(self.start + i)
    }

    /// Fill one row by the row law, checking every token is below `vocab`.
    /// Returns the row's start in the stream. The span must hold at least
    /// `tokens.len() + 1` tokens (checked when the corpus is loaded).
    ///
    /// The check is here, per row, rather than as a scan at load: it costs
    /// `O(seq_len)` next to a model step, covers exactly the tokens the
    /// model sees, and keeps a start or resume on a 10 GB token file from
    /// reading all of it.
    pub fn fill_row(
        &self,
        rng: &mut Rng,
        vocab: usize,
        tokens: &mut [u32],
        targets: &mut [i32],
    ) -> Result<usize> {
        let t = tokens.len();
        // Offsets 0..=len-(t+1): the row and its last target stay in the span.
        let start = self.start + rng.below((self.len() - t) as u64) as usize;
        for i in 0..=t {
            let id = self.store.get(start + i);
            if id as usize >= vocab {
                return Err(TrainError::Data(format!(
                    "{} holds token id {id} at token offset {} but the vocabulary has {vocab} ids \
                     (0..{vocab}); the file was written for a larger vocabulary or is corrupt \
                     (check --data, --tokenizer and --vocab-size)",
                    self.store.origin(),
                    start + i
                )));
            }
            if i < t {
                tokens[i] = id;
            }
            if i > 0 {
                targets[i - 1] = id as i32;
            }
        }
        Ok(start)
    }
}

/// The loaded data of a text or token-file task: the span training rows
/// are cut from, the held-out span evaluation rows are cut from (disjoint:
/// another file, or the tail of the same stream), the bound every token id
/// is checked against, and the tokenizer's bytes for checkpoints.
#[derive(Clone, Debug)]
pub struct Corpus {
    /// Where training rows come from.
    pub train: TokenSpan,
    /// Where evaluation rows come from; training never reads it.
    pub held_out: TokenSpan,
    /// Every token id is below this (the data's vocabulary).
    pub vocab: usize,
    /// The `tokenizer.json` the tokens were made with, when known: copied
    /// into every checkpoint so `generate` and `eval` can decode.
    pub tokenizer_json: Option<Arc<Vec<u8>>>,
}

impl Corpus {
    /// Refuse spans too short for a row of `seq_len` plus its last target,
    /// naming what to change.
    pub fn check_rows_fit(&self, seq_len: usize, what: &str) -> Result<()> {
        for (span, name) in [(&self.train, "training"), (&self.held_out, "held-out")] {
            if span.len() < seq_len + 1 {
                return Err(TrainError::Data(format!(
                    "{what}: the {name} split has {} tokens; --seq-len {seq_len} needs at least \
                     {} (one row plus the next token){}",
                    span.len(),
                    seq_len + 1,
                    if name == "held-out" {
                        " (a larger --val-fraction or corpus holds out more)"
                    } else {
                        ""
                    }
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seed::Rng;
    use proptest::prelude::*;

    #[test]
    fn rows_are_windows_with_next_token_targets_inside_their_span() {
        let store = Arc::new(TokenStore::Ids((0..100).collect()));
        let span = TokenSpan::range(store, 10, 30);
        let mut t = vec![0u32; 19];
        let mut y = vec![0i32; 19];
        // Only offset 10 fits 19 tokens plus the next one in 10..30.
        let start = span
            .fill_row(&mut Rng::new(3), 100, &mut t, &mut y)
            .unwrap();
        assert_eq!(start, 10);
        assert_eq!(t[0], 10);
        assert_eq!(y[18], 29);
    }

    #[test]
    fn a_token_outside_the_vocabulary_is_named_with_its_offset() {
        let store = Arc::new(TokenStore::Ids(vec![1, 2, 7, 3]));
        let span = TokenSpan::whole(store);
        let (mut t, mut y) = (vec![0u32; 3], vec![0i32; 3]);
        let e = span
            .fill_row(&mut Rng::new(0), 5, &mut t, &mut y)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("token id 7 at token offset 2") && e.contains("5 ids"),
            "{e}"
        );
        // Negative control: the same row in a vocabulary that holds 7.
        assert!(span.fill_row(&mut Rng::new(0), 8, &mut t, &mut y).is_ok());
    }

    #[test]
    fn dtype_names_widths_and_choice() {
        assert_eq!("u16".parse::<TokenDtype>().unwrap(), TokenDtype::U16);
        assert_eq!("u32".parse::<TokenDtype>().unwrap().width(), 4);
        let e = "i64".parse::<TokenDtype>().unwrap_err().to_string();
        assert!(
            e.contains("--token-dtype") && e.contains("u16 or u32"),
            "{e}"
        );
        assert_eq!(TokenDtype::for_vocab(65536), TokenDtype::U16);
        assert_eq!(TokenDtype::for_vocab(65537), TokenDtype::U32);
        let mut b = Vec::new();
        TokenDtype::U16.push(0x0102, &mut b);
        TokenDtype::U32.push(0x03040506, &mut b);
        assert_eq!(b, [2, 1, 6, 5, 4, 3]);
    }

    #[test]
    fn bad_fractions_are_refused_naming_the_flag() {
        for f in [0.0, 1.0, -0.5, f64::NAN] {
            let e = check_val_fraction(f, "--val-fraction").unwrap_err();
            assert!(e.to_string().contains("--val-fraction"), "{e}");
        }
        assert!(check_val_fraction(0.01, "--val-fraction").is_ok());
        assert_eq!(held_out_len(1000, 0.01), 10);
        assert_eq!(held_out_len(1001, 0.01), 11, "rounded up");
    }

    proptest! {
        // Whatever the span and the seed, a row reads only tokens of its
        // span: a training row never touches the held-out tail.
        #[test]
        fn rows_never_leave_their_span(n in 40usize..400, t in 1usize..20, f in 0.05f64..0.5, seed: u64) {
            let held = held_out_len(n as u64, f) as usize;
            prop_assume!(n - held > t && held > t);
            let store = Arc::new(TokenStore::Ids((0..n as u32).collect()));
            let train = TokenSpan::range(store.clone(), 0, n - held);
            let val = TokenSpan::range(store, n - held, n);
            let (mut tok, mut tgt) = (vec![0u32; t], vec![0i32; t]);
            let mut rng = Rng::new(seed);
            for _ in 0..20 {
                train.fill_row(&mut rng, n, &mut tok, &mut tgt).unwrap();
                prop_assert!((tgt[t - 1] as usize) < n - held);
                val.fill_row(&mut rng, n, &mut tok, &mut tgt).unwrap();
                prop_assert!(tok[0] as usize >= n - held);
            }
        }
    }
}
