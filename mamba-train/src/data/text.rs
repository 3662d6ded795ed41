//! Language modelling on text (`--task text --data PATH`): a file or a
//! directory of files ([`super::corpus`]), byte-level (vocabulary 256) or
//! tokenized when the run starts with a `tokenizer.json` (`--tokenizer`).
//!
//! The token stream is split by the held-out rule of [`super::tokens`]:
//! the last `ceil(n * --val-fraction)` tokens are held out, training rows
//! are cut from the rest only, evaluation rows from the held-out tail only.
//! The corpus's length and SHA-256 (and the tokenizer's) are part of the
//! task's identity: a resumed run refuses text that changed since the
//! checkpoint, because the sample stream would silently differ.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::codec::{Codec, TokenizerRecord};
use super::corpus::{encode_documents, list_documents, CorpusStats, Document};
use super::tokens::{check_val_fraction, held_out_len, Corpus, TokenSpan, TokenStore};
use crate::error::{Result, TrainError};

/// Vocabulary of the byte-level task.
pub const BYTE_VOCAB: usize = super::codec::BYTE_VOCAB;

/// Identity of a text task.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TextConfig {
    /// The corpus: a file or a directory (`--data`).
    pub path: PathBuf,
    /// Tokens per row.
    pub seq_len: usize,
    /// Share of the tokens held out for evaluation (`--val-fraction`).
    pub val_fraction: f64,
    /// The tokenizer, or none for byte-level text.
    pub tokenizer: Option<TokenizerRecord>,
    /// Files read.
    pub documents: u64,
    /// Bytes of text when the run started.
    pub corpus_bytes: u64,
    /// The text's SHA-256 when the run started: of the file, or of the
    /// manifest of a directory (see [`CorpusStats::sha256`]).
    pub corpus_sha256: String,
    /// Tokens of the whole stream.
    pub tokens: u64,
    /// Tokens held out (the stream's tail).
    pub held_out_tokens: u64,
}

impl TextConfig {
    /// Read and tokenize the corpus at `path` and describe a task over it,
    /// refusing a corpus too short to hold a training row and a held-out
    /// row (each plus its final target).
    pub fn from_data(
        path: &Path,
        tokenizer: Option<&Path>,
        seq_len: usize,
        val_fraction: f64,
    ) -> Result<(TextConfig, Corpus)> {
        if seq_len == 0 {
            return Err(TrainError::Config(
                "text seq_len must be at least 1, got 0".into(),
            ));
        }
        check_val_fraction(val_fraction, "--val-fraction")?;
        let codec = match tokenizer {
            Some(p) => Codec::from_file(p)?,
            None => Codec::bytes(),
        };
        let docs = list_documents(&[path.to_path_buf()], "--data")?;
        let (store, stats) = read_stream(&codec, &docs)?;
        let n = store.len() as u64;
        let held = held_out_len(n, val_fraction);
        let unit = if tokenizer.is_some() {
            "tokens"
        } else {
            "bytes"
        };
        if n < seq_len as u64 + 1 {
            return Err(TrainError::Data(format!(
                "the text corpus {} has {n} {unit}; --seq-len {seq_len} needs at least {} (one row \
                 plus the next token, and as much again held out)",
                path.display(),
                seq_len + 1
            )));
        }
        let store = Arc::new(store);
        let cut = (n - held) as usize;
        let corpus = Corpus {
            train: TokenSpan::range(store.clone(), 0, cut),
            held_out: TokenSpan::range(store, cut, n as usize),
            vocab: codec.vocab_size(),
            tokenizer_json: codec.json().cloned(),
        };
        corpus.check_rows_fit(
            seq_len,
            &format!(
                "the text corpus {} ({n} {unit}, --val-fraction {val_fraction})",
                path.display()
            ),
        )?;
        let cfg = TextConfig {
            path: path.to_path_buf(),
            seq_len,
            val_fraction,
            tokenizer: codec.record().cloned(),
            documents: stats.documents,
            corpus_bytes: stats.bytes,
            corpus_sha256: stats.sha256,
            tokens: n,
            held_out_tokens: held,
        };
        Ok((cfg, corpus))
    }

