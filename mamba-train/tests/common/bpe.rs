//! A small BPE tokenizer trained by the `tokenizers` crate itself from a
//! generated corpus, so no test downloads one. Shared by the integration
//! tests (`common::bpe`) and the library's unit tests (`data::codec`).
#![allow(dead_code)] // each test crate uses a different part

use std::path::Path;

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
/// `<|endoftext|>`, on `lines`, and write its `tokenizer.json` to `path`
/// (the library's trainer, which `mamba-train train-tokenizer` runs).
pub fn train_tokenizer(path: &Path, lines: &[String], vocab: usize) {
    let json =
        mamba_train::data::bpe::train_bpe(lines.iter(), vocab).expect("the tokenizer trains");
    std::fs::write(path, json).expect("tokenizer.json is written");
}
