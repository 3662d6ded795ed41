//! The fixed-tree dataflow (`FixedTree`, `P` a power of two dividing a
//! power-of-two `L`): the upper `log2(P)` levels of the tree, finished
//! across processes by recursive halving, then the result gathered.
//!
//! Input: one arena per rank, its block's subtree sum (the lower
//! `log2(L/P)` levels, folded locally by
//! [`TreeAccumulator`](crate::TreeAccumulator)). Level `k` (`0 <= k <
//! log2 P`) pairs rank `p` with `q = p ^ 2^k`: before it, `p` holds over
//! some element range the sum of the aligned group of `2^k` ranks agreeing
//! with it on bits `>= k`, i.e. one tree node over `2^k L/P` consecutive
//! logical ranks; `p` and `q` hold the two children of the next node on
//! the same range. Each keeps one half of the range (the rank with bit `k`
//! clear the lower half), sends the other half to its partner, receives the
//! partner's copy of its own half into scratch and adds it in place: one
//! `det_chain` of two terms. Two-term sums commute exactly, so the node's
//! bits do not depend on who adds. After the last level (whose fold also
//! multiplies by `fl(1/L)`) every rank holds the root over one shard, and
//! the shards travel to every peer, straight into their arenas.
//!
//! Shards: the chunk is cut into `P` [`ShardPlan`] positions (contiguous,
//! remainder to the lowest positions, empty ones allowed); rank `p` ends
//! with position `bitrev(p)`, which keeps the range held at every level
//! contiguous (before level `k` it is the positions whose top `k` bits are
//! `bitrev_k(p mod 2^k)`). Chunk `a`'s level `k` runs at step `a + k`, its
//! gather at step `a + log2 P`; `min(C, log2 P)` scratch regions (chunk `a`
//! in region `a mod` that), each the largest kept half, keep the chunks in
//! flight at one step apart.
//!
//! Bytes per rank: `(P-1)/P N` on the way down plus `(P-1)/P N` for the
//! gather, a ring all-reduce's; `log2(P) + 1` groups for one chunk.

use std::ops::Range;

use super::{BufId, ChainTerm, CommOp, ComputeOp, RankPlan, Step};
use crate::shard::ShardPlan;

/// The low `bits` bits of `x` reversed.
fn bit_reverse(x: usize, bits: u32) -> usize {
    (0..bits).fold(0, |acc, b| (acc << 1) | ((x >> b) & 1))
}

/// Shard positions rank `rank` holds before level `level` (of `levels`).
fn held(rank: usize, level: u32, levels: u32) -> Range<usize> {
    let width = 1usize << (levels - level);
    let block = bit_reverse(rank & ((1 << level) - 1), level);
    block * width..(block + 1) * width
}

/// Elements of shard positions `positions` under `shards`.
fn elements(shards: &ShardPlan, positions: Range<usize>) -> Range<usize> {
    if positions.is_empty() {
        return 0..0;
    }
    shards.range(positions.start).start..shards.range(positions.end - 1).end
}

/// The halves of `rank`'s range at `level`: (kept, sent to the partner),
/// as element ranges of the chunk.
fn halves(
    shards: &ShardPlan,
    rank: usize,
    level: u32,
    levels: u32,
) -> (Range<usize>, Range<usize>) {
    let pos = held(rank, level, levels);
    let mid = pos.start + pos.len() / 2;
    let (lower, upper) = (pos.start..mid, mid..pos.end);
    if (rank >> level) & 1 == 0 {
        (elements(shards, lower), elements(shards, upper))
    } else {
        (elements(shards, upper), elements(shards, lower))
    }
}

