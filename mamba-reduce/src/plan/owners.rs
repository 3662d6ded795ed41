//! Plans that end at the shard owners (a reduce-scatter): the same
//! dataflow and the same additions as the all-reduce plan, with every
//! message of the final distribution cut down to what its receiver owns.
//!
//! Why this keeps the bits: which rank computes an element, and from which
//! addends in which order, is decided before the distribution starts; the
//! distribution only copies finished values. Cutting a copy to the
//! receiver's range changes where values arrive, never what they are. Both
//! ends of every message cut it the same way (from the same `owned`
//! ranges, the same on every rank), so sends and receives still pair up;
//! a message whose cut is empty is dropped on both ends.
//!
//! Traffic: the folding phases are unchanged and the distribution shrinks
//! from `(P-1)/P N` per rank to about `(P-1)/P^2 N` (a folded shard of
//! chunk `a` belongs, except at range boundaries, to one owner), so a
//! sharded plan sends `(P-1)/P N (1 + 1/P)` per rank against a minimal
//! reduce-scatter's `(P-1)/P N`: the fold shards are cut per chunk for
//! balance, the owners' ranges are contiguous. With one chunk (the sharded
//! default) the fold shards are the even split, so an even partition sends
//! nothing back at all and a chunk-aligned one only the slivers between
//! the two.

use std::ops::Range;

use super::{BufId, CommOp, Dataflow, RankPlan, Step, CHAIN_DST_LIMIT};
use crate::contract::ReduceContract;
use crate::{ReduceError, Result};

/// `owned` is one range per rank, in rank order, ascending and disjoint,
/// inside `0..len`.
pub(super) fn check(owned: &[Range<usize>], world: usize, len: usize) -> Result<()> {
    if owned.len() != world {
        return Err(ReduceError::config(format!(
            "a reduce-scatter over {world} ranks needs {world} owned ranges (one per rank), got {}",
            owned.len()
        )));
    }
    let mut floor = 0;
    for (k, r) in owned.iter().enumerate() {
        if r.start > r.end || r.end > len || r.start < floor {
            return Err(ReduceError::config(format!(
                "owned range {k} ({r:?}) must lie inside the arena (0..{len}), after range {} \
                 (owned ranges are ascending and disjoint, in rank order)",
                k.saturating_sub(1)
            )));
        }
        floor = r.end;
    }
    Ok(())
}

/// The smallest range covering every non-empty range of `ranges` (empty if
/// none is).
fn span(ranges: &[Range<usize>]) -> Range<usize> {
    let mut live = ranges.iter().filter(|r| !r.is_empty());
    match (live.next(), ranges.iter().rfind(|r| !r.is_empty())) {
        (Some(first), Some(last)) => first.start..last.end,
        _ => 0..0,
    }
}

fn intersect(a: Range<usize>, b: Range<usize>) -> Range<usize> {
    let (start, end) = (a.start.max(b.start), a.end.min(b.end));
    if start < end {
        start..end
    } else {
        0..0
    }
}

impl RankPlan {
    /// The plan of `rank` under `contract` (as [`RankPlan::for_contract`])
    /// that ends at the owners: afterwards `locals[0][owned[k]]` holds the
    /// mean at rank `k`, bit for bit what the all-reduce plan puts there;
    /// the rest of `locals[0]` is unspecified (it may hold the mean, a
    /// partial sum or this rank's own gradient). `owned` has one range per
    /// rank, in rank order, ascending and disjoint, inside `0..len`, and
    /// must be the same on every rank.
    pub fn ending_at_owners(
        contract: ReduceContract,
        rank: usize,
        world: usize,
        logical_world: usize,
        len: usize,
        chunk_elems: Option<usize>,
        owned: &[Range<usize>],
    ) -> Result<Self> {
        Self::ending_at(
            contract,
            rank,
            world,
            logical_world,
            len,
            chunk_elems,
            Some(owned),
        )
    }

