//! The optimizer step: global-norm clipping, the learning-rate schedule and
//! AdamW, applied to a finished gradient arena.
//!
//! The step is deliberately separate from the backward pass: the backward
//! fills a gradient arena, a reducer replaces it with the mean over all
//! logical micro-batches, and only then [`Optimizer::step`] runs.
//!
//! One state machine for every device: [`Optimizer`] is generic over the
//! arenas' memory and takes the arithmetic from an [`ArenaMath`]
//! ([`HostMath`] on the CPU, the CUDA model's kernels on a GPU), which keep
//! the same bits.
//!
//! ZeRO-1 is the same state machine over one shard: the [`AdamW`] state
//! holds the moments of its [`AdamW::shard`] only, and
//! [`Optimizer::step_gathered`] takes the norm's chunk sums of every shard
//! from the caller (an all-gather), so the clipping norm, and with it every
//! bit, is the unsharded one ([`shard`] says why).

pub mod adamw;
pub mod clip;
pub mod math;
pub mod schedule;
pub mod shard;
#[cfg(test)]
mod sharded_tests;

pub use adamw::{decayed_ranges, AdamW, AdamWConfig};
pub use clip::{chunk_sums, clip_scale, global_norm};
pub use math::{ArenaMath, HostMath};
pub use schedule::Schedule;
pub use shard::OptimizerShards;

use crate::error::Result;
use crate::params::ParamLayout;

/// What one optimizer step did.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepOutcome {
    /// Learning rate of the step.
    pub lr: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Factor the gradients were scaled by (1 when not clipped).
    pub clip_scale: f32,
    /// True when the step was skipped (non-finite loss or gradient): the
    /// parameters and moments are untouched.
    pub skipped: bool,
}

/// AdamW plus its schedule and clipping, over arenas of type `A`.
#[derive(Clone, Debug, PartialEq)]
pub struct Optimizer<A = Vec<f32>> {
    adamw: AdamW<A>,
    schedule: Schedule,
}

impl Optimizer<Vec<f32>> {
    /// Fresh host state for `layout`.
    pub fn new(cfg: AdamWConfig, schedule: Schedule, layout: &ParamLayout) -> Result<Self> {
        Self::from_parts(AdamW::new(cfg, layout)?, schedule)
    }
}

impl<A> Optimizer<A> {
    /// Fresh state (step 0) over two zero-filled moment arenas of
    /// `layout`'s length, in any memory (e.g. `backend.zeros()`).
    pub fn fresh(
        cfg: AdamWConfig,
        schedule: Schedule,
        layout: &ParamLayout,
        zero_m: A,
        zero_v: A,
    ) -> Result<Self> {
        Self::from_parts(
            AdamW::from_arenas(cfg, layout, zero_m, zero_v, 0)?,
            schedule,
        )
    }

    /// Restored (or freshly allocated) state.
    pub fn from_parts(adamw: AdamW<A>, schedule: Schedule) -> Result<Self> {
        schedule.validate()?;
        Ok(Optimizer { adamw, schedule })
    }

    /// The AdamW state.
    pub fn adamw(&self) -> &AdamW<A> {
        &self.adamw
    }
    /// The schedule.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }
    /// The AdamW state and the schedule, taken apart.
    pub fn into_parts(self) -> (AdamW<A>, Schedule) {
        (self.adamw, self.schedule)
    }

    /// Step `step` (0-based, selects the learning rate): clip by the global
    /// norm, then AdamW, with `math`'s arithmetic. `loss_finite == false` or
    /// a non-finite gradient norm skips the step, leaving parameters and
    /// moments untouched. The unsharded step: [`Self::step_gathered`] with
    /// nothing to gather.
    pub fn step<M: ArenaMath<Arena = A> + ?Sized>(
        &mut self,
        math: &mut M,
        step: u64,
        params: &mut A,
        grads: &A,
        loss_finite: bool,
    ) -> Result<StepOutcome> {
        self.step_gathered(math, step, params, grads, loss_finite, &mut |own| Ok(own))
    }

