//! ZeRO-1 in the data-parallel loop (`--shard-optimizer`): which shard of
//! the optimizer each rank owns, and the collectives around the engine's
//! sharded step.
//!
//! A sharded step, every call collective:
//! 1. [`Reducer::reduce_mean_shard`]: the mean over all `L` needs to reach
//!    only the owners (under any contract; the contract decides how each
//!    element is computed, not who gets it; `TransportReducer` runs its
//!    plan cut to end at the owners, so the rest of the arena is not the
//!    mean afterwards, and nothing below reads it);
//! 2. each owner's norm chunk sums are all-gathered as host values (four
//!    exact 16-bit pieces per f64) and added in chunk order: the unsharded
//!    norm, bit for bit ([`crate::optim::shard`]);
//! 3. each owner updates its shard of the weights with its shard of the
//!    moments ([`Trainer::apply_gathered`]);
//! 4. [`Reducer::all_gather_ranges`]: the updated shards travel back as
//!    bytes (skipped when the step was skipped, on every rank alike).
//!
//! So every rank ends the step with the unsharded run's weights; only the
//! moments are split (`2N/P` elements per rank instead of `2N`).
//! Checkpoints stay whole: [`gather_moments`] puts the shards together
//! before rank 0 writes, and a resume at any `P` narrows the whole moments
//! to the rank's shard again.

use std::ops::Range;

use mamba_reduce::Reducer;

use super::reduce_err;
use crate::error::Result;
use crate::optim::shard::{encode_partials, OptimizerShards};
use crate::train::{Backend, Trainer};

/// This world's optimizer partition (chunk-aligned, rank order).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZeroShards {
    shards: OptimizerShards,
    ranges: Vec<Range<usize>>,
}

impl ZeroShards {
    /// The partition of a `len`-element arena over `world` ranks.
    pub fn new(len: usize, world: usize) -> Result<Self> {
        let shards = OptimizerShards::new(len, world)?;
        Ok(ZeroShards {
            ranges: shards.ranges(),
            shards,
        })
    }

    /// Every rank's element range, in rank order.
    pub fn ranges(&self) -> &[Range<usize>] {
        &self.ranges
    }

    /// Rank `rank`'s element range.
    pub fn range(&self, rank: usize) -> Range<usize> {
        self.shards.range(rank)
    }

    /// Step 2 above: this rank's chunk sums in, the whole arena's out (in
    /// chunk order, the same on every rank). Collective.
    pub fn gather_chunk_sums<R: Reducer>(&self, reducer: &mut R, own: &[f64]) -> Result<Vec<f64>> {
        let values = encode_partials(own, self.shards.max_chunks());
        let all = reducer.all_gather_host(&values).map_err(reduce_err)?;
        self.shards.chunk_sums_from_gathered(&all)
    }
}

/// The whole moments (first, second) on the host of every rank, from every
/// rank's shard: each shard placed in a whole arena and all-gathered as
/// bytes. Every rank holds two whole arenas while this runs (checkpoints
/// only). Collective.
pub fn gather_moments<B, R>(
    zero: &ZeroShards,
    trainer: &mut Trainer<B>,
    reducer: &mut R,
) -> Result<(Vec<f32>, Vec<f32>)>
where
    B: Backend,
    R: Reducer<Buffer = B::Arena>,
{
    let own = zero.range(reducer.rank());
    let n = trainer.arena_len();
    let (m, v) = trainer.shard_moments_host()?;
    let mut whole = |part: Vec<f32>| -> Result<Vec<f32>> {
        if part.len() != own.len() {
            return Err(crate::error::TrainError::Config(format!(
                "rank {} holds {} moments but owns elements {own:?}",
                reducer.rank(),
                part.len()
            )));
        }
        let mut host = vec![0.0f32; n];
        host[own.clone()].copy_from_slice(&part);
        let mut arena = trainer.backend_mut().upload(&host)?;
        reducer
            .all_gather_ranges(&mut arena, zero.ranges())
            .map_err(reduce_err)?;
        Ok(trainer.backend_mut().to_host(&arena)?.into_owned())
    };
    let m = whole(m)?;
    let v = whole(v)?;
    Ok((m, v))
}
