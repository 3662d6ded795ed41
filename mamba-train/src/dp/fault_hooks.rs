//! Fault-injection hooks for tests, read from the environment.
//!
//! They exist so the world's fault handling can be tested with real
//! processes; they are not for training, and they are compiled only with
//! the `fault-injection` feature, which this crate's own tests turn on (a
//! dev-dependency on itself) and a release build never has. Each is off
//! unless its variable is set, and a malformed value is an error (a typo
//! must not silently test nothing).
//!
//! | variable | value | effect |
//! |---|---|---|
//! | `MAMBA_TEST_INJECT_NAN` | `RANK:STEP` | during step `STEP` (1-based, as in the metrics), rank `RANK` makes element 0 of its first local gradient a NaN |
//! | `MAMBA_TEST_PERTURB_WEIGHTS` | `RANK:STEP` | after step `STEP`, rank `RANK` adds 1 to weight 0 (its replica then differs) |
//! | `MAMBA_TEST_STEP_DELAY_MS` | `MS` | every rank sleeps `MS` milliseconds per step (so a test can kill a rank mid-run) |
//! | `MAMBA_TEST_FAIL_LOCAL` | `RANK:STEP` | during step `STEP`, rank `RANK`'s local phase fails (after its first micro-batch gradient) with an error of its own |
//! | `MAMBA_TEST_FAIL_AFTER_STEP` | `RANK:STEP` | after step `STEP` was applied, rank `RANK` fails with an error of its own, outside any collective (as a failed checkpoint write or optimizer step would): its peers are then already on their way into the next collective |

use std::time::Duration;

use mamba_comm::bootstrap::EnvSource;

use crate::error::{Result, TrainError};
use crate::train::{Backend, Trainer};

/// Poison one gradient: `RANK:STEP`.
pub const INJECT_NAN: &str = "MAMBA_TEST_INJECT_NAN";
/// Corrupt one replica: `RANK:STEP`.
pub const PERTURB_WEIGHTS: &str = "MAMBA_TEST_PERTURB_WEIGHTS";
/// Slow every step down: `MS`.
pub const STEP_DELAY_MS: &str = "MAMBA_TEST_STEP_DELAY_MS";
/// Fail one rank's local phase: `RANK:STEP`.
pub const FAIL_LOCAL: &str = "MAMBA_TEST_FAIL_LOCAL";
/// Fail one rank between collectives, after a step: `RANK:STEP`.
pub const FAIL_AFTER_STEP: &str = "MAMBA_TEST_FAIL_AFTER_STEP";

/// `RANK:STEP`: one rank at one (1-based) step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RankStep {
    /// The rank the hook fires on.
    pub rank: usize,
    /// The step (1-based: the step number the metrics log).
    pub step: u64,
}

impl RankStep {
    /// Whether the hook fires on `rank` at (1-based) `step`.
    pub fn fires(self, rank: usize, step: u64) -> bool {
        self.rank == rank && self.step == step
    }
}

/// The test hooks in force (all off by default).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FaultHooks {
    /// [`INJECT_NAN`].
    pub inject_nan: Option<RankStep>,
    /// [`PERTURB_WEIGHTS`].
    pub perturb_weights: Option<RankStep>,
    /// [`STEP_DELAY_MS`].
    pub step_delay: Option<Duration>,
    /// [`FAIL_LOCAL`].
    pub fail_local: Option<RankStep>,
    /// [`FAIL_AFTER_STEP`].
    pub fail_after_step: Option<RankStep>,
}

impl FaultHooks {
    /// Read the hooks from `env`; a malformed value names the variable and
    /// the expected form.
    pub fn from_env<E: EnvSource + ?Sized>(env: &E) -> Result<FaultHooks> {
        let rank_step = |var: &str| -> Result<Option<RankStep>> {
            let Some(v) = env.var(var) else {
                return Ok(None);
            };
            let parsed = v.split_once(':').and_then(|(r, s)| {
                Some(RankStep {
                    rank: r.trim().parse().ok()?,
                    step: s.trim().parse().ok()?,
                })
            });
            match parsed {
                Some(rs) if rs.step >= 1 => Ok(Some(rs)),
                _ => Err(TrainError::Config(format!(
                    "test hook {var}={v:?}: expected RANK:STEP with a rank and a 1-based step, e.g. 1:3"
                ))),
            }
        };
        let step_delay = match env.var(STEP_DELAY_MS) {
            None => None,
            Some(v) => Some(Duration::from_millis(v.trim().parse().map_err(|_| {
                TrainError::Config(format!(
                    "test hook {STEP_DELAY_MS}={v:?}: expected a whole number of milliseconds"
                ))
            })?)),
        };
        Ok(FaultHooks {
            inject_nan: rank_step(INJECT_NAN)?,
            perturb_weights: rank_step(PERTURB_WEIGHTS)?,
            step_delay,
            fail_local: rank_step(FAIL_LOCAL)?,
            fail_after_step: rank_step(FAIL_AFTER_STEP)?,
        })
    }

