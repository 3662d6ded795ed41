//! Byte-level language modelling on one file (vocabulary 256).
//!
//! A row is `seq_len` consecutive bytes starting at a uniformly drawn offset;
//! the target at each position is the next byte, so every position counts.
//! The file's length and SHA-256 are part of the task's identity: a resumed
//! run refuses a file that changed since the checkpoint, because the sample
//! stream (a pure function of the seed and the bytes) would silently differ.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::error::{Result, TrainError};
use crate::seed::Rng;

/// Vocabulary of the byte-level task.
pub const BYTE_VOCAB: usize = 256;

/// Identity of a byte-level text task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TextConfig {
    /// The corpus file.
    pub path: PathBuf,
    /// Tokens (bytes) per row.
    pub seq_len: usize,
    /// Length of the file in bytes when the run started.
    pub file_len: u64,
    /// Hex SHA-256 of the file's bytes when the run started.
    pub file_sha256: String,
}

impl TextConfig {
    /// Read `path` and describe a task over it, refusing a file too short to
    /// hold one row plus its final target.
    pub fn from_file(path: &Path, seq_len: usize) -> Result<(TextConfig, Arc<Vec<u8>>)> {
        if seq_len == 0 {
            return Err(TrainError::Config(
                "text seq_len must be at least 1, got 0".into(),
            ));
        }
        let bytes = std::fs::read(path).map_err(|e| {
            TrainError::Data(format!(
                "cannot read the text corpus {}: {e} (pass an existing file with --data PATH)",
                path.display()
            ))
        })?;
        if bytes.len() < seq_len + 1 {
            return Err(TrainError::Data(format!(
                "the text corpus {} has {} bytes; --seq-len {seq_len} needs at least {} (one row plus the next byte)",
                path.display(),
                bytes.len(),
                seq_len + 1
            )));
        }
        let cfg = TextConfig {
            path: path.to_path_buf(),
            seq_len,
            file_len: bytes.len() as u64,
            file_sha256: hex::encode(Sha256::digest(&bytes)),
        };
        Ok((cfg, Arc::new(bytes)))
    }

    /// Re-read the corpus of a recorded task and check it is the same file.
    pub fn reload(&self) -> Result<Arc<Vec<u8>>> {
        let (now, bytes) = TextConfig::from_file(&self.path, self.seq_len)?;
        if now.file_len != self.file_len || now.file_sha256 != self.file_sha256 {
            return Err(TrainError::Data(format!(
                "the text corpus {} changed since the run started: it had {} bytes with sha256 {}, now {} bytes with sha256 {}",
                self.path.display(),
                self.file_len,
                self.file_sha256,
                now.file_len,
                now.file_sha256
            )));
        }
        Ok(bytes)
    }

    /// Fill one row from its own generator.
    pub fn fill_row(&self, corpus: &[u8], rng: &mut Rng, tokens: &mut [u32], targets: &mut [i32]) {
        let t = self.seq_len;
        // Offsets 0..=len-(t+1): the row and its last target stay in the file.
        let start = rng.below((corpus.len() - t) as u64) as usize;
        for i in 0..t {
            tokens[i] = corpus[start + i] as u32;
            targets[i] = corpus[start + i + 1] as i32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_windows_with_next_byte_targets() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.txt");
        std::fs::write(&p, b"abcdefghij").unwrap();
        let (cfg, bytes) = TextConfig::from_file(&p, 9).unwrap();
        // Only offset 0 fits 9 bytes plus the next one.
        let mut t = vec![0u32; 9];
        let mut y = vec![0i32; 9];
        cfg.fill_row(&bytes, &mut Rng::new(5), &mut t, &mut y);
        assert_eq!(t[0], b'a' as u32);
        assert_eq!(y[8], b'j' as i32);
        for i in 0..8 {
            assert_eq!(y[i] as u32, t[i + 1]);
        }
    }

    #[test]
    fn missing_short_and_changed_files_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.txt");
        let e = TextConfig::from_file(&p, 4).unwrap_err().to_string();
        assert!(e.contains("cannot read") && e.contains("c.txt"), "{e}");
        std::fs::write(&p, b"abcd").unwrap();
        let e = TextConfig::from_file(&p, 4).unwrap_err().to_string();
        assert!(e.contains("4 bytes") && e.contains("at least 5"), "{e}");
        std::fs::write(&p, b"abcdef").unwrap();
        let (cfg, _) = TextConfig::from_file(&p, 4).unwrap();
        assert!(cfg.reload().is_ok());
        std::fs::write(&p, b"abcdeg").unwrap();
        let e = cfg.reload().unwrap_err().to_string();
        assert!(e.contains("changed"), "{e}");
    }
}
