//! Task accuracy from logits: the share of scored positions (targets other
//! than [`IGNORE`]) whose arg-max logit is the target.

use crate::error::{Result, TrainError};
use crate::model::{Batch, IGNORE};

/// Counts of correct predictions over scored positions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accuracy {
    /// Positions whose arg-max equals the target.
    pub correct: u64,
    /// Scored positions (targets other than [`IGNORE`]).
    pub total: u64,
}

impl Accuracy {
    /// `correct / total`, 0 when nothing was scored.
    pub fn fraction(&self) -> f64 {
        if self.total == 0 {
            0.0
        } else {
            self.correct as f64 / self.total as f64
        }
    }

    /// Sum of two counts.
    pub fn merge(self, other: Accuracy) -> Accuracy {
        Accuracy {
            correct: self.correct + other.correct,
            total: self.total + other.total,
        }
    }
}

/// Arg-max of a logit row; ties go to the lowest index so the answer is
/// deterministic; a NaN never wins.
pub fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in row.iter().enumerate() {
        if v > best_v {
            best = i;
            best_v = v;
        }
    }
    best
}

/// Accuracy of `logits` (`[batch, seq_len, vocab]`, row-major) on the scored
/// positions of `batch`.
pub fn accuracy(logits: &[f32], batch: &Batch, vocab: usize) -> Result<Accuracy> {
    let positions = batch.batch * batch.seq_len;
    if logits.len() != positions * vocab || batch.targets.len() != positions {
        return Err(TrainError::Config(format!(
            "accuracy: expected {positions} positions x {vocab} logits and {positions} targets, got {} logits and {} targets",
            logits.len(),
            batch.targets.len()
        )));
    }
    let mut acc = Accuracy::default();
    for (pos, &target) in batch.targets.iter().enumerate() {
        if target == IGNORE {
            continue;
        }
        acc.total += 1;
        let row = &logits[pos * vocab..(pos + 1) * vocab];
        if target >= 0 && argmax(row) == target as usize {
            acc.correct += 1;
        }
    }
    Ok(acc)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_only_scored_positions() {
        let batch = Batch {
            tokens: vec![0; 3],
            targets: vec![IGNORE, 1, 2],
            batch: 1,
            seq_len: 3,
        };
        #[rustfmt::skip]
        let logits = vec![
            0.0, 9.0, 0.0, // ignored (would be "1")
            0.0, 5.0, 1.0, // predicts 1: correct
            3.0, 0.0, 1.0, // predicts 0: wrong
        ];
        let a = accuracy(&logits, &batch, 3).unwrap();
        assert_eq!(
            a,
            Accuracy {
                correct: 1,
                total: 2
            }
        );
        assert_eq!(a.fraction(), 0.5);
        assert!(accuracy(&logits[..6], &batch, 3).is_err());
    }

    #[test]
    fn argmax_breaks_ties_low_and_skips_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 0.5, 0.2]), 1);
    }
}