    /// Re-read the corpus (and tokenizer) of a recorded task and check they
    /// are the same.
    pub fn reload(&self) -> Result<Corpus> {
        let tokenizer = self.tokenizer.as_ref().map(|r| r.path.as_path());
        let (now, corpus) =
            TextConfig::from_data(&self.path, tokenizer, self.seq_len, self.val_fraction)?;
        let sha = |r: &Option<TokenizerRecord>| r.as_ref().map(|r| r.sha256.clone());
        if sha(&now.tokenizer) != sha(&self.tokenizer) {
            return Err(TrainError::Data(format!(
                "the tokenizer {} changed since the run started (sha256 {}, now {}); pass \
                 --tokenizer with the run's tokenizer",
                tokenizer.map_or("(none)".into(), |p| p.display().to_string()),
                sha(&self.tokenizer).unwrap_or_default(),
                sha(&now.tokenizer).unwrap_or_default()
            )));
        }
        if now.corpus_bytes != self.corpus_bytes || now.corpus_sha256 != self.corpus_sha256 {
            return Err(TrainError::Data(format!(
                "the text corpus {} changed since the run started: it had {} bytes with sha256 {}, \
                 now {} bytes with sha256 {}",
                self.path.display(),
                self.corpus_bytes,
                self.corpus_sha256,
                now.corpus_bytes,
                now.corpus_sha256
            )));
        }
        Ok(corpus)
    }

    /// The data's vocabulary: the tokenizer's, or 256 bytes.
    pub fn token_vocab(&self) -> usize {
        self.tokenizer.as_ref().map_or(BYTE_VOCAB, |t| t.vocab_size)
    }
}

/// The token stream of `docs`: bytes as they are, or tokenizer ids.
fn read_stream(codec: &Codec, docs: &[Document]) -> Result<(TokenStore, CorpusStats)> {
    match codec {
        Codec::Bytes => {
            let mut bytes = Vec::new();
            let stats = encode_documents(
                codec,
                docs,
                &mut |t| {
                    bytes.extend(t.iter().map(|&b| b as u8));
                    Ok(())
                },
                &mut |_| {},
            )?;
            Ok((TokenStore::Bytes(bytes), stats))
        }
        Codec::Hf(_) => {
            let mut ids = Vec::new();
            let stats = encode_documents(
                codec,
                docs,
                &mut |t| {
                    ids.extend_from_slice(t);
                    Ok(())
                },
                &mut |_| {},
            )?;
            Ok((TokenStore::Ids(ids), stats))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::seed::Rng;

    #[test]
    fn rows_are_windows_with_next_byte_targets_before_the_held_out_tail() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.txt");
        std::fs::write(&p, b"abcdefghijklmnopqrst").unwrap();
        // 20 bytes, half held out: training rows come from "abcdefghij" only.
        let (cfg, corpus) = TextConfig::from_data(&p, None, 9, 0.5).unwrap();
        assert_eq!((cfg.tokens, cfg.held_out_tokens), (20, 10));
        let (mut t, mut y) = (vec![0u32; 9], vec![0i32; 9]);
        // Only offset 0 fits 9 bytes plus the next one.
        corpus
            .train
            .fill_row(&mut Rng::new(5), 256, &mut t, &mut y)
            .unwrap();
        assert_eq!(t[0], b'a' as u32);
        assert_eq!(y[8], b'j' as i32);
        corpus
            .held_out
            .fill_row(&mut Rng::new(5), 256, &mut t, &mut y)
            .unwrap();
        assert_eq!((t[0], y[8]), (b'k' as u32, b't' as i32));
    }

    #[test]
    fn missing_short_and_changed_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.txt");
        let e = TextConfig::from_data(&p, None, 4, 0.1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("--data") && e.contains("c.txt"), "{e}");
        std::fs::write(&p, b"abcd").unwrap();
        let e = TextConfig::from_data(&p, None, 4, 0.1)
            .unwrap_err()
            .to_string();
        assert!(e.contains("4 bytes") && e.contains("at least 5"), "{e}");
        std::fs::write(&p, b"abcdefghij").unwrap();
        let e = TextConfig::from_data(&p, None, 4, 0.1)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("held-out split has 1 tokens") && e.contains("--val-fraction"),
            "{e}"
        );
        let (cfg, _) = TextConfig::from_data(&p, None, 4, 0.5).unwrap();
        assert!(cfg.reload().is_ok());
        std::fs::write(&p, b"abcdefghik").unwrap();
        let e = cfg.reload().unwrap_err().to_string();
        assert!(e.contains("changed"), "{e}");
    }
}
