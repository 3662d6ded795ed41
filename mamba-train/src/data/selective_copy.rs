//! Selective copying (Mamba paper, section 4.1.1).
//!
//! A row is a *content* region of `seq_len - n_memorize` positions holding
//! `n_memorize` data tokens at random (sorted) positions among noise tokens,
//! followed by `n_memorize` marker tokens. At the j-th marker the model must
//! emit the j-th data token of the content region, in order. Only those
//! marker positions carry a target; every other target is [`IGNORE`], so the
//! loss and the accuracy measure exactly the copying skill. The inputs at the
//! answer positions are markers, never the answers, so nothing leaks.
//!
//! Token ids: [`NOISE`] = 0, [`MARKER`] = 1, data tokens `2..2 + alphabet`.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::model::IGNORE;
use crate::seed::Rng;

/// The filler token of the content region.
pub const NOISE: u32 = 0;
/// The token that asks for the next remembered data token.
pub const MARKER: u32 = 1;
/// Number of special (non-data) tokens.
pub const SPECIAL: usize = 2;

/// Shape of the selective-copying task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SelectiveCopyConfig {
    /// Tokens per row (content region plus answer region).
    pub seq_len: usize,
    /// Data tokens to remember (and answer positions) per row.
    pub n_memorize: usize,
    /// Number of distinct data tokens.
    pub alphabet: usize,
}

impl SelectiveCopyConfig {
    /// Refuse shapes that cannot hold the task, naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.alphabet < 2 {
            return Err(TrainError::setting(
                "alphabet",
                format!(
                    "must be at least 2 data tokens for selective-copy, got {}",
                    self.alphabet
                ),
            ));
        }
        if self.n_memorize == 0 {
            return Err(TrainError::setting(
                "n_memorize",
                "must be at least 1 token for selective-copy, got 0",
            ));
        }
        if self.seq_len < 2 * self.n_memorize {
            return Err(TrainError::setting(
                "seq_len",
                format!(
                    "must be at least twice the tokens to memorize (2 x {} = {}: content \
                     region plus answers) for selective-copy, got {}",
                    self.n_memorize,
                    2 * self.n_memorize,
                    self.seq_len
                ),
            ));
        }
        Ok(())
    }

    /// Model vocabulary: the two special tokens plus the alphabet.
    pub fn vocab_size(&self) -> usize {
        SPECIAL + self.alphabet
    }

    /// Fill one row from its own generator. `tokens.len() == targets.len() == seq_len`.
    pub fn fill_row(&self, rng: &mut Rng, tokens: &mut [u32], targets: &mut [i32]) {
        let content = self.seq_len - self.n_memorize;
        tokens.fill(NOISE);
        targets.fill(IGNORE);
        // Choose n_memorize distinct content positions by a partial
        // Fisher-Yates shuffle, then keep them in sequence order.
        let mut positions: Vec<usize> = (0..content).collect();
        for i in 0..self.n_memorize {
            let j = i + rng.below((content - i) as u64) as usize;
            positions.swap(i, j);
        }
        let chosen = &mut positions[..self.n_memorize];
        chosen.sort_unstable();
        for (j, &p) in chosen.iter().enumerate() {
            let tok = (SPECIAL as u64 + rng.below(self.alphabet as u64)) as u32;
            tokens[p] = tok;
            tokens[content + j] = MARKER;
            targets[content + j] = tok as i32;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SelectiveCopyConfig {
        SelectiveCopyConfig {
            seq_len: 24,
            n_memorize: 5,
            alphabet: 6,
        }
    }

    #[test]
    fn answers_are_the_data_tokens_in_order() {
        let c = cfg();
        for seed in 0..50 {
            let mut t = vec![0u32; c.seq_len];
            let mut y = vec![0i32; c.seq_len];
            c.fill_row(&mut Rng::new(seed), &mut t, &mut y);
            let content = c.seq_len - c.n_memorize;
            let data: Vec<i32> = t[..content]
                .iter()
                .filter(|&&x| x != NOISE)
                .map(|&x| x as i32)
                .collect();
            assert_eq!(data.len(), c.n_memorize, "row {seed}: {t:?}");
            assert_eq!(&y[content..], &data[..]);
            assert!(y[..content].iter().all(|&v| v == IGNORE));
            assert!(t[content..].iter().all(|&v| v == MARKER));
            assert!(t.iter().all(|&v| (v as usize) < c.vocab_size()));
        }
    }

    #[test]
    fn rejects_shapes_that_cannot_hold_the_task() {
        let mut c = cfg();
        c.seq_len = 9;
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("seq_len"), "{e}");
        c = cfg();
        c.alphabet = 1;
        assert!(c.validate().unwrap_err().to_string().contains("alphabet"));
        c = cfg();
        c.n_memorize = 0;
        assert!(c.validate().is_err());
        assert!(cfg().validate().is_ok());
    }
}
