//! Text corpora: which files a `--data` or `tokenize` input means, in what
//! order, and how their text becomes one token stream.
//!
//! **Documents.** An input is a file or a directory. A directory means every
//! regular file below it, recursively, in sorted path order (component by
//! component), skipping names that begin with `.` and not following
//! symbolic links to directories (a link to a file is read). Several
//! inputs are taken in the order given. Each file is one document.
//!
//! **Stream.** Documents are encoded in order; after each one the codec's
//! end-of-text token is appended when it has one ([`Codec::eos`]). A
//! tokenizer encodes a document in pieces of at most [`PIECE_BYTES`], cut
//! just after the last newline inside the limit (else at the last UTF-8
//! character boundary), so memory stays bounded and the pieces depend only
//! on the document's bytes, never on how they were read. The byte codec
//! takes the bytes as they are (any bytes, UTF-8 or not).

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::codec::Codec;
use crate::error::{Result, TrainError};

/// Largest piece of a document given to the tokenizer at once.
pub const PIECE_BYTES: usize = 1 << 20;
/// Text encoded per batch (pieces of several documents, in parallel).
const BATCH_BYTES: usize = 16 << 20;

/// One document of a corpus.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Document {
    /// The file.
    pub path: PathBuf,
    /// Its name in the corpus manifest: relative to the input directory, or
    /// the file name of an input file.
    pub name: String,
}

/// The documents of `inputs` (see the module doc), or an error naming
/// `flag` when an input is missing or a directory holds no file.
pub fn list_documents(inputs: &[PathBuf], flag: &str) -> Result<Vec<Document>> {
    let mut docs = Vec::new();
    for input in inputs {
        let meta = fs::metadata(input).map_err(|e| {
            TrainError::Data(format!(
                "cannot read the text corpus {flag} {}: {e} (expected a text file or a \
                 directory of text files)",
                input.display()
            ))
        })?;
        if meta.is_file() {
            let name = input
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| input.display().to_string());
            docs.push(Document {
                path: input.clone(),
                name,
            });
            continue;
        }
        let mut files = Vec::new();
        walk(input, &mut files).map_err(|e| {
            TrainError::Data(format!(
                "{flag} {}: cannot list the directory: {e}",
                input.display()
            ))
        })?;
        if files.is_empty() {
            return Err(TrainError::Data(format!(
                "{flag} {}: the directory holds no text files (regular files, searched \
                 recursively, names not starting with '.')",
                input.display()
            )));
        }
        files.sort();
        for path in files {
            let name = path
                .strip_prefix(input)
                .unwrap_or(&path)
                .to_string_lossy()
                .into_owned();
            docs.push(Document { path, name });
        }
    }
    Ok(docs)
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in fs::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        let ty = entry.file_type()?;
        if ty.is_dir() {
            walk(&path, out)?;
        } else if ty.is_file() || (ty.is_symlink() && path.is_file()) {
            out.push(path);
        }
    }
    Ok(())
}

/// Length of the first piece of `buf`, which holds the rest of a document
/// when `eof`, else more than [`PIECE_BYTES`] of it.
pub fn piece_len(buf: &[u8], eof: bool) -> usize {
    if eof && buf.len() <= PIECE_BYTES {
        return buf.len();
    }
    let head = &buf[..PIECE_BYTES];
    if let Some(i) = head.iter().rposition(|&b| b == b'\n') {
        return i + 1;
    }
    // `buf[PIECE_BYTES]` exists: back up while it continues a character.
    let mut i = PIECE_BYTES;
    while i > 0 && buf[i] & 0xC0 == 0x80 {
        i -= 1;
    }
    if i == 0 {
        PIECE_BYTES
    } else {
        i
    }
}

/// What reading a corpus found.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CorpusStats {
    /// Documents read.
    pub documents: u64,
    /// Bytes read.
    pub bytes: u64,
    /// Tokens produced (separators included).
    pub tokens: u64,
    /// Hex SHA-256 identifying the text: of the one file's bytes when the
    /// corpus is one file, else of the manifest, one line
    /// `<sha256>  <bytes>  <name>` per document in order.
    pub sha256: String,
}