impl RankPlan {
    pub(super) fn build_tree(&mut self) {
        let (world, rank) = (self.world, self.rank);
        let n_chunks = self.chunks();
        if n_chunks == 0 {
            return;
        }
        if world == 1 {
            // The block sum is the root: only the scale remains.
            if let Some(f) = self.factor() {
                self.steps = vec![Step {
                    comm: Vec::new(),
                    compute: vec![ComputeOp::Chain {
                        dst: BufId::Local(0),
                        dst_off: 0,
                        terms: vec![ChainTerm::Dst],
                        len: self.len,
                        factor: Some(f),
                    }],
                }];
            }
            return;
        }
        let levels = world.trailing_zeros();
        let first = ShardPlan::of(self.chunk_range(0).len(), world);
        let stride = (0..world)
            .map(|r| halves(&first, r, 0, levels).0.len())
            .max()
            .unwrap_or(0)
            .next_multiple_of(4);
        let regions = n_chunks.min(levels as usize);
        self.scratch_len = regions * stride;
        let mut steps = vec![Step::default(); n_chunks + levels as usize];
        for a in 0..n_chunks {
            let base = self.chunk_range(a).start;
            let shards = ShardPlan::of(self.chunk_range(a).len(), world);
            let region = (a % regions) * stride;
            for level in 0..levels {
                let partner = rank ^ (1 << level);
                let (kept, sent) = halves(&shards, rank, level, levels);
                let step = &mut steps[a + level as usize];
                if !sent.is_empty() {
                    step.comm.push(CommOp::Send {
                        buf: BufId::Local(0),
                        range: base + sent.start..base + sent.end,
                        peer: partner,
                    });
                }
                if kept.is_empty() {
                    continue;
                }
                step.comm.push(CommOp::Recv {
                    buf: BufId::Scratch,
                    range: region..region + kept.len(),
                    peer: partner,
                });
                let theirs = ChainTerm::Buf(BufId::Scratch, region);
                let terms = if rank < partner {
                    vec![ChainTerm::Dst, theirs]
                } else {
                    vec![theirs, ChainTerm::Dst]
                };
                step.compute.push(ComputeOp::Chain {
                    dst: BufId::Local(0),
                    dst_off: base + kept.start,
                    terms,
                    len: kept.len(),
                    factor: if level + 1 == levels {
                        self.factor()
                    } else {
                        None
                    },
                });
            }
            let own = elements(&shards, held(rank, levels, levels));
            let step = &mut steps[a + levels as usize];
            self.push_distribution(step, rank, world, base, own, |peer| {
                elements(&shards, held(peer, levels, levels))
            });
        }
        self.steps = steps;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn held_ranges_halve_and_end_at_the_bit_reversed_position() {
        let levels = 3;
        for rank in 0..8 {
            assert_eq!(held(rank, 0, levels), 0..8);
            assert_eq!(held(rank, levels, levels).len(), 1);
            let end = held(rank, levels, levels).start;
            assert_eq!(end, bit_reverse(rank, levels), "rank {rank}");
            for level in 0..levels {
                // Partners hold the same range and split it.
                let partner = rank ^ (1 << level);
                assert_eq!(held(rank, level, levels), held(partner, level, levels));
                let next = held(rank, level + 1, levels);
                let here = held(rank, level, levels);
                assert!(here.start <= next.start && next.end <= here.end);
                assert_eq!(next.len() * 2, here.len());
            }
        }
        assert_eq!(bit_reverse(0b001, 3), 0b100);
        assert_eq!(bit_reverse(0b110, 3), 0b011);
    }

    #[test]
    fn one_chunk_costs_a_ring_all_reduce_in_log_p_plus_one_groups() {
        let len = 1 << 20;
        for world in [2usize, 4, 8] {
            for rank in 0..world {
                let p = RankPlan::tree(rank, world, 2 * world, len, None).unwrap();
                let c = p.cost();
                let levels = world.trailing_zeros() as usize;
                assert_eq!(p.local_arenas(), 1);
                assert_eq!((c.steps, c.groups), (levels + 1, levels + 1));
                assert_eq!(c.fold_launches, levels);
                assert_eq!(
                    c.bytes_sent,
                    2 * 4 * (world as u64 - 1) * (len / world) as u64
                );
                assert_eq!(c.scratch_bytes, 4 * (len / 2) as u64);
            }
        }
        let one = RankPlan::tree(0, 1, 8, 100, None).unwrap().cost();
        assert_eq!((one.groups, one.fold_launches, one.bytes_sent), (0, 1, 0));
        assert_eq!(RankPlan::tree(0, 1, 1, 100, None).unwrap().cost().steps, 0);
    }
}
