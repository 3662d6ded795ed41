//! The reduction contracts and what a user may rely on under each.

use std::fmt;
use std::str::FromStr;

use crate::{ReduceError, Result};

/// How the gradient mean is computed, and therefore which changes between
/// two runs keep its bits.
///
/// | change between two runs | [`FixedOrder`](ReduceContract::FixedOrder), [`FixedTree`](ReduceContract::FixedTree) | [`NcclSum`](ReduceContract::NcclSum) |
/// |---|---|---|
/// | re-run, same machine | same bits | same bits |
/// | delivery order, timing, transport (host vs NCCL) | same bits | may differ |
/// | NCCL version, topology, GPU permutation | same bits | may differ |
/// | physical world size at a fixed logical world | same bits | may differ |
/// | logical world size | differs (part of the run's identity) | differs |
/// | stop and resume from a checkpoint | same bits | same bits on a frozen machine |
///
/// `FixedOrder` and `FixedTree` are two different associations of the same
/// addends, so their bits differ from each other (the contract is part of
/// a run's identity). Under every contract the mean is the sum multiplied
/// by `fl(1/L)` (exact for power-of-two `L`; no multiply at all for
/// `L = 1`); addends are never pre-scaled. Per-rank compute must itself be
/// deterministic for whole-run identity; the reducer adds no
/// nondeterminism of its own under `FixedOrder` and `FixedTree`.
///
/// What neither contract promises: the payload and sign bits of a NaN
/// result (a NaN stays a NaN; GPUs return a canonical NaN, CPUs propagate an
/// input's payload), and anything about values produced by non-deterministic
/// per-rank compute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum ReduceContract {
    /// Per element, the `L` logical addends are summed in strictly ascending
    /// logical-rank order, `((g0 + g1) + g2) + ...`, in f32 with
    /// round-to-nearest and no contraction, then multiplied by `fl(1/L)`.
    /// The bits depend only on `L` and the addends: not on the transport,
    /// the delivery order, the topology, the NCCL version or the number of
    /// processes the `L` logical ranks are spread over. Only byte movement
    /// is delegated to the transport.
    #[default]
    FixedOrder,
    /// Per element, the complete binary tree over the `L` logical addends
    /// in logical order (`L` a power of two): `(g0 + g1)`, `(g2 + g3)`, ...,
    /// then pairs of those pairs, up to the root, in f32 with
    /// round-to-nearest and no contraction, then multiplied by `fl(1/L)`.
    /// The bits depend only on `L` and the addends, exactly as under
    /// `FixedOrder` (same guarantees), but the association differs, so
    /// the bits differ from `FixedOrder`'s.
    ///
    /// Why it exists: every aligned block of `L/P` logical ranks (`P` a
    /// power of two dividing `L`) is a subtree, so a process folds its block
    /// as its micro-batches finish, keeping a binary counter of at most
    /// `log2(L/P) + 1` arenas ([`TreeAccumulator`](crate::TreeAccumulator))
    /// instead of all `L/P`, and the upper `log2(P)` levels are finished
    /// across processes. Gradient accumulation over many micro-batches then
    /// costs logarithmic, not linear, gradient memory, and the bits are
    /// still the same for every `P`. An `L` that is not a power of two is
    /// refused (the tree would not be complete).
    FixedTree,
    /// The library's own f32 sum all-reduce (NCCL's ring/tree, or the host
    /// transport's order), then multiplied by `fl(1/L)`. Fastest, and
    /// stable only on a frozen machine and configuration: NCCL picks its
    /// algorithm, protocol, channel count and therefore its association
    /// from the topology, the message size, the version and environment
    /// variables, so any of those changing may change the bits. With more
    /// logical than physical ranks, each process first folds its own block
    /// of `L/P` addends in ascending order and the library then sums the
    /// `P` block sums, so the association (and the bits) also depend on
    /// `P`.
    NcclSum,
}

impl ReduceContract {
    /// The stable numeric code used in identity exchanges and checkpoints.
    pub fn code(self) -> u64 {
        match self {
            ReduceContract::FixedOrder => 1,
            ReduceContract::NcclSum => 2,
            ReduceContract::FixedTree => 3,
        }
    }

