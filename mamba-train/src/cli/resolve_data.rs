//! The data part of resolving a run ([`super::resolve`]): which data flags
//! a task takes, and the text and token-file tasks from `--data`,
//! `--tokenizer`, `--val-fraction`, `--token-dtype` and `--vocab-size` (or,
//! on resume, the recorded task). Same precedence: flag, else the
//! checkpoint's, else the default.

use std::sync::Arc;

use super::args::TrainArgs;
use super::defaults as d;
use crate::data::token_file::TokenRequest;
use crate::data::{Corpus, TaskKind, TaskSpec, TextConfig, TokenFilesConfig};
use crate::error::{Result, TrainError};

fn pick<T>(flag: Option<T>, recorded: Option<T>, default: T) -> T {
    flag.or(recorded).unwrap_or(default)
}

/// Refuse data flags the task does not use, naming them.
pub(super) fn check_data_flags(args: &TrainArgs, kind: TaskKind) -> Result<()> {
    let lm = matches!(kind, TaskKind::Text | TaskKind::Tokens);
    let given = |set: bool, flag: &'static str| set.then_some(flag);
    let lm_flags: Vec<&str> = [
        given(args.data.is_some(), "--data"),
        given(args.tokenizer.is_some(), "--tokenizer"),
        given(args.val_fraction.is_some(), "--val-fraction"),
        given(args.token_dtype.is_some(), "--token-dtype"),
    ]
    .into_iter()
    .flatten()
    .collect();
    if !lm && !lm_flags.is_empty() {
        return Err(TrainError::Config(format!(
            "{} only used by --task text and --task tokens (the {kind} task generates its own data)",
            if lm_flags.len() == 1 {
                format!("{} is", lm_flags[0])
            } else {
                format!("{} are", lm_flags.join(", "))
            }
        )));
    }
    if lm && (args.memorize.is_some() || args.alphabet.is_some()) {
        return Err(TrainError::Config(
            "--memorize and --alphabet are for the synthetic tasks; text and tokens take their \
             vocabulary from the data"
                .into(),
        ));
    }
    if kind == TaskKind::Text && args.token_dtype.is_some() {
        return Err(TrainError::Config(
            "--token-dtype is for --task tokens (the width of its token files)".into(),
        ));
    }
    if kind == TaskKind::Tokens && args.val_fraction.is_some() {
        return Err(TrainError::Config(
            "--val-fraction is for --task text; the held-out split of --task tokens is its \
             val.bin (set its size with `mamba-train tokenize --val-fraction`)"
                .into(),
        ));
    }
    Ok(())
}

/// The text task: `--data` read (and tokenized) here, or on resume the
/// recorded corpus (read again when the run starts).
pub(super) fn resolve_text(
    args: &TrainArgs,
    rec: Option<&TextConfig>,
) -> Result<(TaskSpec, Option<Arc<Corpus>>)> {
    let seq_len = pick(args.seq_len, rec.map(|c| c.seq_len), d::TEXT_SEQ_LEN);
    let val_fraction = pick(
        args.val_fraction,
        rec.map(|c| c.val_fraction),
        d::VAL_FRACTION,
    );
    let recorded_tokenizer = rec
        .and_then(|c| c.tokenizer.as_ref())
        .map(|t| t.path.clone());
    let tokenizer = args.tokenizer.clone().or(recorded_tokenizer);
    let path = match (&args.data, rec) {
        (Some(path), _) => path.clone(),
        (None, Some(c)) if args.tokenizer.is_none() => {
            let task = TextConfig {
                seq_len,
                val_fraction,
                ..c.clone()
            };
            return Ok((TaskSpec::Text(task), None));
        }
        (None, Some(c)) => c.path.clone(),
        (None, None) => {
            return Err(TrainError::Config(
                "--task text needs --data PATH (the text file or directory to train on)".into(),
            ))
        }
    };
    let (cfg, corpus) = TextConfig::from_data(&path, tokenizer.as_deref(), seq_len, val_fraction)?;
    Ok((TaskSpec::Text(cfg), Some(Arc::new(corpus))))
}

/// The token-file task: `--data` opened here, or on resume the recorded
/// files (opened again when the run starts).
pub(super) fn resolve_tokens(
    args: &TrainArgs,
    rec: Option<&TokenFilesConfig>,
) -> Result<(TaskSpec, Option<Arc<Corpus>>)> {
    let seq_len = pick(args.seq_len, rec.map(|c| c.seq_len), d::TEXT_SEQ_LEN);
    let dir =
        match (&args.data, rec) {
            (Some(path), _) => path.clone(),
            (None, Some(c)) if args.tokenizer.is_none() && args.token_dtype.is_none() => {
                let task = TokenFilesConfig {
                    seq_len,
                    ..c.clone()
                };
                return Ok((TaskSpec::Tokens(task), None));
            }
            (None, Some(c)) => c.dir.clone(),
            (None, None) => return Err(TrainError::Config(
                "--task tokens needs --data DIR (a directory holding train.bin and val.bin, as \
                 `mamba-train tokenize` writes them)"
                    .into(),
            )),
        };
    let recorded_tokenizer = rec
        .and_then(|c| c.tokenizer.as_ref())
        .map(|t| t.path.clone());
    let tokenizer = args.tokenizer.clone().or(recorded_tokenizer);
    let (cfg, corpus) = TokenFilesConfig::open(TokenRequest {
        data: &dir,
        seq_len,
        dtype: args.token_dtype.or(rec.map(|c| c.dtype)),
        tokenizer: tokenizer.as_deref(),
        vocab_size: args.vocab_size.or(rec.map(|c| c.vocab_size)),
    })?;
    Ok((TaskSpec::Tokens(cfg), Some(Arc::new(corpus))))
}
