//! `mamba-train tokenize`: text files or directories to the token files of
//! [`super::token_file`] (`train.bin`, `val.bin`, `meta.json`, and a copy of
//! the `tokenizer.json`).
//!
//! The stream is the one `--task text --tokenizer` builds at load
//! ([`super::corpus`]: documents in sorted path order, the end-of-text
//! token after each), and the split is the same held-out rule
//! ([`super::tokens::held_out_len`]): `val.bin` is the stream's last
//! `ceil(n * --val-fraction)` tokens, `train.bin` the rest.
//!
//! **Atomicity.** Tokens go to temp files (`.tmp-tokenize-<pid>-*` in the
//! output directory), which are fsynced and renamed into place; `meta.json`
//! is written last (temp, fsync, rename) and, on `--overwrite`, removed
//! first. So a file named `train.bin` or `val.bin` is always complete, and
//! a directory with a `meta.json` holds one run's complete set (checked by
//! the files' fingerprints when training opens them). A killed run leaves
//! only temp files, which the next `tokenize` into the directory removes.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::codec::Codec;
use super::corpus::{encode_documents, list_documents};
use super::token_file::{
    FileFingerprint, MetaEntry, TokenMeta, META_FILE, META_FORMAT, TOKENIZER_FILE, TRAIN_FILE,
    VAL_FILE,
};
use super::tokens::{check_val_fraction, held_out_len, TokenDtype};
use crate::error::{Result, TrainError};

/// What `mamba-train tokenize` is asked to do.
#[derive(Clone, Debug)]
pub struct TokenizeRequest<'a> {
    /// `--tokenizer`.
    pub tokenizer: &'a Path,
    /// The INPUT files and directories, in order.
    pub inputs: &'a [PathBuf],
    /// `--out`.
    pub out: &'a Path,
    /// `--val-fraction`.
    pub val_fraction: f64,
    /// `--token-dtype` (default: the narrowest that holds the vocabulary).
    pub dtype: Option<TokenDtype>,
    /// `--overwrite`: replace token files already in `--out`.
    pub overwrite: bool,
}

const TEMP_PREFIX: &str = ".tmp-tokenize-";

fn io_err(path: &Path, what: &str, e: io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source: io::Error::new(e.kind(), format!("{what}: {e}")),
    }
}

