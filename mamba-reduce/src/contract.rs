//! The two reduction contracts and what a user may rely on under each.

use std::fmt;
use std::str::FromStr;

use crate::{ReduceError, Result};

/// How the gradient mean is computed, and therefore which changes between
/// two runs keep its bits.
///
/// | change between two runs | [`FixedOrder`](ReduceContract::FixedOrder) | [`NcclSum`](ReduceContract::NcclSum) |
/// |---|---|---|
/// | re-run, same machine | same bits | same bits |
/// | delivery order, timing, transport (host vs NCCL) | same bits | may differ |
/// | NCCL version, topology, GPU permutation | same bits | may differ |
/// | physical world size at a fixed logical world | same bits | may differ |
/// | logical world size | differs (part of the run's identity) | differs |
/// | stop and resume from a checkpoint | same bits | same bits on a frozen machine |
///
/// Under both contracts the mean is the sum multiplied by `fl(1/L)` (exact
/// for power-of-two `L`); addends are never pre-scaled. Per-rank compute
/// must itself be deterministic for whole-run identity; the reducer adds no
/// nondeterminism of its own under `FixedOrder`.
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
        }
    }

    /// Inverse of [`ReduceContract::code`].
    pub fn from_code(code: u64) -> Option<Self> {
        match code {
            1 => Some(ReduceContract::FixedOrder),
            2 => Some(ReduceContract::NcclSum),
            _ => None,
        }
    }

    /// The spelling used on command lines and in checkpoints.
    pub fn name(self) -> &'static str {
        match self {
            ReduceContract::FixedOrder => "fixed-order",
            ReduceContract::NcclSum => "nccl-sum",
        }
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
            other => Err(ReduceError::config(format!(
                "unknown reduce contract {other:?}; expected \"fixed-order\" (default) or \"nccl-sum\""
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_and_names_round_trip() {
        for c in [ReduceContract::FixedOrder, ReduceContract::NcclSum] {
            assert_eq!(ReduceContract::from_code(c.code()), Some(c));
            assert_eq!(c.name().parse::<ReduceContract>().unwrap(), c);
        }
        assert_eq!(ReduceContract::default(), ReduceContract::FixedOrder);
        assert_eq!(ReduceContract::from_code(0), None);
        let err = "sum".parse::<ReduceContract>().unwrap_err().to_string();
        assert!(err.contains("fixed-order"), "{err}");
    }
}
