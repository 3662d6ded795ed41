//! `mamba-train tokenize`: the command around [`crate::data::tokenize`],
//! with a progress bar (bytes of text read) on stderr when it is a
//! terminal, and a summary on stdout.

use std::io::{IsTerminal, Write};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::args::TokenizeArgs;
use crate::data::token_file::{TokenMeta, TRAIN_FILE, VAL_FILE};
use crate::data::tokenize::{tokenize, TokenizeRequest};
use crate::error::{Result, TrainError};

/// Run `mamba-train train-tokenizer`, writing its summary to `out`.
pub fn run_train_tokenizer(
    args: &super::args::TrainTokenizerArgs,
    out: &mut dyn Write,
) -> Result<()> {
    let files = crate::data::bpe::train_bpe_files(&args.inputs, args.vocab_size, &args.out)?;
    let codec = crate::data::Codec::from_file(&args.out)?;
    writeln!(
        out,
        "tokenizer: {} ({} ids, trained on {files} {})",
        args.out.display(),
        codec.vocab_size(),
        super::report::plural(files, "file")
    )
    .map_err(|e| TrainError::Io {
        path: "<stdout>".into(),
        source: e,
    })
}

/// Run `mamba-train tokenize`, writing its summary to `out`.
pub fn run_tokenize(args: &TokenizeArgs, out: &mut dyn Write) -> Result<TokenMeta> {
    let req = TokenizeRequest {
        tokenizer: &args.tokenizer,
        inputs: &args.inputs,
        out: &args.out,
        val_fraction: args.val_fraction,
        dtype: args.token_dtype,
        overwrite: args.overwrite,
    };
    let target = if std::io::stderr().is_terminal() {
        ProgressDrawTarget::stderr_with_hz(4)
    } else {
        ProgressDrawTarget::hidden()
    };
    let bar = ProgressBar::with_draw_target(None, target);
    let style = ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} ({bytes_per_sec}, eta {eta})",
    )
    .unwrap_or_else(|_| ProgressStyle::default_bar());
    bar.set_style(style);
    let meta = tokenize(&req, &mut |total| bar.set_length(total), &mut |done| {
        bar.set_position(done)
    });
    bar.finish_and_clear();
    let meta = meta?;
    let summary = format!(
        "tokenized {} documents ({} bytes) into {}: {TRAIN_FILE} {} tokens, {VAL_FILE} {} tokens \
         ({}, vocabulary {}, end-of-text {})",
        meta.documents,
        meta.input_bytes,
        args.out.display(),
        meta.train.tokens,
        meta.val.tokens,
        meta.dtype,
        meta.vocab_size,
        meta.eos.map_or("none".to_string(), |e| e.to_string())
    );
    writeln!(out, "{summary}").map_err(|e| TrainError::Io {
        path: "stdout".into(),
        source: e,
    })?;
    Ok(meta)
}
