//! A small BPE tokenizer trained by the `tokenizers` crate itself from a
//! generated corpus, so no test downloads one. Shared by the integration
//! tests (`common::bpe`) and the library's unit tests (`data::codec`).
#![allow(dead_code)] // each test crate uses a different part

use std::path::Path;

use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, NormalizerWrapper, TokenizerBuilder};

/// Line `i` of a generated corpus: six words of a small set, then `i`.
pub fn corpus_line(i: usize) -> String {
    let words = [
        "state",
        "space",
        "model",
        "selective",
        "scan",
        "token",
        "mamba",
        "recurrent",
    ];
    let w: Vec<&str> = (0..6)
        .map(|j| words[(i * 7 + j * 3 + i / 5) % words.len()])
        .collect();
    format!("{} {i}.", w.join(" "))
}

/// Lines `0..n` of the generated corpus.
pub fn corpus_lines(n: usize) -> Vec<String> {
    (0..n).map(corpus_line).collect()
}

/// Train a byte-level BPE of at most `vocab` ids, whose id 0 is
/// `<|endoftext|>`, on `lines`, and write its `tokenizer.json` to `path`.
pub fn train_tokenizer(path: &Path, lines: &[String], vocab: usize) {
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab)
        .min_frequency(1)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .special_tokens(vec![AddedToken::from("<|endoftext|>", true)])
        .build();
    let mut tok = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None::<NormalizerWrapper>)
        // No prefix space (as GPT-2's and GPT-NeoX's): decoding gives the
        // text back exactly.
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_post_processor(Some(ByteLevel::default()))
        .with_decoder(Some(ByteLevel::default()))
        .build()
        .expect("a tokenizer builds");
    tok.train(&mut trainer, lines.iter())
        .expect("the tokenizer trains");
    tok.save(path, false).expect("tokenizer.json is written");
}
