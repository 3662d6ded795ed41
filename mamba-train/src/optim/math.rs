//! [`ArenaMath`]: the arena arithmetic the optimizer needs, on whatever
//! memory holds the arenas, and [`HostMath`], its host implementation.
//!
//! The optimizer's state machine (schedule, clipping, skip on a non-finite
//! norm, the update counter) is written once ([`super::Optimizer`]); a
//! device supplies only these two operations, each over a shard of the
//! arena (the whole arena, or one ZeRO-1 owner's part). Every implementation keeps the
//! CPU's numerical contract bit for bit: the norm's association of
//! [`super::clip::global_norm`] (f64 chunks of
//! [`NORM_CHUNK`], summed in chunk order) and the
//! per-element AdamW formula of [`AdamWStep`] with no contraction. That is
//! what makes an optimizer step on the GPU the same bits as on the CPU.

use std::ops::Range;

use kernels::mamba::AdamWStep;
use rayon::prelude::*;

use super::clip::{chunk_sums, NORM_CHUNK};
use crate::error::{Result, TrainError};

/// Arithmetic over gradient, weight and moment arenas of type
/// [`Self::Arena`]. Implementations check arena lengths and report a
/// mismatch as an error, never by touching memory out of range.
///
/// Both operations work on a *shard* of the arena, an element range: the
/// whole arena for the unsharded optimizer, one rank's part under ZeRO-1
/// ([`super::shard::OptimizerShards`]). Weights and gradients are always
/// whole arenas (only the shard is read or written); the moments hold the
/// shard alone (`m[i]` is arena element `shard.start + i`), which is the
/// optimizer's `1/P` memory.
pub trait ArenaMath {
    /// Where the arenas live: host `Vec<f32>`, or device memory.
    type Arena;

    /// The [`NORM_CHUNK`] chunk sums of squares of
    /// `grads[shard]`, in f64 and in chunk order, exactly as
    /// [`super::clip::chunk_sums`] (non-finite where an element is).
    /// `shard` starts on a chunk boundary and ends on one or at the
    /// arena's end, so the sums are the arena's own chunk sums.
    fn norm_partials(&mut self, grads: &Self::Arena, shard: Range<usize>) -> Result<Vec<f64>>;

    /// One AdamW update in place on `params[shard]`, `m`, `v` (the shard's
    /// moments) with the constants `k`, reading `grads[shard]` and decaying
    /// the arena elements in `decayed` (arena coordinates, ascending,
    /// disjoint).
    #[allow(clippy::too_many_arguments)]
    fn adamw(
        &mut self,
        k: &AdamWStep,
        decayed: &[Range<usize>],
        shard: Range<usize>,
        params: &mut Self::Arena,
        grads: &Self::Arena,
        m: &mut Self::Arena,
        v: &mut Self::Arena,
    ) -> Result<()>;
}

/// [`ArenaMath`] over host vectors, on the caller's rayon pool: the same
/// bits for any thread count (fixed chunk boundaries).
#[derive(Clone, Copy, Debug, Default)]
pub struct HostMath;

impl ArenaMath for HostMath {
    type Arena = Vec<f32>;

    fn norm_partials(&mut self, grads: &Vec<f32>, shard: Range<usize>) -> Result<Vec<f64>> {
        check_norm_shard(&shard, grads.len())?;
        Ok(chunk_sums(&grads[shard]))
    }

    fn adamw(
        &mut self,
        k: &AdamWStep,
        decayed: &[Range<usize>],
        shard: Range<usize>,
        params: &mut Vec<f32>,
        grads: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
    ) -> Result<()> {
        check_update_shard(&shard, params.len(), grads.len(), m.len(), v.len())?;
        let local = decayed_within(decayed, &shard);
        host_adamw(k, &local, &mut params[shard.clone()], &grads[shard], m, v)
    }
}

/// Refuse a norm shard that is not made of whole chunks of an arena of
/// `len` elements (its sums would not be the arena's).
pub fn check_norm_shard(shard: &Range<usize>, len: usize) -> Result<()> {
    let aligned = |x: usize| x % NORM_CHUNK == 0 || x == len;
    if shard.start > shard.end || shard.end > len || !aligned(shard.start) || !aligned(shard.end) {
        return Err(TrainError::Config(format!(
            "gradient norm over elements {shard:?} of a {len}-element arena: a shard must lie              within the arena and start and end on {NORM_CHUNK}-element chunk boundaries (or at              the arena's end)"
        )));
    }
    Ok(())
}