    /// The plan of `rank` under `contract`, ending on every rank (`owned`
    /// `None`: [`RankPlan::for_contract`]) or at the owners
    /// ([`RankPlan::ending_at_owners`]).
    pub fn ending_at(
        contract: ReduceContract,
        rank: usize,
        world: usize,
        logical_world: usize,
        len: usize,
        chunk_elems: Option<usize>,
        owned: Option<&[Range<usize>]>,
    ) -> Result<Self> {
        let dataflow = match contract {
            ReduceContract::FixedOrder if logical_world == world => Dataflow::Sharded,
            ReduceContract::FixedOrder => Dataflow::Pipeline,
            ReduceContract::FixedTree => {
                contract.check_logical_world(logical_world)?;
                Dataflow::Tree
            }
            ReduceContract::NcclSum => {
                return Err(ReduceError::config(
                    "the nccl-sum contract has no plan: the library's all-reduce sums",
                ))
            }
        };
        Self::build(
            rank,
            world,
            logical_world,
            len,
            chunk_elems,
            dataflow,
            CHAIN_DST_LIMIT,
            owned.map(<[Range<usize>]>::to_vec),
        )
    }

    /// Where the reduction ends: `None` on every rank (all-reduce), or the
    /// owned range of each rank (reduce-scatter).
    pub fn owners(&self) -> Option<&[Range<usize>]> {
        self.owners.as_deref()
    }

    /// The part of finished arena elements `range` that the distribution
    /// must deliver to `peer`.
    pub(super) fn delivered(&self, peer: usize, range: Range<usize>) -> Range<usize> {
        match &self.owners {
            None => range,
            Some(owned) => intersect(range, owned[peer].clone()),
        }
    }

    /// The distribution of one chunk's finished shards in `step`: to every
    /// other rank the part of this rank's finished elements `own` it must
    /// receive, and from every other rank the part of its finished elements
    /// (`theirs(peer)`) this rank must receive, both in the arena; chunk-
    /// relative ranges, arena offset `base`. A message whose cut is empty is
    /// dropped on both ends (both cut it from the same ranges).
    pub(super) fn push_distribution(
        &self,
        step: &mut Step,
        rank: usize,
        world: usize,
        base: usize,
        own: Range<usize>,
        theirs: impl Fn(usize) -> Range<usize>,
    ) {
        for peer in (0..world).filter(|&p| p != rank) {
            let out = self.delivered(peer, base + own.start..base + own.end);
            if !out.is_empty() {
                step.comm.push(CommOp::Send {
                    buf: BufId::Local(0),
                    range: out,
                    peer,
                });
            }
            let t = theirs(peer);
            let got = self.delivered(rank, base + t.start..base + t.end);
            if !got.is_empty() {
                step.comm.push(CommOp::Recv {
                    buf: BufId::Local(0),
                    range: got,
                    peer,
                });
            }
        }
    }

    /// The part of finished arena elements `range` that a relay must carry
    /// on to ranks `peers` (the union of what they own, as one range).
    pub(super) fn delivered_to_all(
        &self,
        peers: Range<usize>,
        range: Range<usize>,
    ) -> Range<usize> {
        match &self.owners {
            None => range,
            Some(owned) => intersect(range, span(&owned[peers])),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_skip_empty_ranges() {
        assert_eq!(span(&[0..0, 3..5, 5..5, 7..9, 9..9]), 3..9);
        assert_eq!(span(&[4..4, 4..4]), 0..0);
        assert_eq!(span(&[]), 0..0);
        assert_eq!(intersect(0..10, 5..20), 5..10);
        assert_eq!(intersect(0..5, 5..20), 0..0);
    }

    #[test]
    fn owned_ranges_are_checked() {
        assert!(check(&[0..5, 5..10], 2, 10).is_ok());
        assert!(check(&[0..0, 0..10], 2, 10).is_ok());
        assert!(
            check(std::slice::from_ref(&(0..5)), 2, 10).is_err(),
            "one range per rank"
        );
        assert!(check(&[0..6, 5..10], 2, 10).is_err(), "overlap");
        assert!(check(&[5..10, 0..5], 2, 10).is_err(), "rank order");
        assert!(check(&[0..5, 5..11], 2, 10).is_err(), "past the arena");
    }
}