    /// [`Self::step`] over this state's shard: the chunk sums of squares of
    /// `grads[shard]` go to `gather`, which returns the chunk sums of the
    /// whole arena in chunk order (every shard's, e.g. by an all-gather;
    /// the identity when the shard is the whole arena); their sum in chunk
    /// order is the global norm, bit for bit the unsharded one. Only
    /// `params[shard]` is updated. `gather` is called on every step (a
    /// skipped one too), so that every rank makes the same collective calls.
    pub fn step_gathered<M: ArenaMath<Arena = A> + ?Sized>(
        &mut self,
        math: &mut M,
        step: u64,
        params: &mut A,
        grads: &A,
        loss_finite: bool,
        gather: &mut dyn FnMut(Vec<f64>) -> Result<Vec<f64>>,
    ) -> Result<StepOutcome> {
        let lr = self.schedule.lr(step);
        let own = math.norm_partials(grads, self.adamw.shard())?;
        let grad_norm = shard::norm_from_chunk_sums(&gather(own)?);
        if !loss_finite || !grad_norm.is_finite() {
            return Ok(StepOutcome {
                lr,
                grad_norm,
                clip_scale: 1.0,
                skipped: true,
            });
        }
        let scale = clip_scale(grad_norm, self.adamw.config().clip_norm);
        self.adamw.update(math, params, grads, scale, lr)?;
        Ok(StepOutcome {
            lr,
            grad_norm,
            clip_scale: scale,
            skipped: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn non_finite_gradients_skip_without_touching_state() {
        let l = ParamLayout::new(&ModelConfig::new(7, 8, 1));
        let sched = Schedule {
            peak_lr: 1e-2,
            warmup_steps: 0,
            total_steps: 10,
            min_lr_frac: 0.1,
        };
        let mut opt = Optimizer::new(AdamWConfig::default(), sched, &l).unwrap();
        let mut p = vec![0.5f32; l.len()];
        let mut g = vec![0.1f32; l.len()];
        g[3] = f32::NAN;
        let before = opt.clone();
        let out = opt.step(&mut HostMath, 0, &mut p, &g, true).unwrap();
        assert!(out.skipped);
        assert_eq!(opt, before);
        assert!(p.iter().all(|&x| x == 0.5));
        g[3] = 0.1;
        let out = opt.step(&mut HostMath, 0, &mut p, &g, false).unwrap();
        assert!(out.skipped, "a non-finite loss skips too");
        // Negative control: a finite step does move.
        let out = opt.step(&mut HostMath, 0, &mut p, &g, true).unwrap();
        assert!(!out.skipped);
        assert!(p.iter().any(|&x| x != 0.5));
        assert_eq!(opt.adamw().updates(), 1);
    }

    #[test]
    fn large_gradients_are_clipped_to_the_threshold() {
        let l = ParamLayout::new(&ModelConfig::new(7, 8, 1));
        let sched = Schedule {
            peak_lr: 1e-2,
            warmup_steps: 0,
            total_steps: 10,
            min_lr_frac: 0.1,
        };
        let mut opt = Optimizer::new(AdamWConfig::default(), sched, &l).unwrap();
        let mut p = vec![0.0f32; l.len()];
        let g = vec![1.0f32; l.len()];
        let out = opt.step(&mut HostMath, 0, &mut p, &g, true).unwrap();
        let expect = (l.len() as f64).sqrt();
        assert!((out.grad_norm - expect).abs() < 1e-9);
        let clipped = (l.len() as f64).sqrt() * out.clip_scale as f64;
        assert!((clipped - 1.0).abs() < 1e-5, "clipped norm {clipped}");
        // The first moment holds (1 - beta1) * clipped gradient.
        let m0 = opt.adamw().exp_avg()[0];
        assert_eq!(m0, (1.0 - 0.9f32) * (1.0 * out.clip_scale));
    }
}
