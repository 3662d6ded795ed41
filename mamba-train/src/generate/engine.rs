//! The decoding state machine, once for every device: prefill the prompt,
//! then choose a token, feed it, repeat until a stop. The device supplies
//! only "feed one token, get the next logits" ([`Decoder`]).
//!
//! Prefill is token by token through the same [`Decoder::step`] as the
//! generated tokens (one path; the prompt's logits are those of the full
//! forward pass, see `model::decode`). The token after the prompt is draw 0
//! of the [`Sampling`], the next draw 1, and so on.

use std::time::Instant;

use super::sample::Sampling;
use crate::error::{Result, TrainError};
use crate::model::{DecodeState, Decoder};

/// What to generate.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// How each token is chosen.
    pub sampling: Sampling,
    /// Stop after generating this token (it is kept in the output).
    pub stop_token: Option<u32>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// `max_new_tokens` were generated.
    MaxTokens,
    /// The stop token was generated.
    StopToken,
}

/// Tokens processed in one phase and the wall time it took.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Phase {
    /// Tokens fed (prefill) or generated (decode).
    pub tokens: usize,
    /// Seconds.
    pub secs: f64,
}

impl Phase {
    /// Tokens per second (0 for an empty phase).
    pub fn tokens_per_s(&self) -> f64 {
        if self.tokens == 0 {
            0.0
        } else {
            self.tokens as f64 / self.secs.max(1e-9)
        }
    }
}

/// A finished generation.
#[derive(Clone, Debug, PartialEq)]
pub struct Generation {
    /// The generated tokens (without the prompt).
    pub tokens: Vec<u32>,
    /// The prompt's prefill.
    pub prefill: Phase,
    /// Choosing and feeding the generated tokens.
    pub decode: Phase,
    /// Why it ended.
    pub stop: Stop,
    /// Floats of recurrent state the decoder carried: the same at every
    /// position ([`DecodeState::len_for`]).
    pub state_floats: usize,
}

/// Continue `prompt` on `dec` (reset first) as `opts` says.
pub fn generate<D: Decoder + ?Sized>(
    dec: &mut D,
    prompt: &[u32],
    opts: &GenerateOptions,
) -> Result<Generation> {
    opts.sampling.validate()?;
    let Some((&last, head)) = prompt.split_last() else {
        return Err(TrainError::Config(
            "the prompt has no tokens; generation continues at least one".into(),
        ));
    };
    let state_floats = DecodeState::len_for(dec.config());
    dec.reset()?;
    let started = Instant::now();
    for &t in head {
        dec.step(t)?;
    }
    let logits = dec.step(last)?;
    let first = if opts.max_new_tokens > 0 {
        Some(opts.sampling.choose(logits, 0)?)
    } else {
        None
    };
    let prefill = Phase {
        tokens: prompt.len(),
        secs: started.elapsed().as_secs_f64(),
    };
    let decoding = Instant::now();
    let mut tokens = Vec::with_capacity(opts.max_new_tokens);
    let mut stop = Stop::MaxTokens;
    let mut next = first;
    while let Some(tok) = next {
        tokens.push(tok);
        if opts.stop_token == Some(tok) {
            stop = Stop::StopToken;
            break;
        }
        if tokens.len() == opts.max_new_tokens {
            break;
        }
        let logits = dec.step(tok)?;
        next = Some(opts.sampling.choose(logits, tokens.len() as u64)?);
    }
    Ok(Generation {
        decode: Phase {
            tokens: tokens.len(),
            secs: decoding.elapsed().as_secs_f64(),
        },
        tokens,
        prefill,
        stop,
        state_floats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    /// A decoder whose logits put the most weight on `(last token + 1) mod
    /// vocab`, and which records what it was fed.
    struct Counting {
        cfg: ModelConfig,
        fed: Vec<u32>,
        logits: Vec<f32>,
        resets: usize,
    }

    impl Decoder for Counting {
        fn config(&self) -> &ModelConfig {
            &self.cfg
        }
        fn device_name(&self) -> &'static str {
            "test"
        }
        fn reset(&mut self) -> Result<()> {
            self.fed.clear();
            self.resets += 1;
            Ok(())
        }
        fn step(&mut self, token: u32) -> Result<&[f32]> {
            self.fed.push(token);
            let v = self.cfg.vocab_size as u32;
            self.logits.iter_mut().for_each(|x| *x = 0.0);
            self.logits[((token + 1) % v) as usize] = 5.0;
            Ok(&self.logits)
        }
        fn position(&self) -> u64 {
            self.fed.len() as u64
        }
        fn snapshot(&mut self) -> Result<DecodeState> {
            Ok(DecodeState::zeros(&self.cfg))
        }
        fn restore(&mut self, _: &DecodeState, _: u64) -> Result<()> {
            Ok(())
        }
    }

    fn counting() -> Counting {
        let cfg = ModelConfig::new(7, 8, 1);
        Counting {
            logits: vec![0.0; 7],
            cfg,
            fed: vec![9],
            resets: 0,
        }
    }

    fn greedy(n: usize, stop: Option<u32>) -> GenerateOptions {
        GenerateOptions {
            max_new_tokens: n,
            sampling: Sampling::default(),
            stop_token: stop,
        }
    }

    #[test]
    fn prefill_then_each_chosen_token_is_fed_back() {
        let mut d = counting();
        let g = generate(&mut d, &[2, 3], &greedy(5, None)).unwrap();
        assert_eq!(g.tokens, [4, 5, 6, 0, 1]);
        assert_eq!(d.resets, 1);
        // The prompt, then every generated token but the last (whose
        // logits nobody needs).
        assert_eq!(d.fed, [2, 3, 4, 5, 6, 0]);
        assert_eq!((g.prefill.tokens, g.decode.tokens), (2, 5));
        assert_eq!(g.stop, Stop::MaxTokens);
        assert_eq!(g.state_floats, DecodeState::len_for(&d.cfg));
    }

    #[test]
    fn a_stop_token_ends_it_and_zero_tokens_generate_nothing() {
        let mut d = counting();
        let g = generate(&mut d, &[2], &greedy(10, Some(5))).unwrap();
        assert_eq!(
            (g.tokens.as_slice(), g.stop),
            (&[3, 4, 5][..], Stop::StopToken)
        );
        let g = generate(&mut d, &[2], &greedy(0, None)).unwrap();
        assert!(g.tokens.is_empty());
        assert_eq!(d.fed, [2]);
        let e = generate(&mut d, &[], &greedy(3, None)).unwrap_err();
        assert!(e.to_string().contains("no tokens"), "{e}");
        let bad = GenerateOptions {
            sampling: Sampling {
                top_p: 0.0,
                ..Sampling::default()
            },
            ..greedy(3, None)
        };
        let e = generate(&mut d, &[1], &bad).unwrap_err();
        assert!(e.to_string().contains("--top-p"), "{e}");
    }
}
