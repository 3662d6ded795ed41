//! [`Codec`]: text to token ids and back, one interface for the byte-level
//! model (vocabulary 256) and for a Hugging Face `tokenizer.json` (the
//! `tokenizers` crate), so training, `generate` and `eval` share it.
//!
//! A loaded tokenizer has its truncation and padding turned off (a
//! `tokenizer.json` saved for a classifier may truncate to 512 tokens,
//! which would silently drop text) and encodes without the post-processor's
//! special tokens: documents are separated by the end-of-text token alone
//! (see [`Codec::eos`]).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use tokenizers::Tokenizer;

use crate::error::{Result, TrainError};

/// Vocabulary of the byte-level codec.
pub const BYTE_VOCAB: usize = 256;

/// Names tried, in this order, for the end-of-text token that separates
/// documents: GPT-2 / GPT-NeoX (the Mamba tokenizer), SentencePiece, Llama 3,
/// and two common spellings. The first one the vocabulary holds is the EOS.
pub const EOS_NAMES: [&str; 5] = [
    "<|endoftext|>",
    "</s>",
    "<|end_of_text|>",
    "<eos>",
    "<|eos|>",
];

/// What a run records of its tokenizer: where it was read, its SHA-256 (its
/// identity: a resume with another tokenizer is refused) and what training
/// needs of it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenizerRecord {
    /// The `tokenizer.json` as given with `--tokenizer`.
    pub path: PathBuf,
    /// Hex SHA-256 of the file's bytes.
    pub sha256: String,
    /// Ids it produces are below this (one more than its largest id).
    pub vocab_size: usize,
    /// Its end-of-text token, if it has one ([`EOS_NAMES`]).
    pub eos: Option<u32>,
}

/// A loaded `tokenizer.json` with its bytes and record.
#[derive(Clone)]
pub struct HfCodec {
    tokenizer: Tokenizer,
    json: Arc<Vec<u8>>,
    record: TokenizerRecord,
}

/// Text to token ids and back.
#[derive(Clone)]
pub enum Codec {
    /// Each byte is a token (vocabulary 256); no separator token.
    Bytes,
    /// A Hugging Face tokenizer.
    Hf(Box<HfCodec>),
}

impl std::fmt::Debug for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Codec::Bytes => f.write_str("Codec::Bytes"),
            Codec::Hf(h) => write!(f, "Codec::Hf({:?})", h.record),
        }
    }
}

fn tok_err(path: &Path, what: &str) -> TrainError {
    TrainError::Data(format!(
        "--tokenizer {}: {what} (expected a Hugging Face tokenizer.json)",
        path.display()
    ))
}

impl Codec {
    /// The byte-level codec.
    pub fn bytes() -> Codec {
        Codec::Bytes
    }

    /// Load a `tokenizer.json` (`--tokenizer PATH`).
    pub fn from_file(path: &Path) -> Result<Codec> {
        let bytes = std::fs::read(path).map_err(|e| tok_err(path, &format!("cannot read: {e}")))?;
        Codec::from_json(bytes, path)
    }

    /// A tokenizer from the bytes of a `tokenizer.json` that was read from
    /// `origin` (a file, or a checkpoint's copy; named in errors).
    pub fn from_json(bytes: Vec<u8>, origin: &Path) -> Result<Codec> {
        let mut tokenizer = Tokenizer::from_bytes(&bytes)
            .map_err(|e| tok_err(origin, &format!("not a valid tokenizer: {e}")))?;
        tokenizer
            .with_truncation(None)
            .map_err(|e| tok_err(origin, &format!("cannot turn truncation off: {e}")))?;
        tokenizer.with_padding(None);
        let vocab_size = tokenizer
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        if vocab_size == 0 {
            return Err(tok_err(origin, "its vocabulary is empty"));
        }
        let eos = EOS_NAMES.iter().find_map(|n| tokenizer.token_to_id(n));
        let record = TokenizerRecord {
            path: origin.to_path_buf(),
            sha256: hex::encode(Sha256::digest(&bytes)),
            vocab_size,
            eos,
        };
        Ok(Codec::Hf(Box::new(HfCodec {
            tokenizer,
            json: Arc::new(bytes),
            record,
        })))
    }

    /// Ids are below this.
    pub fn vocab_size(&self) -> usize {
        match self {
            Codec::Bytes => BYTE_VOCAB,
            Codec::Hf(h) => h.record.vocab_size,
        }
    }

    /// The token appended after every document, if any (the byte codec has
    /// none: all 256 ids are bytes).
    pub fn eos(&self) -> Option<u32> {
        match self {
            Codec::Bytes => None,
            Codec::Hf(h) => h.record.eos,
        }
    }