/// A piece waiting in a batch, and whether it ends its document.
struct Pending {
    text: Vec<u8>,
    ends_document: bool,
    origin: (usize, u64),
}

/// Encode `docs` in order with `codec` into one stream (see the module
/// doc), handing the tokens to `sink` in stream order and the bytes read
/// to `progress`, as they are done.
pub fn encode_documents(
    codec: &Codec,
    docs: &[Document],
    sink: &mut dyn FnMut(&[u32]) -> Result<()>,
    progress: &mut dyn FnMut(u64),
) -> Result<CorpusStats> {
    let mut stats = CorpusStats::default();
    let mut manifest = String::new();
    let mut single = String::new();
    let mut batch: Vec<Pending> = Vec::new();
    let mut batch_bytes = 0usize;
    for (d, doc) in docs.iter().enumerate() {
        let read_err = |e: std::io::Error| {
            TrainError::Data(format!(
                "cannot read the text file {}: {e}",
                doc.path.display()
            ))
        };
        let mut file = fs::File::open(&doc.path).map_err(read_err)?;
        let mut hash = Sha256::new();
        let mut buf: Vec<u8> = Vec::new();
        let (mut eof, mut offset, mut len) = (false, 0u64, 0u64);
        loop {
            while !eof && buf.len() <= PIECE_BYTES {
                let mut chunk = vec![0u8; PIECE_BYTES + 1 - buf.len()];
                let n = file.read(&mut chunk).map_err(read_err)?;
                eof = n == 0;
                hash.update(&chunk[..n]);
                len += n as u64;
                buf.extend_from_slice(&chunk[..n]);
            }
            let cut = if matches!(codec, Codec::Bytes) {
                buf.len().min(PIECE_BYTES)
            } else {
                piece_len(&buf, eof)
            };
            let text: Vec<u8> = buf.drain(..cut).collect();
            let last = eof && buf.is_empty();
            batch_bytes += text.len();
            batch.push(Pending {
                text,
                ends_document: last,
                origin: (d, offset),
            });
            offset += cut as u64;
            if batch_bytes >= BATCH_BYTES {
                flush(codec, docs, &mut batch, sink, &mut stats)?;
                progress(batch_bytes as u64);
                batch_bytes = 0;
            }
            if last {
                break;
            }
        }
        let sha = hex::encode(hash.finalize());
        manifest.push_str(&format!("{sha}  {len}  {}\n", doc.name));
        single = sha;
        stats.documents += 1;
        stats.bytes += len;
    }
    flush(codec, docs, &mut batch, sink, &mut stats)?;
    progress(batch_bytes as u64);
    stats.sha256 = if docs.len() == 1 {
        single
    } else {
        hex::encode(Sha256::digest(manifest.as_bytes()))
    };
    Ok(stats)
}