/// Tokenize `req.inputs` into `req.out`, reporting progress as bytes of
/// text read so far (out of the total passed to `start` first). Returns
/// what `meta.json` records.
pub fn tokenize(
    req: &TokenizeRequest<'_>,
    start: &mut dyn FnMut(u64),
    progress: &mut dyn FnMut(u64),
) -> Result<TokenMeta> {
    check_val_fraction(req.val_fraction, "--val-fraction")?;
    let codec = Codec::from_file(req.tokenizer)?;
    let (vocab, json, sha) = match (&codec, codec.record(), codec.json()) {
        (Codec::Hf(_), Some(r), Some(j)) => (r.vocab_size, j.clone(), r.sha256.clone()),
        _ => {
            return Err(TrainError::Config(
                "--tokenizer must name a tokenizer.json".into(),
            ))
        }
    };
    let dtype = match req.dtype {
        Some(d) if (vocab as u64) > d.max_vocab() => {
            return Err(TrainError::Config(format!(
                "--token-dtype {d} holds ids below {}, but the tokenizer {} has {vocab}; use \
                 --token-dtype u32",
                d.max_vocab(),
                req.tokenizer.display()
            )))
        }
        Some(d) => d,
        None => TokenDtype::for_vocab(vocab),
    };
    if req.inputs.is_empty() {
        return Err(TrainError::Config(
            "tokenize needs at least one INPUT (a text file or a directory of text files)".into(),
        ));
    }
    let docs = list_documents(req.inputs, "INPUT")?;
    let out = req.out;
    fs::create_dir_all(out).map_err(|e| io_err(out, "cannot create --out", e))?;
    let finished: Vec<&str> = [TRAIN_FILE, VAL_FILE, META_FILE, TOKENIZER_FILE]
        .into_iter()
        .filter(|f| out.join(f).exists())
        .collect();
    if !finished.is_empty() && !req.overwrite {
        return Err(TrainError::Config(format!(
            "--out {} already holds token files ({}); pass --overwrite to replace them",
            out.display(),
            finished.join(", ")
        )));
    }
    remove_stale_temps(out);
    let total: u64 = docs
        .iter()
        .map(|d| fs::metadata(&d.path).map_or(0, |m| m.len()))
        .sum();
    start(total);

    let pid = std::process::id();
    let tmp_train = out.join(format!("{TEMP_PREFIX}{pid}-{TRAIN_FILE}"));
    let tmp_val = out.join(format!("{TEMP_PREFIX}{pid}-{VAL_FILE}"));
    let result = write_split(req, &codec, &docs, dtype, &tmp_train, &tmp_val, progress);
    let (stats, n, held) = match result {
        Ok(x) => x,
        Err(e) => {
            // Ours and useless now.
            let _ = fs::remove_file(&tmp_train);
            let _ = fs::remove_file(&tmp_val);
            return Err(e);
        }
    };
    let fingerprint =
        |p: &Path| FileFingerprint::of_file(p).map_err(|e| io_err(p, "cannot read", e));
    let meta = TokenMeta {
        format: META_FORMAT.into(),
        dtype,
        vocab_size: vocab,
        eos: codec.eos(),
        tokenizer_sha256: sha,
        val_fraction: req.val_fraction,
        documents: stats.documents,
        input_bytes: stats.bytes,
        input_sha256: stats.sha256,
        train: MetaEntry {
            file: TRAIN_FILE.into(),
            tokens: n - held,
            fingerprint: fingerprint(&tmp_train)?,
        },
        val: MetaEntry {
            file: VAL_FILE.into(),
            tokens: held,
            fingerprint: fingerprint(&tmp_val)?,
        },
    };
    let meta_json = serde_json::to_vec_pretty(&meta)
        .map_err(|e| TrainError::Data(format!("encoding {META_FILE}: {e}")))?;
    // Publish: the old meta goes first, the new one last.
    let publish = (|| -> io::Result<()> {
        match fs::remove_file(out.join(META_FILE)) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        sync_dir(out)?;
        fs::rename(&tmp_val, out.join(VAL_FILE))?;
        fs::rename(&tmp_train, out.join(TRAIN_FILE))?;
        replace_file(&out.join(TOKENIZER_FILE), &json)?;
        replace_file(&out.join(META_FILE), &meta_json)
    })();
    publish.map_err(|e| io_err(out, "publishing the token files failed", e))?;
    Ok(meta)
}

/// Write the whole stream to `tmp_train`, then move its held-out tail to
/// `tmp_val`; both fsynced. Returns the corpus stats, the stream's length
/// and the held-out length.
fn write_split(
    req: &TokenizeRequest<'_>,
    codec: &Codec,
    docs: &[super::corpus::Document],
    dtype: TokenDtype,
    tmp_train: &Path,
    tmp_val: &Path,
    progress: &mut dyn FnMut(u64),
) -> Result<(super::corpus::CorpusStats, u64, u64)> {
    // Read back later, to move the held-out tail.
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(tmp_train)
        .map_err(|e| io_err(tmp_train, "cannot create", e))?;
    let mut w = BufWriter::with_capacity(1 << 20, file);
    let mut buf = Vec::new();
    let mut done = 0u64;
    let stats = encode_documents(
        codec,
        docs,
        &mut |ids| {
            buf.clear();
            for &id in ids {
                dtype.push(id, &mut buf);
            }
            w.write_all(&buf)
                .map_err(|e| io_err(tmp_train, "cannot write", e))
        },
        &mut |bytes| {
            done += bytes;
            progress(done);
        },
    )?;
    let file = w
        .into_inner()
        .map_err(|e| io_err(tmp_train, "cannot write", e.into_error()))?;
    let n = stats.tokens;
    let held = held_out_len(n, req.val_fraction);
    if n == 0 {
        return Err(TrainError::Data(format!(
            "INPUT: the {} documents hold no text to tokenize",
            stats.documents
        )));
    }
    if held == 0 || held == n {
        return Err(TrainError::Config(format!(
            "--val-fraction {} of {n} tokens holds out {held}: both splits need tokens",
            req.val_fraction
        )));
    }
    let width = dtype.width() as u64;
    let cut = (n - held) * width;
    let split = (|| -> io::Result<()> {
        let mut src = file;
        src.seek(SeekFrom::Start(cut))?;
        let mut val = File::create(tmp_val)?;
        io::copy(&mut (&mut src).take(held * width), &mut val)?;
        val.sync_all()?;
        src.set_len(cut)?;
        src.sync_all()
    })();
    split.map_err(|e| io_err(tmp_val, "cannot split off the held-out tokens", e))?;
    Ok((stats, n, held))
}

