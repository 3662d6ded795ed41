//! Pre-tokenized token files (`--task tokens --data DIR`): nanoGPT's layout,
//! `train.bin` and `val.bin` of raw little-endian tokens with no header,
//! u16 (nanoGPT's) or u32, memory-mapped; plus the `meta.json` and the
//! `tokenizer.json` copy that `mamba-train tokenize` writes beside them.
//!
//! **Width.** The files have no header, so the width comes from
//! `meta.json` when it is present (a `--token-dtype` that disagrees is an
//! error), else from `--token-dtype` (default u16, nanoGPT's).
//!
//! **Identity.** A run records each file's length and a sampled SHA-256
//! ([`FileFingerprint`]): 64 blocks of 64 KiB spread evenly over the file
//! (the whole file when it is at most 4 MiB). Hashing a 10 GB file at every
//! start and resume would take minutes; the sample reads 4 MiB and still
//! catches a file replaced by another, truncated or extended. It does not
//! catch an edit that falls between the sampled blocks of a large file.
//!
//! **Mapping.** The files are mapped read-only and shared. The mapping is
//! sound only while nobody truncates or rewrites a mapped file in place: a
//! truncation makes reads of the lost pages kill the process with SIGBUS,
//! and an in-place write changes the tokens under a running run. Replacing
//! a file by renaming a new one over it (as `tokenize` does) is safe: the
//! run keeps reading the old file.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::codec::{Codec, TokenizerRecord};
use super::tokens::{Corpus, TokenDtype, TokenSpan, TokenStore};
use crate::error::{Result, TrainError};

/// Training tokens of a token directory.
pub const TRAIN_FILE: &str = "train.bin";
/// Held-out tokens of a token directory.
pub const VAL_FILE: &str = "val.bin";
/// What `tokenize` records about the files.
pub const META_FILE: &str = "meta.json";
/// The tokenizer `tokenize` used, copied beside the files.
pub const TOKENIZER_FILE: &str = "tokenizer.json";
/// `format` of a [`TokenMeta`] this build writes and reads.
pub const META_FORMAT: &str = "mamba-train-tokens/1";

const SAMPLE_BLOCKS: u64 = 64;
const SAMPLE_BLOCK: u64 = 64 << 10;

/// A file's length and sampled SHA-256 (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileFingerprint {
    /// Length in bytes.
    pub bytes: u64,
    /// Hex SHA-256 of the length (u64 LE) and the sampled blocks in order.
    pub sampled_sha256: String,
}

impl FileFingerprint {
    /// The fingerprint of `data` (a file's whole contents, e.g. its mapping).
    pub fn of(data: &[u8]) -> FileFingerprint {
        let len = data.len() as u64;
        let mut h = Sha256::new();
        h.update(len.to_le_bytes());
        if len <= SAMPLE_BLOCKS * SAMPLE_BLOCK {
            h.update(data);
        } else {
            let stride = (len - SAMPLE_BLOCK) / (SAMPLE_BLOCKS - 1);
            for k in 0..SAMPLE_BLOCKS {
                let at = (k * stride) as usize;
                h.update(&data[at..at + SAMPLE_BLOCK as usize]);
            }
        }
        FileFingerprint {
            bytes: len,
            sampled_sha256: hex::encode(h.finalize()),
        }
    }
}

impl FileFingerprint {
    /// The fingerprint of the file at `path`, reading only the sampled
    /// blocks (the same value as [`FileFingerprint::of`] its contents).
    pub fn of_file(path: &Path) -> std::io::Result<FileFingerprint> {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = File::open(path)?;
        let len = f.metadata()?.len();
        if len <= SAMPLE_BLOCKS * SAMPLE_BLOCK {
            let mut all = Vec::with_capacity(len as usize);
            f.read_to_end(&mut all)?;
            return Ok(FileFingerprint::of(&all));
        }
        let mut h = Sha256::new();
        h.update(len.to_le_bytes());
        let stride = (len - SAMPLE_BLOCK) / (SAMPLE_BLOCKS - 1);
        let mut block = vec![0u8; SAMPLE_BLOCK as usize];
        for k in 0..SAMPLE_BLOCKS {
            f.seek(SeekFrom::Start(k * stride))?;
            f.read_exact(&mut block)?;
            h.update(&block);
        }
        Ok(FileFingerprint {
            bytes: len,
            sampled_sha256: hex::encode(h.finalize()),
        })
    }
}

