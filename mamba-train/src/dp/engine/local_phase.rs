//! Step 1 of [`DataParallel::step`] on this rank (its micro-batches'
//! losses and gradients), and what a rank ends the step with when some
//! rank's step 1 failed: kept apart from the loop so the failure protocol
//! (the flag rides on the non-finite check, then one small all-gather on
//! the failure path only) reads in one place.

use super::{DataParallel, Gradients};
use crate::dp::reduce_err;
use crate::error::{Result, TrainError};
use crate::train::Backend;
use mamba_reduce::Reducer;

impl<B: Backend, R: Reducer<Buffer = B::Arena>> DataParallel<B, R> {
    /// Step 1 of a step on this rank: the loss and gradient of each of its
    /// logical micro-batches, in logical order, into `losses` and the
    /// gradient arenas (under the tree, folded into `block`). Whether every
    /// loss and gradient was finite.
    pub(super) fn local_phase(
        &mut self,
        losses: &mut Vec<[f32; 1]>,
        block: &mut Vec<B::Arena>,
    ) -> Result<bool> {
        #[cfg(feature = "fault-injection")]
        let hooks = self.opts.hooks;
        let rank = self.rank();
        let blocks = self.blocks();
        let first = rank * blocks;
        let mut finite = true;
        match &mut self.grads {
            Gradients::PerRank(locals) => {
                for (j, arena) in locals.iter_mut().enumerate() {
                    let loss = self.trainer.micro_gradient((first + j) as u64, arena)?;
                    #[cfg(feature = "fault-injection")]
                    if j == 0 {
                        hooks.after_gradient(rank, &mut self.trainer, arena)?;
                    }
                    finite &= loss.is_finite() && self.trainer.backend_mut().all_finite(arena)?;
                    losses.push([loss]);
                }
            }
            Gradients::Tree(acc) => {
                for j in 0..blocks {
                    let mut arena = match acc.take_spare() {
                        Some(a) => a,
                        None => {
                            self.arenas += 1;
                            self.trainer.backend_mut().zeros()?
                        }
                    };
                    let loss = self
                        .trainer
                        .micro_gradient((first + j) as u64, &mut arena)?;
                    #[cfg(feature = "fault-injection")]
                    if j == 0 {
                        hooks.after_gradient(rank, &mut self.trainer, &mut arena)?;
                    }
                    // Checked before it is folded, as each per-rank arena.
                    finite &= loss.is_finite() && self.trainer.backend_mut().all_finite(&arena)?;
                    losses.push([loss]);
                    let fold = self.reducer.local_fold().ok_or_else(|| {
                        TrainError::Config("the reducer stopped offering its fold".to_string())
                    })?;
                    acc.push(fold, arena).map_err(reduce_err)?;
                }
                block.push(acc.finish().map_err(reduce_err)?);
            }
        }
        Ok(finite)
    }

    /// Some rank's local phase failed (every rank knows it from the flags):
    /// find which (one small all-gather, on this path only) and return the
    /// error this rank ends the step with: its own if it is one of them,
    /// else the lowest failed rank's name. Collective.
    pub(super) fn local_failure(&mut self, own: Option<TrainError>) -> Result<TrainError> {
        let mine = [if own.is_some() { 1.0f32 } else { 0.0 }];
        let all = self.reducer.all_gather_host(&mine).map_err(reduce_err)?;
        let failed: Vec<usize> = (0..all.len()).filter(|&r| all[r] != 0.0).collect();
        if let Some(e) = own {
            return Ok(e);
        }
        let step = self.trainer.step() + 1;
        let rank = failed.first().copied().unwrap_or(0);
        let others = match failed.len() {
            0 | 1 => String::new(),
            n => format!(
                " (and {} more rank{})",
                n - 1,
                if n == 2 { "" } else { "s" }
            ),
        };
        Ok(TrainError::Comm(mamba_comm::CommError::PeerFailed {
            rank,
            detail: format!(
                "its local part of step {step} (forward/backward, data or device) failed{others}; \
                 its own error says why. This rank stops at the same step instead of waiting \
                 for it in the next collective"
            ),
        }))
    }
}