/// Remove temp files of interrupted runs (best effort: they are ours by
/// name, and one left behind only wastes space).
fn remove_stale_temps(dir: &Path) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(TEMP_PREFIX) {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// Write `bytes` to a temp file beside `path`, fsync, rename over `path`,
/// fsync the directory.
fn replace_file(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(
        "{TEMP_PREFIX}{}-{}",
        std::process::id(),
        name.unwrap_or_default()
    ));
    let written = (|| -> io::Result<()> {
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = fs::remove_file(&tmp);
        return written;
    }
    sync_dir(dir)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::codec::testutil::{corpus_line, train_tokenizer};
    use crate::data::text::TextConfig;
    use crate::data::token_file::{read_meta, TokenFilesConfig, TokenRequest};

    /// A corpus directory of `files` nested documents, and a tokenizer
    /// trained on the same kind of text.
    fn corpus(root: &Path, files: usize) -> (PathBuf, PathBuf) {
        let dir = root.join("corpus");
        for i in 0..files {
            let sub = dir.join(format!("part{}", i % 3));
            fs::create_dir_all(&sub).unwrap();
            let lines: Vec<String> = (0..20).map(|j| corpus_line(i * 20 + j)).collect();
            fs::write(sub.join(format!("doc{i:02}.txt")), lines.join("\n")).unwrap();
        }
        let tok = root.join("tokenizer.json");
        let lines: Vec<String> = (0..400).map(corpus_line).collect();
        train_tokenizer(&tok, &lines, 320);
        (dir, tok)
    }

    fn read_u(path: &Path, dtype: TokenDtype) -> Vec<u32> {
        let b = fs::read(path).unwrap();
        match dtype {
            TokenDtype::U16 => b
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]) as u32)
                .collect(),
            TokenDtype::U32 => b
                .chunks_exact(4)
                .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        }
    }

    fn request<'a>(tok: &'a Path, inputs: &'a [PathBuf], out: &'a Path) -> TokenizeRequest<'a> {
        TokenizeRequest {
            tokenizer: tok,
            inputs,
            out,
            val_fraction: 0.1,
            dtype: None,
            overwrite: false,
        }
    }

    #[test]
    fn token_files_are_the_text_tasks_stream_and_split_in_either_width() {
        let root = tempfile::tempdir().unwrap();
        let (dir, tok) = corpus(root.path(), 7);
        let inputs = [dir.clone()];
        let out16 = root.path().join("t16");
        let mut total = 0;
        let mut last = 0;
        let meta = tokenize(
            &request(&tok, &inputs, &out16),
            &mut |t| total = t,
            &mut |d| last = d,
        )
        .unwrap();
        assert!(
            total > 0 && last == total,
            "progress ends at the total: {last} of {total}"
        );
        assert_eq!(meta.dtype, TokenDtype::U16, "a vocabulary of 320 fits u16");
        assert_eq!(read_meta(&out16).unwrap().as_ref(), Some(&meta));
        let (train, val) = (
            read_u(&out16.join(TRAIN_FILE), TokenDtype::U16),
            read_u(&out16.join(VAL_FILE), TokenDtype::U16),
        );
        assert_eq!(
            (train.len() as u64, val.len() as u64),
            (meta.train.tokens, meta.val.tokens)
        );
        // The same stream and split as `--task text --tokenizer` at load.
        let (cfg, corpus) = TextConfig::from_data(&dir, Some(&tok), 16, 0.1).unwrap();
        assert_eq!(cfg.held_out_tokens, meta.val.tokens);
        let stream: Vec<u32> = (0..corpus.train.len())
            .map(|i| corpus.train.get(i))
            .chain((0..corpus.held_out.len()).map(|i| corpus.held_out.get(i)))
            .collect();
        assert_eq!(stream, [train.clone(), val.clone()].concat());
        assert_eq!(cfg.corpus_sha256, meta.input_sha256);
        // u32 files hold the same tokens, and open with their width.
        let out32 = root.path().join("t32");
        let req = TokenizeRequest {
            dtype: Some(TokenDtype::U32),
            ..request(&tok, &inputs, &out32)
        };
        tokenize(&req, &mut |_| {}, &mut |_| {}).unwrap();
        assert_eq!(read_u(&out32.join(TRAIN_FILE), TokenDtype::U32), train);
        assert_eq!(read_u(&out32.join(VAL_FILE), TokenDtype::U32), val);
        let open = |dir: &Path, dtype| {
            TokenFilesConfig::open(TokenRequest {
                data: dir,
                seq_len: 16,
                dtype,
                tokenizer: None,
                vocab_size: None,
            })
        };
        let (c32, k32) = open(&out32, None).unwrap();
        assert_eq!(c32.dtype, TokenDtype::U32);
        assert_eq!(k32.train.len(), train.len());
        assert_eq!(
            c32.tokenizer.as_ref().map(|t| &t.sha256),
            Some(&meta.tokenizer_sha256)
        );
        let e = open(&out32, Some(TokenDtype::U16)).unwrap_err().to_string();
        assert!(
            e.contains("--token-dtype u16 disagrees") && e.contains("u32"),
            "{e}"
        );
        // Deterministic: another run writes the same bytes.
        let again = root.path().join("again");
        tokenize(&request(&tok, &inputs, &again), &mut |_| {}, &mut |_| {}).unwrap();
        for f in [TRAIN_FILE, VAL_FILE, META_FILE] {
            assert_eq!(
                fs::read(out16.join(f)).unwrap(),
                fs::read(again.join(f)).unwrap(),
                "{f}"
            );
        }
    }

    #[test]
    fn a_failed_run_leaves_no_finished_file_and_finished_files_need_overwrite() {
        let root = tempfile::tempdir().unwrap();
        let (dir, tok) = corpus(root.path(), 3);
        // A non-UTF-8 document after valid ones fails the run mid-way.
        fs::write(dir.join("part2/zz.txt"), b"\xff\xfe").unwrap();
        let out = root.path().join("out");
        let inputs = [dir.clone()];
        let e = tokenize(&request(&tok, &inputs, &out), &mut |_| {}, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("zz.txt") && e.contains("not UTF-8"), "{e}");
        let left: Vec<_> = fs::read_dir(&out).unwrap().flatten().collect();
        assert!(left.is_empty(), "nothing left behind: {left:?}");
        fs::remove_file(dir.join("part2/zz.txt")).unwrap();
        tokenize(&request(&tok, &inputs, &out), &mut |_| {}, &mut |_| {}).unwrap();
        let e = tokenize(&request(&tok, &inputs, &out), &mut |_| {}, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("--overwrite") && e.contains("train.bin"), "{e}");
        let req = TokenizeRequest {
            overwrite: true,
            val_fraction: 0.5,
            ..request(&tok, &inputs, &out)
        };
        let meta = tokenize(&req, &mut |_| {}, &mut |_| {}).unwrap();
        assert_eq!(
            read_meta(&out).unwrap().unwrap().val.tokens,
            meta.val.tokens
        );
        let names: Vec<String> = fs::read_dir(&out)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(names.is_empty(), "no temp files: {names:?}");
        let bad = TokenizeRequest {
            val_fraction: 1.5,
            ..request(&tok, &inputs, &out)
        };
        let e = tokenize(&bad, &mut |_| {}, &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(e.contains("--val-fraction"), "{e}");
    }
}