    /// Inverse of [`ReduceContract::code`].
    pub fn from_code(code: u64) -> Option<Self> {
        match code {
            1 => Some(ReduceContract::FixedOrder),
            2 => Some(ReduceContract::NcclSum),
            3 => Some(ReduceContract::FixedTree),
            _ => None,
        }
    }

    /// The spelling used on command lines and in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            ReduceContract::FixedOrder => "fixed-order",
            ReduceContract::NcclSum => "nccl-sum",
            ReduceContract::FixedTree => "fixed-tree",
        }
    }

    /// Every contract, in code order (for help texts and exhaustive tests).
    pub const ALL: [ReduceContract; 3] = [
        ReduceContract::FixedOrder,
        ReduceContract::NcclSum,
        ReduceContract::FixedTree,
    ];

    /// Whether this contract can average over `logical_world` logical ranks:
    /// [`ReduceContract::FixedTree`] needs a power of two (a complete binary
    /// tree); the others take any `L >= 1`. The error names `L` and what
    /// would work.
    pub fn check_logical_world(self, logical_world: usize) -> Result<()> {
        if self == ReduceContract::FixedTree && !logical_world.is_power_of_two() {
            let below = if logical_world > 1 {
                1usize << (usize::BITS - 1 - logical_world.leading_zeros())
            } else {
                1
            };
            return Err(ReduceError::config(format!(
                "the fixed-tree contract needs a logical world that is a power of two (the \
                 complete binary tree over the L logical ranks), got L = {logical_world}; use L = \
                 {below} or {}, or the fixed-order contract, which takes any L",
                below * 2
            )));
        }
        Ok(())
    }
}

impl fmt::Display for ReduceContract {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ReduceContract {
    type Err = ReduceError;

    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().replace('_', "-").as_str() {
            "fixed-order" | "fixedorder" | "fixed" => Ok(ReduceContract::FixedOrder),
            "nccl-sum" | "ncclsum" | "library-sum" => Ok(ReduceContract::NcclSum),
            "fixed-tree" | "fixedtree" | "tree" => Ok(ReduceContract::FixedTree),
            other => Err(ReduceError::config(format!(
                "unknown reduce contract {other:?}; expected \"fixed-order\" (default), \
                 \"fixed-tree\" or \"nccl-sum\""
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for c in ReduceContract::ALL {
            assert_eq!(ReduceContract::from_code(c.code()), Some(c));
            assert_eq!(c.name().parse::<ReduceContract>().unwrap(), c);
        }
        assert_eq!(ReduceContract::default(), ReduceContract::FixedOrder);
        assert_eq!(ReduceContract::from_code(0), None);
        let err = "sum".parse::<ReduceContract>().unwrap_err().to_string();
        assert!(err.contains("fixed-order"), "{err}");
        assert!(err.contains("fixed-tree"), "{err}");
        // Codes recorded in checkpoints never move.
        assert_eq!(ReduceContract::FixedOrder.code(), 1);
        assert_eq!(ReduceContract::NcclSum.code(), 2);
        assert_eq!(ReduceContract::FixedTree.code(), 3);
    }

    #[test]
    fn only_the_tree_needs_a_power_of_two() {
        for l in [1usize, 2, 4, 64, 1 << 20] {
            ReduceContract::FixedTree.check_logical_world(l).unwrap();
        }
        for (l, hint) in [(3usize, "L = 2 or 4"), (6, "L = 4 or 8"), (0, "L = 1 or 2")] {
            let e = ReduceContract::FixedTree
                .check_logical_world(l)
                .unwrap_err()
                .to_string();
            assert!(e.contains(&format!("got L = {l}")), "{e}");
            assert!(e.contains("power of two") && e.contains(hint), "{e}");
        }
        for l in [3usize, 6, 7] {
            ReduceContract::FixedOrder.check_logical_world(l).unwrap();
            ReduceContract::NcclSum.check_logical_world(l).unwrap();
        }
    }
}