/// One file of a [`TokenMeta`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaEntry {
    /// Its name in the directory.
    pub file: String,
    /// Tokens it holds.
    pub tokens: u64,
    /// Its fingerprint.
    pub fingerprint: FileFingerprint,
}

/// `meta.json`: how `tokenize` made the token files. Written last, so a
/// directory with it holds a complete set.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenMeta {
    /// [`META_FORMAT`].
    pub format: String,
    /// Width of the tokens.
    pub dtype: TokenDtype,
    /// Every id is below this.
    pub vocab_size: usize,
    /// The separator appended after each document, if any.
    pub eos: Option<u32>,
    /// Hex SHA-256 of the tokenizer.json used.
    pub tokenizer_sha256: String,
    /// The held-out share (`--val-fraction`).
    pub val_fraction: f64,
    /// Documents read.
    pub documents: u64,
    /// Bytes of text read.
    pub input_bytes: u64,
    /// The text's identity (see `CorpusStats::sha256`).
    pub input_sha256: String,
    /// `train.bin`.
    pub train: MetaEntry,
    /// `val.bin`.
    pub val: MetaEntry,
}

/// Identity of a token-file task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenFilesConfig {
    /// The directory holding `train.bin` and `val.bin`.
    pub dir: PathBuf,
    /// Tokens per row.
    pub seq_len: usize,
    /// Width of the tokens.
    pub dtype: TokenDtype,
    /// Every id is below this: the tokenizer's vocabulary, else `--vocab-size`.
    pub vocab_size: usize,
    /// `train.bin` when the run started.
    pub train: FileFingerprint,
    /// `val.bin` when the run started.
    pub val: FileFingerprint,
    /// The tokenizer of the tokens, when known (`--tokenizer`, else the
    /// directory's `tokenizer.json`).
    pub tokenizer: Option<TokenizerRecord>,
}

/// What the flags ask of a token-file task.
#[derive(Clone, Copy, Debug)]
pub struct TokenRequest<'a> {
    /// `--data`: the directory, or its `train.bin`.
    pub data: &'a Path,
    /// `--seq-len`.
    pub seq_len: usize,
    /// `--token-dtype`, if given.
    pub dtype: Option<TokenDtype>,
    /// `--tokenizer`, if given.
    pub tokenizer: Option<&'a Path>,
    /// `--vocab-size`, if given: the id bound when nothing else knows it.
    pub vocab_size: Option<usize>,
}

fn data_err(msg: String) -> TrainError {
    TrainError::Data(msg)
}

/// The directory `--data` means: itself, or the parent of a `train.bin`.
fn token_dir(data: &Path) -> Result<PathBuf> {
    if data.is_dir() {
        return Ok(data.to_path_buf());
    }
    if data.file_name().is_some_and(|n| n == TRAIN_FILE) && data.is_file() {
        let parent = data.parent().filter(|p| !p.as_os_str().is_empty());
        return Ok(parent.unwrap_or(Path::new(".")).to_path_buf());
    }
    Err(data_err(format!(
        "--data {}: expected a directory holding {TRAIN_FILE} and {VAL_FILE} (as `mamba-train \
         tokenize` writes them, or nanoGPT's prepare scripts), or the path of such a {TRAIN_FILE}",
        data.display()
    )))
}

/// Map `path` read-only after checking its length holds whole tokens.
fn map_tokens(path: &Path, dtype: TokenDtype, dtype_source: &str) -> Result<Mmap> {
    let file = File::open(path)
        .map_err(|e| data_err(format!("--data: cannot open {}: {e}", path.display())))?;
    let len = file
        .metadata()
        .map_err(|e| data_err(format!("--data: cannot stat {}: {e}", path.display())))?
        .len();
    if len % dtype.width() as u64 != 0 {
        return Err(data_err(format!(
            "--data: {} has {len} bytes, not a multiple of {} ({dtype} tokens, {dtype_source}): \
             the file is truncated or holds tokens of another width (--token-dtype u16|u32)",
            path.display(),
            dtype.width()
        )));
    }
    if len == 0 {
        return Err(data_err(format!("--data: {} is empty", path.display())));
    }
    // SAFETY: read-only shared mapping of a file we opened; sound while the
    // file is not truncated or written in place (see the module doc: a
    // truncation is a SIGBUS, an in-place write changes the tokens).
    unsafe { Mmap::map(&file) }
        .map_err(|e| data_err(format!("--data: cannot map {}: {e}", path.display())))
}

