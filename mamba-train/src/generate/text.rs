//! Text to tokens and back for `generate`, through the run's codec
//! ([`Codec`]: byte-level, or the Hugging Face tokenizer the model was
//! trained with).

use crate::data::Codec;
use crate::error::{Result, TrainError};

/// The tokens of `prompt` under `codec` for a model of `vocab` tokens;
/// refuses an empty prompt (there is no token to start from) and a token
/// outside the model's vocabulary, naming `--prompt`.
pub fn prompt_tokens(prompt: &str, codec: &Codec, vocab: usize) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(TrainError::Config(
            "--prompt is empty; give at least one character to continue".into(),
        ));
    }
    let tokens = codec.encode(prompt)?;
    if tokens.is_empty() {
        return Err(TrainError::Config(
            "--prompt encodes to no token under the model's tokenizer".into(),
        ));
    }
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        let unit = match codec {
            Codec::Bytes => "byte",
            Codec::Hf(_) => "token",
        };
        return Err(TrainError::Config(format!(
            "--prompt: {unit} {i} of the prompt is token {t}, outside this model's vocabulary of \
             {vocab} tokens"
        )));
    }
    Ok(tokens)
}

/// The text of generated `tokens` under `codec`. Ids the codec does not
/// have (the padding rows of a model vocabulary larger than the
/// tokenizer's) are shown as U+FFFD, as are bytes that are not UTF-8.
pub fn tokens_text(tokens: &[u32], codec: &Codec) -> Result<String> {
    let vocab = codec.vocab_size();
    let mut out = String::new();
    for run in tokens.split(|&t| t as usize >= vocab) {
        out.push_str(&codec.decode(run)?);
        out.push(char::REPLACEMENT_CHARACTER);
    }
    out.pop();
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_bad_prompts_name_the_flag() {
        let c = Codec::bytes();
        let t = prompt_tokens("héllo", &c, 256).unwrap();
        assert_eq!(t.len(), 6, "é is two bytes");
        assert_eq!(tokens_text(&t, &c).unwrap(), "héllo");
        assert_eq!(tokens_text(&[104, 300, 105], &c).unwrap(), "h\u{FFFD}i");
        assert_eq!(tokens_text(&[], &c).unwrap(), "");
        let e = prompt_tokens("", &c, 256).unwrap_err().to_string();
        assert!(e.contains("--prompt is empty"), "{e}");
        let e = prompt_tokens("abz", &c, 100).unwrap_err().to_string();
        assert!(
            e.contains("--prompt") && e.contains("token 122") && e.contains("byte 2"),
            "{e}"
        );
    }
}