/// Refuse an update whose shard lies outside the weights or gradients, or
/// whose moments do not hold the shard.
pub fn check_update_shard(
    shard: &Range<usize>,
    params: usize,
    grads: usize,
    m: usize,
    v: usize,
) -> Result<()> {
    if shard.start > shard.end
        || shard.end > params
        || params != grads
        || m != shard.len()
        || v != shard.len()
    {
        return Err(TrainError::Config(format!(
            "AdamW update of elements {shard:?}: params {params} and grads {grads} elements,              optimizer state {m} and {v} (it must hold the shard's {} elements)",
            shard.len()
        )));
    }
    Ok(())
}

/// The decayed ranges (arena coordinates) that meet `shard`, clipped to it
/// and shifted to the shard's coordinates (element 0 = `shard.start`):
/// what makes a shard's update decay exactly where the whole update does.
pub fn decayed_within(decayed: &[Range<usize>], shard: &Range<usize>) -> Vec<Range<usize>> {
    decayed
        .iter()
        .filter_map(|r| {
            let (s, e) = (r.start.max(shard.start), r.end.min(shard.end));
            (s < e).then(|| s - shard.start..e - shard.start)
        })
        .collect()
}

/// Elements per parallel work item of the update.
pub const UPDATE_CHUNK: usize = 1 << 14;

/// One AdamW update over host slices (one shard: `decayed` in the slices'
/// coordinates), in fixed chunks (any thread count, the same bits): the
/// CPU's [`ArenaMath::adamw`].
fn host_adamw(
    k: &AdamWStep,
    decayed: &[Range<usize>],
    params: &mut [f32],
    grads: &[f32],
    m: &mut [f32],
    v: &mut [f32],
) -> Result<()> {
    let n = m.len();
    if params.len() != n || grads.len() != n || v.len() != n {
        return Err(TrainError::Config(format!(
            "AdamW update: params {} and grads {} elements, optimizer state {} and {}",
            params.len(),
            grads.len(),
            n,
            v.len()
        )));
    }
    params
        .par_chunks_mut(UPDATE_CHUNK)
        .zip(grads.par_chunks(UPDATE_CHUNK))
        .zip(m.par_chunks_mut(UPDATE_CHUNK))
        .zip(v.par_chunks_mut(UPDATE_CHUNK))
        .enumerate()
        .for_each(|(ci, (((p, g), m), v))| {
            let base = ci * UPDATE_CHUNK;
            let mut i = 0;
            // Walk the chunk as runs of equal decay, so the inner loop
            // has no per-element branch on the tensor kind.
            while i < p.len() {
                let (decay, run_end) = decay_run(decayed, base + i, base + p.len());
                let end = run_end - base;
                update_run(
                    k,
                    decay,
                    &mut p[i..end],
                    &g[i..end],
                    &mut m[i..end],
                    &mut v[i..end],
                );
                i = end;
            }
        });
    Ok(())
}

#[inline]
fn update_run(k: &AdamWStep, decay: bool, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
    for i in 0..p.len() {
        let gi = g[i] * k.scale;
        let mi = k.b1 * m[i] + k.omb1 * gi;
        let vi = k.b2 * v[i] + k.omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        let mut pi = p[i];
        if decay {
            pi *= k.decay_factor;
        }
        let denom = vi.sqrt() / k.bc2_sqrt + k.eps;
        p[i] = pi - k.step_size * (mi / denom);
    }
}

/// Whether element `at` is decayed, and where that run of equal decay ends
/// (capped at `limit`).
fn decay_run(decayed: &[Range<usize>], at: usize, limit: usize) -> (bool, usize) {
    // First decayed range that ends after `at`.
    let idx = decayed.partition_point(|r| r.end <= at);
    match decayed.get(idx) {
        Some(r) if r.start <= at => (true, r.end.min(limit)),
        Some(r) => (false, r.start.min(limit)),
        None => (false, limit),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decay_runs_cover_chunk_boundaries() {
        let d = vec![2..5, 8..9];
        assert_eq!(decay_run(&d, 0, 100), (false, 2));
        assert_eq!(decay_run(&d, 2, 100), (true, 5));
        assert_eq!(decay_run(&d, 4, 4 + 1), (true, 5));
        assert_eq!(decay_run(&d, 3, 4), (true, 4), "capped at the chunk end");
        assert_eq!(decay_run(&d, 5, 100), (false, 8));
        assert_eq!(decay_run(&d, 9, 100), (false, 100));
    }
}