/// Read `DIR/meta.json` if it exists.
pub fn read_meta(dir: &Path) -> Result<Option<TokenMeta>> {
    let path = dir.join(META_FILE);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(data_err(format!("cannot read {}: {e}", path.display()))),
    };
    let meta: TokenMeta = serde_json::from_slice(&bytes).map_err(|e| {
        data_err(format!(
            "{} is not a valid token meta file: {e}",
            path.display()
        ))
    })?;
    if meta.format != META_FORMAT {
        return Err(data_err(format!(
            "{} has format {:?}; this build reads {META_FORMAT:?}",
            path.display(),
            meta.format
        )));
    }
    Ok(Some(meta))
}

impl TokenFilesConfig {
    /// Open the token files `req` names, check them (width, meta, tokenizer,
    /// enough tokens for a row) and describe the task over them.
    pub fn open(req: TokenRequest<'_>) -> Result<(TokenFilesConfig, Corpus)> {
        let dir = token_dir(req.data)?;
        let meta = read_meta(&dir)?;
        let meta_path = dir.join(META_FILE);
        let (dtype, dtype_source) = match (&meta, req.dtype) {
            (Some(m), Some(d)) if m.dtype != d => {
                return Err(data_err(format!(
                    "--token-dtype {d} disagrees with {}, which records {} tokens; omit the flag",
                    meta_path.display(),
                    m.dtype
                )))
            }
            (Some(m), _) => (m.dtype, "as meta.json records"),
            (None, Some(d)) => (d, "--token-dtype"),
            (None, None) => (
                TokenDtype::U16,
                "the default without meta.json; else pass --token-dtype",
            ),
        };
        // The tokenizer: the flag, else the directory's copy.
        let beside = dir.join(TOKENIZER_FILE);
        let codec = match req.tokenizer {
            Some(p) => Some(Codec::from_file(p)?),
            None if beside.is_file() => Some(Codec::from_file(&beside)?),
            None => None,
        };
        let record = codec.as_ref().and_then(|c| c.record().cloned());
        if let (Some(m), Some(r)) = (&meta, &record) {
            if m.tokenizer_sha256 != r.sha256 {
                return Err(data_err(format!(
                    "--tokenizer {} (sha256 {}) is not the tokenizer {} records (sha256 {}): \
                     the tokens were made with another tokenizer",
                    r.path.display(),
                    r.sha256,
                    meta_path.display(),
                    m.tokenizer_sha256
                )));
            }
        }
        let vocab = match (&record, &meta, req.vocab_size) {
            (Some(r), _, _) => r.vocab_size,
            (None, Some(m), _) => m.vocab_size,
            (None, None, Some(v)) => v,
            (None, None, None) => {
                return Err(data_err(format!(
                    "--data {}: no {META_FILE} and no tokenizer says which vocabulary the tokens \
                     use; pass --tokenizer tokenizer.json or --vocab-size N",
                    dir.display()
                )))
            }
        };
        let open_one =
            |file: &str, entry: Option<&MetaEntry>| -> Result<(TokenSpan, FileFingerprint)> {
                let path = dir.join(file);
                let map = map_tokens(&path, dtype, dtype_source)?;
                let print = FileFingerprint::of(&map);
                if let Some(e) = entry.filter(|e| e.fingerprint != print) {
                    return Err(data_err(format!(
                    "--data: {} ({} bytes) is not the file {} records ({} tokens, {} bytes): the \
                     directory mixes the files of different runs; run `mamba-train tokenize` again",
                    path.display(),
                    print.bytes,
                    meta_path.display(),
                    e.tokens,
                    e.fingerprint.bytes
                )));
                }
                let store = TokenStore::Mapped { map, dtype, path };
                Ok((TokenSpan::whole(Arc::new(store)), print))
            };
        let (train_span, train) = open_one(TRAIN_FILE, meta.as_ref().map(|m| &m.train))?;
        let (held_out, val) = open_one(VAL_FILE, meta.as_ref().map(|m| &m.val))?;
        let corpus = Corpus {
            train: train_span,
            held_out,
            vocab,
            tokenizer_json: codec.as_ref().and_then(|c| c.json().cloned()),
        };
        corpus.check_rows_fit(req.seq_len, &format!("--data {}", dir.display()))?;
        let cfg = TokenFilesConfig {
            dir,
            seq_len: req.seq_len,
            dtype,
            vocab_size: vocab,
            train,
            val,
            tokenizer: record,
        };
        Ok((cfg, corpus))
    }

