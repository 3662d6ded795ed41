//! [`ArenaMath`]: the arena arithmetic the optimizer needs, on whatever
//! memory holds the arenas, and [`HostMath`], its host implementation.
//!
//! The optimizer's state machine (schedule, clipping, skip on a non-finite
//! norm, the update counter) is written once ([`super::Optimizer`]); a
//! device supplies only these two operations. Every implementation keeps the
//! CPU's numerical contract bit for bit: the norm's association of
//! [`super::clip::global_norm`] (f64 chunks of
//! [`NORM_CHUNK`](super::clip::NORM_CHUNK), summed in chunk order) and the
//! per-element AdamW formula of [`AdamWStep`] with no contraction. That is
//! what makes an optimizer step on the GPU the same bits as on the CPU.

use std::ops::Range;

use kernels::mamba::AdamWStep;
use rayon::prelude::*;

use super::clip::global_norm;
use crate::error::{Result, TrainError};

/// Arithmetic over gradient, weight and moment arenas of type
/// [`Self::Arena`]. Implementations check arena lengths and report a
/// mismatch as an error, never by touching memory out of range.
pub trait ArenaMath {
    /// Where the arenas live: host `Vec<f32>`, or device memory.
    type Arena;

    /// The Euclidean norm of `grads` with the fixed association above
    /// (non-finite when any element is).
    fn global_norm(&mut self, grads: &Self::Arena) -> Result<f64>;

    /// One AdamW update in place on `params`, `m`, `v` with the constants
    /// `k`, decaying the elements in `decayed` (ascending, disjoint).
    fn adamw(
        &mut self,
        k: &AdamWStep,
        decayed: &[Range<usize>],
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

    fn global_norm(&mut self, grads: &Vec<f32>) -> Result<f64> {
        Ok(global_norm(grads))
    }

    fn adamw(
        &mut self,
        k: &AdamWStep,
        decayed: &[Range<usize>],
        params: &mut Vec<f32>,
        grads: &Vec<f32>,
        m: &mut Vec<f32>,
        v: &mut Vec<f32>,
    ) -> Result<()> {
        host_adamw(k, decayed, params, grads, m, v)
    }
}

/// Elements per parallel work item of the update.
pub const UPDATE_CHUNK: usize = 1 << 14;

/// One AdamW update over host slices, in fixed chunks (any thread count,
/// the same bits): the CPU's [`ArenaMath::adamw`].
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
