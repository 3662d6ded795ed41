//! Induction heads (Mamba paper, section 4.1.2; Olsson et al. 2022).
//!
//! A row is random data tokens with one *trigger* token placed at a random
//! position `p`, followed by the answer token at `p + 1`. The row ends with
//! the trigger again; at that last position the model must recall the token
//! that followed the first trigger. Only the last position has a target.
//!
//! Token ids: data tokens `0..alphabet`, the trigger is `alphabet`.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};
use crate::model::IGNORE;
use crate::seed::Rng;

/// Shape of the induction-heads task.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InductionConfig {
    /// Tokens per row.
    pub seq_len: usize,
    /// Number of distinct data tokens.
    pub alphabet: usize,
}

impl InductionConfig {
    /// Refuse shapes that cannot hold the task, naming the field.
    pub fn validate(&self) -> Result<()> {
        if self.alphabet < 2 {
            return Err(TrainError::setting(
                "alphabet",
                format!(
                    "must be at least 2 data tokens for induction, got {}",
                    self.alphabet
                ),
            ));
        }
        if self.seq_len < 3 {
            return Err(TrainError::setting(
                "seq_len",
                format!(
                    "must be at least 3 for induction (trigger, answer, trigger), got {}",
                    self.seq_len
                ),
            ));
        }
        Ok(())
    }

    /// The trigger token id.
    pub fn trigger(&self) -> u32 {
        self.alphabet as u32
    }

    /// Model vocabulary: the alphabet plus the trigger.
    pub fn vocab_size(&self) -> usize {
        self.alphabet + 1
    }

    /// Fill one row from its own generator. `tokens.len() == targets.len() == seq_len`.
    pub fn fill_row(&self, rng: &mut Rng, tokens: &mut [u32], targets: &mut [i32]) {
        let t = self.seq_len;
        for x in tokens.iter_mut() {
            *x = rng.below(self.alphabet as u64) as u32;
        }
        targets.fill(IGNORE);
        // The first trigger sits in 0..=t-3 so its answer (p + 1) is never
        // the final position.
        let p = rng.below((t - 2) as u64) as usize;
        tokens[p] = self.trigger();
        let answer = tokens[p + 1];
        tokens[t - 1] = self.trigger();
        targets[t - 1] = answer as i32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn last_target_is_the_token_after_the_first_trigger() {
        let c = InductionConfig {
            seq_len: 12,
            alphabet: 5,
        };
        let mut seen_early = false;
        for seed in 0..200 {
            let mut t = vec![0u32; c.seq_len];
            let mut y = vec![0i32; c.seq_len];
            c.fill_row(&mut Rng::new(seed), &mut t, &mut y);
            let triggers: Vec<usize> = (0..c.seq_len).filter(|&i| t[i] == c.trigger()).collect();
            assert_eq!(triggers.len(), 2, "{t:?}");
            assert_eq!(triggers[1], c.seq_len - 1);
            assert_eq!(y[c.seq_len - 1], t[triggers[0] + 1] as i32);
            assert!((t[triggers[0] + 1] as usize) < c.alphabet);
            assert_eq!(y.iter().filter(|&&v| v != IGNORE).count(), 1);
            seen_early |= triggers[0] == 0;
        }
        assert!(seen_early, "position 0 must be a possible trigger position");
    }

    #[test]
    fn rejects_too_short_rows() {
        let c = InductionConfig {
            seq_len: 2,
            alphabet: 5,
        };
        assert!(c.validate().unwrap_err().to_string().contains("seq_len"));
        let c = InductionConfig {
            seq_len: 8,
            alphabet: 1,
        };
        assert!(c.validate().unwrap_err().to_string().contains("alphabet"));
    }
}