    /// Re-open the files of a recorded task and check they are the same
    /// (fingerprints, width, tokenizer).
    pub fn reload(&self) -> Result<Corpus> {
        let tokenizer = self.tokenizer.as_ref().map(|r| r.path.as_path());
        let (now, corpus) = TokenFilesConfig::open(TokenRequest {
            data: &self.dir,
            seq_len: self.seq_len,
            dtype: Some(self.dtype),
            tokenizer,
            vocab_size: Some(self.vocab_size),
        })?;
        let same_tokenizer =
            now.tokenizer.as_ref().map(|r| &r.sha256) == self.tokenizer.as_ref().map(|r| &r.sha256);
        if now.train != self.train || now.val != self.val || !same_tokenizer {
            return Err(data_err(format!(
                "--data {}: the token files or their tokenizer changed since the run started \
                 (train.bin {} bytes, val.bin {} bytes then; {} and {} bytes now)",
                self.dir.display(),
                self.train.bytes,
                self.val.bytes,
                now.train.bytes,
                now.val.bytes
            )));
        }
        Ok(corpus)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write_u16(path: &Path, ids: &[u16]) {
        let b: Vec<u8> = ids.iter().flat_map(|i| i.to_le_bytes()).collect();
        std::fs::write(path, b).unwrap();
    }

    fn req(dir: &Path) -> TokenRequest<'_> {
        TokenRequest {
            data: dir,
            seq_len: 4,
            dtype: None,
            tokenizer: None,
            vocab_size: Some(50),
        }
    }

    #[test]
    fn the_sampled_fingerprint_reads_the_same_from_a_file_and_sees_changes() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("big.bin");
        // Larger than the 4 MiB sample, so blocks are sampled.
        let mut data: Vec<u8> = (0..(5u32 << 20)).map(|i| (i % 251) as u8).collect();
        std::fs::write(&p, &data).unwrap();
        let f = FileFingerprint::of(&data);
        assert_eq!(FileFingerprint::of_file(&p).unwrap(), f);
        data[0] ^= 1;
        assert_ne!(FileFingerprint::of(&data), f, "the first block is sampled");
        data[0] ^= 1;
        data.pop();
        assert_ne!(FileFingerprint::of(&data), f, "the length is hashed");
        let small = b"abc";
        assert_eq!(FileFingerprint::of(small).bytes, 3);
    }

    #[test]
    fn bad_token_files_are_refused_naming_the_file_and_the_flag() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let e = TokenFilesConfig::open(req(&d.join("nowhere")))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--data") && e.contains("train.bin and val.bin"),
            "{e}"
        );
        write_u16(&d.join(TRAIN_FILE), &[1, 2, 3, 4, 5, 6, 7, 8]);
        let e = TokenFilesConfig::open(req(d)).unwrap_err().to_string();
        assert!(e.contains("val.bin") && e.contains("cannot open"), "{e}");
        // A truncated file: an odd number of bytes of u16 tokens.
        std::fs::write(d.join(VAL_FILE), [1u8, 0, 2, 0, 3, 0, 4, 0, 5]).unwrap();
        let e = TokenFilesConfig::open(req(d)).unwrap_err().to_string();
        assert!(
            e.contains("9 bytes, not a multiple of 2") && e.contains("--token-dtype"),
            "{e}"
        );
        // Too short for a row of 4 plus its next token.
        write_u16(&d.join(VAL_FILE), &[1, 2, 3]);
        let e = TokenFilesConfig::open(req(d)).unwrap_err().to_string();
        assert!(
            e.contains("held-out split has 3 tokens") && e.contains("--seq-len 4"),
            "{e}"
        );
        write_u16(&d.join(VAL_FILE), &[1, 2, 3, 4, 5]);
        let no_vocab = TokenRequest {
            vocab_size: None,
            ..req(d)
        };
        let e = TokenFilesConfig::open(no_vocab).unwrap_err().to_string();
        assert!(
            e.contains("--vocab-size") && e.contains("--tokenizer"),
            "{e}"
        );
        // Through the file's train.bin path too; then a changed file is refused.
        let (cfg, corpus) = TokenFilesConfig::open(req(&d.join(TRAIN_FILE))).unwrap();
        assert_eq!((corpus.train.len(), corpus.held_out.len()), (8, 5));
        assert!(cfg.reload().is_ok());
        write_u16(&d.join(VAL_FILE), &[1, 2, 3, 4, 6]);
        let e = cfg.reload().unwrap_err().to_string();
        assert!(e.contains("changed since the run started"), "{e}");
    }
}
