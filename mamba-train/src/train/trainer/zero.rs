//! The engine's side of ZeRO-1: narrowing the optimizer state to one
//! shard, applying a step over it, and reading or writing the shard's
//! moments. The collectives around them (the norm's chunk sums, the weight
//! all-gather, the moments gathered for a checkpoint) are the
//! data-parallel loop's ([`crate::dp::zero`]); the engine stays one state
//! machine for the sharded and the unsharded run.

use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{StepStats, Trainer};
use crate::checkpoint::{self, CheckpointMeta, CheckpointRef};
use crate::error::{Result, TrainError};
use crate::model::Backend;
use crate::optim::{AdamW, Optimizer};

impl<B: Backend> Trainer<B> {
    /// Keep only the moments of the arena elements `shard` (which must lie
    /// within the shard held now, e.g. the whole arena after a fresh start
    /// or a resume): the optimizer memory of one ZeRO-1 owner. The weights
    /// stay whole. Changes no bits: the kept moments are the same values.
    pub fn shard_optimizer(&mut self, shard: Range<usize>) -> Result<()> {
        let held = self.opt.adamw().shard();
        if shard == held {
            return Ok(());
        }
        if shard.start < held.start || shard.end > held.end || shard.start > shard.end {
            return Err(TrainError::Config(format!(
                "cannot narrow the optimizer state from elements {held:?} to {shard:?}: a shard \
                 can only keep part of what it holds"
            )));
        }
        let local = shard.start - held.start..shard.end - held.start;
        let (m, v) = self.shard_moments_host()?;
        let (m, v) = (
            self.backend.upload_shard(&m[local.clone()])?,
            self.backend.upload_shard(&v[local])?,
        );
        let old = self.opt.adamw();
        let adamw = AdamW::from_shard(
            *old.config(),
            self.backend.layout(),
            shard,
            m,
            v,
            old.updates(),
        )?;
        self.opt = Optimizer::from_parts(adamw, *self.opt.schedule())?;
        Ok(())
    }

    /// Whether the optimizer holds fewer than all the arena's moments.
    pub fn optimizer_is_sharded(&self) -> bool {
        self.opt.adamw().shard() != (0..self.arena_len())
    }

    /// The moments of the optimizer's shard on the host (first, second).
    pub fn shard_moments_host(&mut self) -> Result<(Vec<f32>, Vec<f32>)> {
        let len = self.opt.adamw().shard().len();
        let adamw = self.opt.adamw();
        let m = self
            .backend
            .shard_to_host(adamw.exp_avg(), len)?
            .into_owned();
        let v = self
            .backend
            .shard_to_host(adamw.exp_avg_sq(), len)?
            .into_owned();
        Ok((m, v))
    }

    /// [`Trainer::apply`] over the optimizer's shard: `gather` turns this
    /// shard's norm chunk sums into the whole arena's (every rank's, in
    /// chunk order), so the clipping norm is the unsharded one; only the
    /// shard of the weights is updated (the caller all-gathers the rest).
    /// With the whole arena as the shard and the identity as `gather` this
    /// is `apply`.
    pub fn apply_gathered(
        &mut self,
        mean: &B::Arena,
        loss: f32,
        proceed: bool,
        gather: &mut dyn FnMut(Vec<f64>) -> Result<Vec<f64>>,
    ) -> Result<StepStats> {
        let out = self.opt.step_gathered(
            &mut self.backend,
            self.step,
            &mut self.params,
            mean,
            proceed,
            gather,
        )?;
        self.step += 1;
        if out.skipped {
            self.skipped += 1;
        }
        Ok(StepStats {
            step: self.step,
            loss,
            lr: out.lr,
            grad_norm: out.grad_norm,
            skipped: out.skipped,
            skipped_total: self.skipped,
            tokens: self.cfg.tokens_per_step(),
        })
    }

    /// The weight arena, mutable: the data-parallel loop all-gathers the
    /// owners' updated shards into it.
    pub(crate) fn params_mut(&mut self) -> &mut B::Arena {
        &mut self.params
    }

    /// Save a checkpoint of the current step with the whole moments given
    /// on the host (`exp_avg`, `exp_avg_sq`: gathered from every shard),
    /// the same files an unsharded run writes.
    pub fn save_checkpoint_with_moments(
        &mut self,
        run_dir: &Path,
        keep: usize,
        meta: &CheckpointMeta,
        exp_avg: &[f32],
        exp_avg_sq: &[f32],
    ) -> Result<PathBuf> {
        let n = self.arena_len();
        if exp_avg.len() != n || exp_avg_sq.len() != n {
            return Err(TrainError::Config(format!(
                "a checkpoint needs whole moments of {n} elements, got {} and {}",
                exp_avg.len(),
                exp_avg_sq.len()
            )));
        }
        let state = self.run_state()?;
        let params = self.backend.to_host(&self.params)?;
        let ck = CheckpointRef {
            state: &state,
            params: &params,
            exp_avg,
            exp_avg_sq,
            tokenizer_json: self.data.tokenizer_json(),
        };
        checkpoint::save_with_meta(run_dir, &ck, meta, keep, &mut |_| Ok(()))
    }
}