    /// True when any hook is set (the CLI says so on stderr).
    pub fn any(&self) -> bool {
        *self != FaultHooks::default()
    }

    /// At the start of every step: the step delay.
    pub(crate) fn before_step(&self) {
        if let Some(d) = self.step_delay {
            std::thread::sleep(d);
        }
    }

    /// After this rank's first micro-batch gradient of a step: the NaN
    /// injection (element 0 of `grads`, through the host, so it works on
    /// every backend), or the local failure.
    pub(crate) fn after_gradient<B: Backend>(
        &self,
        rank: usize,
        trainer: &mut Trainer<B>,
        grads: &mut B::Arena,
    ) -> Result<()> {
        let number = trainer.step() + 1;
        if self.fail_local.is_some_and(|h| h.fires(rank, number)) {
            return Err(TrainError::Data(format!(
                "injected local failure on rank {rank} in step {number} ({FAIL_LOCAL})"
            )));
        }
        if self.inject_nan.is_some_and(|h| h.fires(rank, number)) {
            let backend = trainer.backend_mut();
            let mut host = backend.to_host(grads)?.into_owned();
            if let Some(g) = host.first_mut() {
                *g = f32::NAN;
            }
            *grads = backend.upload(&host)?;
        }
        Ok(())
    }

    /// After step `number` (1-based) was applied: the failure between
    /// collectives, or the weight perturbation.
    pub(crate) fn after_step<B: Backend>(
        &self,
        rank: usize,
        number: u64,
        trainer: &mut Trainer<B>,
    ) -> Result<()> {
        if self.fail_after_step.is_some_and(|h| h.fires(rank, number)) {
            return Err(TrainError::Data(format!(
                "injected failure on rank {rank} after step {number}, outside any collective \
                 ({FAIL_AFTER_STEP})"
            )));
        }
        if self.perturb_weights.is_some_and(|h| h.fires(rank, number)) {
            let mut host = trainer.params_host()?;
            if let Some(w) = host.first_mut() {
                *w += 1.0;
            }
            trainer.set_params_host(&host)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hooks_parse_and_typos_are_errors() {
        let none: [(&str, &str); 0] = [];
        assert_eq!(FaultHooks::from_env(&none).unwrap(), FaultHooks::default());
        assert!(!FaultHooks::default().any());
        let h = FaultHooks::from_env(&[
            (INJECT_NAN, "1:3"),
            (PERTURB_WEIGHTS, " 2 : 5"),
            (STEP_DELAY_MS, "40"),
            (FAIL_AFTER_STEP, "0:2"),
        ])
        .unwrap();
        assert_eq!(h.fail_after_step, Some(RankStep { rank: 0, step: 2 }));
        assert!(h.any());
        assert!(h.inject_nan.unwrap().fires(1, 3));
        assert!(!h.inject_nan.unwrap().fires(0, 3));
        assert!(!h.inject_nan.unwrap().fires(1, 4));
        assert_eq!(h.perturb_weights, Some(RankStep { rank: 2, step: 5 }));
        assert_eq!(h.step_delay, Some(Duration::from_millis(40)));
        for bad in ["1", "a:3", "1:0", "1:-2", ":"] {
            let e = FaultHooks::from_env(&[(INJECT_NAN, bad)])
                .unwrap_err()
                .to_string();
            assert!(e.contains(INJECT_NAN) && e.contains("RANK:STEP"), "{e}");
        }
        let e = FaultHooks::from_env(&[(STEP_DELAY_MS, "soon")])
            .unwrap_err()
            .to_string();
        assert!(e.contains(STEP_DELAY_MS), "{e}");
    }
}
