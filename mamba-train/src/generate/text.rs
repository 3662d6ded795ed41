//! Text to tokens and back for `generate`: the one place the text codec is
//! chosen. Byte-level for now (a token is one byte of the UTF-8 text, the
//! vocabulary of `--task text`); the tokenizer codec of `crate::data`
//! replaces these two functions when it lands.

use crate::error::{Result, TrainError};

/// The tokens of `prompt` for a model of `vocab` tokens; refuses an empty
/// prompt (there is no token to start from) and a token outside the
/// vocabulary, naming `--prompt`.
pub fn prompt_tokens(prompt: &str, vocab: usize) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        return Err(TrainError::Config(
            "--prompt is empty; give at least one character to continue".into(),
        ));
    }
    let tokens: Vec<u32> = prompt.bytes().map(u32::from).collect();
    if let Some((i, &t)) = tokens
        .iter()
        .enumerate()
        .find(|(_, &t)| t as usize >= vocab)
    {
        return Err(TrainError::Config(format!(
            "--prompt: byte {i} of the prompt is token {t}, outside this model's vocabulary of \
             {vocab} tokens (text is byte-level: every byte must be below {vocab})"
        )));
    }
    Ok(tokens)
}

/// The text of generated `tokens`: their bytes as UTF-8, with invalid
/// sequences and tokens that are no byte (`>= 256`, from a model with a
/// larger vocabulary) shown as U+FFFD.
pub fn tokens_text(tokens: &[u32]) -> String {
    let mut out = String::new();
    let mut bytes = Vec::new();
    for &t in tokens {
        match u8::try_from(t) {
            Ok(b) => bytes.push(b),
            Err(_) => {
                out.push_str(&String::from_utf8_lossy(&bytes));
                bytes.clear();
                out.push(char::REPLACEMENT_CHARACTER);
            }
        }
    }
    out.push_str(&String::from_utf8_lossy(&bytes));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_and_bad_prompts_name_the_flag() {
        let t = prompt_tokens("héllo", 256).unwrap();
        assert_eq!(t.len(), 6, "é is two bytes");
        assert_eq!(tokens_text(&t), "héllo");
        assert_eq!(tokens_text(&[104, 300, 105]), "h\u{FFFD}i");
        let e = prompt_tokens("", 256).unwrap_err().to_string();
        assert!(e.contains("--prompt is empty"), "{e}");
        let e = prompt_tokens("abz", 100).unwrap_err().to_string();
        assert!(
            e.contains("--prompt") && e.contains("token 122") && e.contains("byte 2"),
            "{e}"
        );
    }
}
