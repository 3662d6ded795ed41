//! Training a byte-level BPE tokenizer with the `tokenizers` crate, so a
//! user (and every test) can make a `tokenizer.json` from their own text
//! with nothing downloaded.
//!
//! The tokenizer: byte-level pre-tokenizer without a prefix space (as
//! GPT-2's and GPT-NeoX's, so decoding gives the text back exactly), the
//! 256 byte symbols in its alphabet, `<|endoftext|>` as id 0 (the
//! document separator of [`crate::data::corpus`]), merges learned up to
//! `vocab` ids. Training is deterministic for the same input lines.

use std::path::Path;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, NormalizerWrapper, TokenizerBuilder};

use crate::error::{Result, TrainError};

/// The end-of-text token the trained tokenizer gives id 0.
pub const END_OF_TEXT: &str = "<|endoftext|>";

/// The fewest ids a trained tokenizer may have: the 256 bytes and
/// [`END_OF_TEXT`].
pub const MIN_VOCAB: usize = 257;

/// The `tokenizer.json` of a byte-level BPE of at most `vocab` ids trained
/// on `lines` (see the module docs).
pub fn train_bpe<I>(lines: I, vocab: usize) -> Result<String>
where
    I: Iterator + Send,
    I::Item: AsRef<str> + Send,
{
    if vocab < MIN_VOCAB {
        return Err(TrainError::Config(format!(
            "--vocab-size {vocab} is too small: a byte-level BPE needs at least {MIN_VOCAB} ids \
             (256 bytes and {END_OF_TEXT})"
        )));
    }
    let fail = |what: &str, e: &dyn std::fmt::Display| {
        TrainError::Data(format!("training the tokenizer failed while {what}: {e}"))
    };
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab)
        .min_frequency(1)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
        .build();
    let mut tok = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None::<NormalizerWrapper>)
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_post_processor(Some(ByteLevel::default()))
        .with_decoder(Some(ByteLevel::default()))
        .build()
        .map_err(|e| fail("building it", &e))?;
    tok.train(&mut trainer, lines)
        .map_err(|e| fail("learning merges", &e))?;
    tok.to_string(false).map_err(|e| fail("serializing it", &e))
}

/// Train on the text files `inputs` (files or directories, read as
/// `tokenize` reads them: sorted paths, one document per file) and write
/// the `tokenizer.json` to `out` atomically. Returns the number of files.
pub fn train_bpe_files(inputs: &[std::path::PathBuf], vocab: usize, out: &Path) -> Result<usize> {
    let docs = crate::data::corpus::list_documents(inputs, "INPUT")?;
    let mut lines = Vec::new();
    for d in &docs {
        let bytes = std::fs::read(&d.path)
            .map_err(|e| TrainError::Data(format!("cannot read {}: {e}", d.path.display())))?;
        let text = String::from_utf8_lossy(&bytes);
        lines.extend(text.lines().map(str::to_owned));
    }
    let json = train_bpe(lines.iter(), vocab)?;
    crate::checkpoint::atomic::replace_file(out, json.as_bytes()).map_err(|e| TrainError::Io {
        path: out.display().to_string(),
        source: e,
    })?;
    Ok(docs.len())
}