    /// The tokenizer's record (none for bytes).
    pub fn record(&self) -> Option<&TokenizerRecord> {
        match self {
            Codec::Bytes => None,
            Codec::Hf(h) => Some(&h.record),
        }
    }

    /// The `tokenizer.json` bytes (none for bytes): what a checkpoint copies.
    pub fn json(&self) -> Option<&Arc<Vec<u8>>> {
        match self {
            Codec::Bytes => None,
            Codec::Hf(h) => Some(&h.json),
        }
    }

    /// The ids of `text` (no special tokens added).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(self.encode_batch(vec![text])?.pop().unwrap_or_default())
    }

    /// The ids of each of `texts`, in order (in parallel for a tokenizer).
    pub fn encode_batch(&self, texts: Vec<&str>) -> Result<Vec<Vec<u32>>> {
        match self {
            Codec::Bytes => Ok(texts
                .into_iter()
                .map(|t| t.bytes().map(u32::from).collect())
                .collect()),
            Codec::Hf(h) => {
                let enc = h.tokenizer.encode_batch_fast(texts, false).map_err(|e| {
                    TrainError::Data(format!(
                        "the tokenizer {} failed to encode: {e}",
                        h.record.path.display()
                    ))
                })?;
                Ok(enc.into_iter().map(|e| e.get_ids().to_vec()).collect())
            }
        }
    }

    /// The text of `ids`; special tokens are kept as their text. An id the
    /// codec does not have (e.g. a padding row of a model vocabulary larger
    /// than the tokenizer's) is an error naming it. Bytes that are not
    /// UTF-8 decode lossily (U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        let vocab = self.vocab_size();
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(TrainError::Data(format!(
                "token id {bad} is not in the vocabulary of {vocab} ids of {}",
                match self.record() {
                    Some(r) => format!("the tokenizer {}", r.path.display()),
                    None => "the byte-level codec".to_string(),
                }
            )));
        }
        match self {
            Codec::Bytes => {
                let bytes: Vec<u8> = ids.iter().map(|&id| id as u8).collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            Codec::Hf(h) => h.tokenizer.decode(ids, false).map_err(|e| {
                TrainError::Data(format!(
                    "the tokenizer {} failed to decode: {e}",
                    h.record.path.display()
                ))
            }),
        }
    }
}

/// A small BPE tokenizer trained by the `tokenizers` crate itself (shared
/// with the integration tests), so no test downloads one.
#[cfg(test)]
#[path = "../../tests/common/bpe.rs"]
pub(crate) mod testutil;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trained_tokenizer_round_trips_and_knows_its_eos() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("tokenizer.json");
        let lines = testutil::corpus_lines(200);
        testutil::train_tokenizer(&p, &lines, 300);
        let c = Codec::from_file(&p).unwrap();
        assert!(
            c.vocab_size() > 256 && c.vocab_size() <= 300,
            "{}",
            c.vocab_size()
        );
        assert_eq!(c.eos(), Some(0), "the first special token");
        let text = "a selective scan of the state space model 42.";
        let ids = c.encode(text).unwrap();
        assert!(ids.len() < text.len(), "merges shorten the text: {ids:?}");
        assert_eq!(c.decode(&ids).unwrap(), text);
        let e = c.decode(&[c.vocab_size() as u32]).unwrap_err().to_string();
        assert!(e.contains("not in the vocabulary"), "{e}");
        let r = c.record().unwrap();
        assert_eq!(
            r.sha256,
            hex::encode(Sha256::digest(std::fs::read(&p).unwrap()))
        );
    }

    #[test]
    fn bytes_are_their_own_tokens() {
        let c = Codec::bytes();
        assert_eq!(c.encode("hé").unwrap(), [104, 195, 169]);
        assert_eq!(c.decode(&[104, 195, 169]).unwrap(), "hé");
        assert_eq!((c.vocab_size(), c.eos()), (256, None));
        assert!(c.decode(&[256]).is_err());
    }

    #[test]
    fn bad_tokenizer_files_name_the_flag_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.json");
        let e = Codec::from_file(&missing).unwrap_err().to_string();
        assert!(
            e.contains("--tokenizer") && e.contains("missing.json"),
            "{e}"
        );
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, b"{\"not\": \"a tokenizer\"}").unwrap();
        let e = Codec::from_file(&bad).unwrap_err().to_string();
        assert!(
            e.contains("not a valid tokenizer") && e.contains("bad.json"),
            "{e}"
        );
    }
}
