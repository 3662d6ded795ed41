//! How an arena (or one chunk of it) is cut into per-rank shards.

use std::ops::Range;

use crate::{ReduceError, Result};

/// Contiguous shards in rank order: shard `k` of `len` elements over
/// `parts` ranks has `len / parts` elements, plus one for each of the lowest
/// `len % parts` ranks. Shards may be empty (fewer elements than ranks);
/// together they cover `0..len` exactly once, in order.
///
/// Every rank computes the same plan from `(len, parts)` alone, which is
/// why sender and receiver always agree on a message's length without
/// exchanging it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardPlan {
    len: usize,
    parts: usize,
}

impl ShardPlan {
    /// A plan of `len` elements over `parts >= 1` ranks.
    pub fn new(len: usize, parts: usize) -> Result<Self> {
        if parts == 0 {
            return Err(ReduceError::config(
                "a shard plan needs at least one part (a world of at least one rank)",
            ));
        }
        Ok(ShardPlan { len, parts })
    }

    /// Crate-internal constructor for callers that already know
    /// `parts >= 1` (a validated world size); 0 is treated as 1.
    pub(crate) fn of(len: usize, parts: usize) -> Self {
        ShardPlan {
            len,
            parts: parts.max(1),
        }
    }

    /// Total elements covered.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the plan covers no element at all.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of shards.
    pub fn parts(&self) -> usize {
        self.parts
    }

    /// Element range of shard `k` (empty for `k >= parts`).
    pub fn range(&self, k: usize) -> Range<usize> {
        if k >= self.parts {
            return self.len..self.len;
        }
        let base = self.len / self.parts;
        let rem = self.len % self.parts;
        let start = k * base + k.min(rem);
        let size = base + usize::from(k < rem);
        start..start + size
    }

    /// Length of the largest shard (shard 0's).
    pub fn max_shard_len(&self) -> usize {
        self.range(0).len()
    }

    /// Every shard's range, in rank order.
    pub fn ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        (0..self.parts).map(move |k| self.range(k))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn remainder_goes_to_lowest_ranks() {
        let p = ShardPlan::new(10, 4).unwrap();
        let r: Vec<_> = p.ranges().collect();
        assert_eq!(r, vec![0..3, 3..6, 6..8, 8..10]);
        let p = ShardPlan::new(2, 5).unwrap();
        let r: Vec<_> = p.ranges().collect();
        assert_eq!(r, vec![0..1, 1..2, 2..2, 2..2, 2..2]);
        assert!(ShardPlan::new(3, 0).is_err());
    }

    proptest! {
        #[test]
        fn shards_tile_the_range(len in 0usize..20_000, parts in 1usize..=64) {
            let p = ShardPlan::new(len, parts).unwrap();
            let mut next = 0;
            let mut prev_size = usize::MAX;
            for r in p.ranges() {
                prop_assert_eq!(r.start, next);
                // Non-increasing sizes that differ by at most one.
                prop_assert!(r.len() <= prev_size);
                prop_assert!(r.len() + 1 >= p.max_shard_len());
                prev_size = r.len();
                next = r.end;
            }
            prop_assert_eq!(next, len);
        }
    }
}
