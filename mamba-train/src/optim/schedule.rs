//! Learning-rate schedule: linear warmup, then cosine decay to a floor.

use serde::{Deserialize, Serialize};

use crate::error::{Result, TrainError};

/// Warmup + cosine. For step `s` (0-based):
/// - `s < warmup`: `peak * (s + 1) / warmup`;
/// - otherwise, with `p = (s - warmup) / max(1, total - warmup)` clamped to 1:
///   `min + (peak - min) * (1 + cos(pi * p)) / 2`, where `min = peak * min_lr_frac`.
///
/// Computed in f64 and rounded to f32 once, so the value is a pure function
/// of the step and the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Schedule {
    /// Peak learning rate (reached at the end of warmup).
    pub peak_lr: f32,
    /// Warmup steps (0 = start at the peak).
    pub warmup_steps: u64,
    /// Total steps of the run (the cosine ends here).
    pub total_steps: u64,
    /// Final learning rate as a fraction of the peak.
    pub min_lr_frac: f32,
}

impl Schedule {
    /// Refuse schedules that cannot work, naming the field.
    pub fn validate(&self) -> Result<()> {
        if !(self.peak_lr.is_finite() && self.peak_lr > 0.0) {
            return Err(TrainError::setting(
                "peak_lr",
                format!("must be a positive number, got {}", self.peak_lr),
            ));
        }
        if !(0.0..=1.0).contains(&self.min_lr_frac) {
            return Err(TrainError::setting(
                "min_lr_frac",
                format!("must be within [0, 1], got {}", self.min_lr_frac),
            ));
        }
        if self.total_steps == 0 {
            return Err(TrainError::setting(
                "total_steps",
                "must be at least 1, got 0",
            ));
        }
        Ok(())
    }

    /// Learning rate of step `step` (0-based).
    pub fn lr(&self, step: u64) -> f32 {
        let peak = self.peak_lr as f64;
        if step < self.warmup_steps {
            return (peak * (step + 1) as f64 / self.warmup_steps as f64) as f32;
        }
        let span = self.total_steps.saturating_sub(self.warmup_steps).max(1);
        let p = ((step - self.warmup_steps) as f64 / span as f64).min(1.0);
        let min = peak * self.min_lr_frac as f64;
        (min + (peak - min) * 0.5 * (1.0 + (std::f64::consts::PI * p).cos())) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let s = Schedule {
            peak_lr: 1e-2,
            warmup_steps: 10,
            total_steps: 110,
            min_lr_frac: 0.1,
        };
        assert!((s.lr(0) - 1e-3).abs() < 1e-9);
        assert_eq!(s.lr(9), 1e-2);
        assert_eq!(s.lr(10), 1e-2, "cosine starts at the peak");
        assert!((s.lr(60) - 5.5e-3).abs() < 1e-7, "halfway: {}", s.lr(60));
        assert!((s.lr(110) - 1e-3).abs() < 1e-9);
        assert_eq!(s.lr(500), s.lr(110), "clamped after the end");
        for k in 10..110 {
            assert!(s.lr(k + 1) <= s.lr(k), "not decreasing at {k}");
        }
        for k in 0..9 {
            assert!(s.lr(k + 1) > s.lr(k), "not increasing in warmup at {k}");
        }
    }

    #[test]
    fn validation_names_the_field() {
        let ok = Schedule {
            peak_lr: 1e-3,
            warmup_steps: 0,
            total_steps: 5,
            min_lr_frac: 0.0,
        };
        assert!(ok.validate().is_ok());
        assert_eq!(ok.lr(0), 1e-3);
        let e = Schedule { peak_lr: 0.0, ..ok }
            .validate()
            .unwrap_err()
            .to_string();
        assert!(e.contains("lr"), "{e}");
        let e = Schedule {
            total_steps: 0,
            ..ok
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("steps"), "{e}");
        let e = Schedule {
            min_lr_frac: 2.0,
            ..ok
        }
        .validate()
        .unwrap_err()
        .to_string();
        assert!(e.contains("min_lr_frac"), "{e}");
    }
}
