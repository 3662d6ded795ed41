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

use super::adamw::host_adamw;
use super::clip::global_norm;
use crate::error::Result;

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