/// Encode the pending pieces (in parallel) and hand their tokens, with a
/// separator after each document's last piece, to `sink` in order.
fn flush(
    codec: &Codec,
    docs: &[Document],
    batch: &mut Vec<Pending>,
    sink: &mut dyn FnMut(&[u32]) -> Result<()>,
    stats: &mut CorpusStats,
) -> Result<()> {
    let encoded: Vec<Vec<u32>> = match codec {
        Codec::Bytes => batch
            .iter()
            .map(|p| p.text.iter().map(|&b| u32::from(b)).collect())
            .collect(),
        Codec::Hf(_) => {
            let mut texts = Vec::with_capacity(batch.len());
            for p in batch.iter() {
                let text = std::str::from_utf8(&p.text).map_err(|e| {
                    let (d, offset) = p.origin;
                    TrainError::Data(format!(
                        "the text file {} is not UTF-8 near byte {} ({e}); a tokenizer reads \
                         UTF-8 text",
                        docs[d].path.display(),
                        offset + e.valid_up_to() as u64
                    ))
                })?;
                texts.push(text);
            }
            codec.encode_batch(texts)?
        }
    };
    for (ids, p) in encoded.iter().zip(batch.iter()) {
        sink(ids)?;
        stats.tokens += ids.len() as u64;
        if let (true, Some(eos)) = (p.ends_document, codec.eos()) {
            sink(&[eos])?;
            stats.tokens += 1;
        }
    }
    batch.clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directories_are_listed_recursively_in_sorted_order_without_hidden_files() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs::create_dir_all(root.join("b/c")).unwrap();
        fs::create_dir_all(root.join(".git")).unwrap();
        for f in [
            "b/c/z.txt",
            "b/a.txt",
            "a.txt",
            ".hidden",
            ".git/x",
            "b/c/y.md",
        ] {
            fs::write(root.join(f), f).unwrap();
        }
        let docs = list_documents(&[root.to_path_buf()], "--data").unwrap();
        let names: Vec<&str> = docs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["a.txt", "b/a.txt", "b/c/y.md", "b/c/z.txt"]);
        let empty = root.join("empty");
        fs::create_dir(&empty).unwrap();
        let e = list_documents(&[empty], "--data").unwrap_err().to_string();
        assert!(
            e.contains("--data") && e.contains("holds no text files"),
            "{e}"
        );
        let e = list_documents(&[root.join("nope")], "INPUT")
            .unwrap_err()
            .to_string();
        assert!(e.contains("INPUT") && e.contains("nope"), "{e}");
    }

    #[test]
    fn pieces_end_after_a_newline_or_on_a_character_boundary() {
        let mut doc = vec![b'a'; PIECE_BYTES - 10];
        doc.extend_from_slice(b"\nbbbbbbbbbbbbbbbbbbbb");
        assert_eq!(piece_len(&doc, true), PIECE_BYTES - 9);
        // No newline: never inside the two bytes of 'é'.
        let mut doc = vec![b'a'; PIECE_BYTES - 1];
        doc.extend_from_slice("é and more".as_bytes());
        assert_eq!(piece_len(&doc, true), PIECE_BYTES - 1);
        assert_eq!(piece_len(b"short", true), 5);
    }

    #[test]
    fn the_stream_separates_documents_and_names_non_utf8_files() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("bpe.json");
        super::super::codec::testutil::train_tokenizer(
            &p,
            &super::super::codec::testutil::corpus_lines(50),
            280,
        );
        let codec = Codec::from_file(&p).unwrap();
        fs::write(dir.path().join("1.txt"), "mamba scan").unwrap();
        fs::write(dir.path().join("2.txt"), "state space").unwrap();
        let docs = list_documents(
            &[dir.path().join("1.txt"), dir.path().join("2.txt")],
            "INPUT",
        )
        .unwrap();
        let mut got = Vec::new();
        let stats = encode_documents(
            &codec,
            &docs,
            &mut |t| {
                got.extend_from_slice(t);
                Ok(())
            },
            &mut |_| {},
        )
        .unwrap();
        let mut want = codec.encode("mamba scan").unwrap();
        want.push(0);
        want.extend(codec.encode("state space").unwrap());
        want.push(0);
        assert_eq!(got, want);
        assert_eq!(
            (stats.documents, stats.bytes, stats.tokens),
            (2, 21, want.len() as u64)
        );
        fs::write(dir.path().join("3.txt"), b"ok \xff\xfe").unwrap();
        let bad = list_documents(&[dir.path().join("3.txt")], "INPUT").unwrap();
        let e = encode_documents(&codec, &bad, &mut |_| Ok(()), &mut |_| {})
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("3.txt") && e.contains("not UTF-8 near byte 3"),
            "{e}"
        );
        // The byte codec takes the same bytes as they are.
        let mut bytes = Vec::new();
        encode_documents(
            &Codec::bytes(),
            &bad,
            &mut |t| {
                bytes.extend_from_slice(t);
                Ok(())
            },
            &mut |_| {},
        )
        .unwrap();
        assert_eq!(bytes, [111, 107, 32, 255, 254]);
    }
}
