//! The optimizer's shards for ZeRO-1 (`--shard-optimizer`): which part of
//! the arena each rank updates, and how the global norm's partial sums
//! travel between ranks without changing a bit.
//!
//! # Why the shards are unions of whole norm chunks
//!
//! The global gradient norm ([`super::clip::global_norm`]) is defined over
//! fixed [`NORM_CHUNK`]-element chunks of the arena: each chunk's sum of
//! squares in f64, sequentially, then the chunk sums added in chunk order.
//! When every shard is a run of whole chunks, an owner computes exactly the
//! chunk sums the unsharded optimizer computes for those chunks; gathering
//! them in rank order gives the chunk sums in chunk order, and adding them
//! the same way gives the unsharded norm bit for bit, for every `P`. A
//! shard boundary inside a chunk would split one f64 sequential sum in two
//! and change the association (the negative control in the tests shows the
//! bits move).
//!
//! The partition is [`ShardPlan`] over chunks instead of elements:
//! contiguous, in rank order, the remainder chunks to the lowest ranks, the
//! last chunk possibly short, empty shards allowed (more ranks than
//! chunks). Every rank derives it from `(arena length, P)` alone.

use std::ops::Range;

use mamba_reduce::ShardPlan;

use super::clip::NORM_CHUNK;
use crate::error::{Result, TrainError};

/// The chunk-aligned partition of an arena over the ranks that own its
/// optimizer shards.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OptimizerShards {
    len: usize,
    chunks: ShardPlan,
}

impl OptimizerShards {
    /// The partition of a `len`-element arena over `parts >= 1` ranks.
    pub fn new(len: usize, parts: usize) -> Result<Self> {
        let chunks = ShardPlan::new(len.div_ceil(NORM_CHUNK), parts)
            .map_err(|e| TrainError::Config(format!("partitioning the optimizer state: {e}")))?;
        Ok(OptimizerShards { len, chunks })
    }

    /// Arena length.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the arena is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of shards (ranks).
    pub fn parts(&self) -> usize {
        self.chunks.parts()
    }

    /// Norm chunks (indices) of shard `k`.
    pub fn chunk_range(&self, k: usize) -> Range<usize> {
        self.chunks.range(k)
    }

    /// Element range of shard `k` (empty for `k >= parts`).
    pub fn range(&self, k: usize) -> Range<usize> {
        let c = self.chunks.range(k);
        (c.start * NORM_CHUNK).min(self.len)..(c.end * NORM_CHUNK).min(self.len)
    }

    /// Every shard's element range, in rank order.
    pub fn ranges(&self) -> Vec<Range<usize>> {
        (0..self.parts()).map(|k| self.range(k)).collect()
    }

    /// The most chunks one shard holds (shard 0's).
    pub fn max_chunks(&self) -> usize {
        self.chunks.max_shard_len()
    }

    /// Put every rank's chunk sums (gathered by [`encode_partials`] padded
    /// to [`Self::max_chunks`], concatenated in rank order) back in chunk
    /// order. Errors when the gathered values do not have that shape.
    pub fn chunk_sums_from_gathered(&self, gathered: &[f32]) -> Result<Vec<f64>> {
        let per_rank = PIECES_PER_F64 * self.max_chunks();
        if gathered.len() != per_rank * self.parts() {
            return Err(TrainError::Config(format!(
                "the gathered norm partials hold {} values; {} ranks of {} chunks each need {}",
                gathered.len(),
                self.parts(),
                self.max_chunks(),
                per_rank * self.parts()
            )));
        }
        let mut out = Vec::with_capacity(self.len.div_ceil(NORM_CHUNK));
        for k in 0..self.parts() {
            let block = &gathered[k * per_rank..(k + 1) * per_rank];
            let mine = decode_partials(block)?;
            out.extend_from_slice(&mine[..self.chunk_range(k).len()]);
        }
        Ok(out)
    }
}

/// Host values that carry one f64 through an f32 exchange.
pub const PIECES_PER_F64: usize = 4;

/// `partials` as f32 values for a host all-gather, padded with zeros to
/// `pad_to` partials: each f64's bits as four 16-bit pieces, each an exact
/// small integer in f32, so no exchange (nor a NaN's payload) can alter them.
pub fn encode_partials(partials: &[f64], pad_to: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(PIECES_PER_F64 * pad_to.max(partials.len()));
    for i in 0..pad_to.max(partials.len()) {
        let bits = partials.get(i).map_or(0, |p| p.to_bits());
        for piece in 0..PIECES_PER_F64 {
            out.push(((bits >> (16 * piece)) & 0xffff) as f32);
        }
    }
    out
}

/// The f64 values [`encode_partials`] wrote. A piece that is not an
/// integer in `0..=65535` is an error (a peer sent something else).
pub fn decode_partials(values: &[f32]) -> Result<Vec<f64>> {
    if values.len() % PIECES_PER_F64 != 0 {
        return Err(TrainError::Config(format!(
            "{} values cannot be norm partials ({PIECES_PER_F64} per partial)",
            values.len()
        )));
    }
    values
        .chunks(PIECES_PER_F64)
        .map(|p| {
            let mut bits = 0u64;
            for (piece, &x) in p.iter().enumerate() {
                if !(0.0..=65535.0).contains(&x) || x.fract() != 0.0 {
                    return Err(TrainError::Config(format!(
                        "a norm partial piece is {x}, expected an integer in 0..=65535"
                    )));
                }
                bits |= (x as u64) << (16 * piece);
            }
            Ok(f64::from_bits(bits))
        })
        .collect()
}

/// The global norm from the chunk sums in chunk order: added sequentially
/// from 0, then the square root, exactly as [`super::clip::global_norm`].
pub fn norm_from_chunk_sums(chunk_sums: &[f64]) -> f64 {
    let mut total = 0.0f64;
    for &p in chunk_sums {
        total += p;
    }
    total.sqrt()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::clip::{chunk_sums, global_norm};
    use proptest::prelude::*;

    #[test]
    fn shards_are_whole_chunks_with_the_remainder_first() {
        let s = OptimizerShards::new(5 * NORM_CHUNK + 7, 4).unwrap();
        let c = NORM_CHUNK;
        assert_eq!(
            s.ranges(),
            vec![0..2 * c, 2 * c..4 * c, 4 * c..5 * c, 5 * c..5 * c + 7]
        );
        // More ranks than chunks: the last ranks own nothing.
        let s = OptimizerShards::new(c + 1, 4).unwrap();
        assert_eq!(s.ranges(), vec![0..c, c..c + 1, c + 1..c + 1, c + 1..c + 1]);
        assert!(OptimizerShards::new(10, 0).is_err());
        let one = OptimizerShards::new(3 * c, 1).unwrap();
        assert_eq!(one.ranges(), vec![0..3 * c], "P = 1 is the whole arena");
    }

    proptest! {
        #[test]
        fn shards_tile_the_arena_on_chunk_boundaries(len in 0usize..(9 * NORM_CHUNK), parts in 1usize..=64) {
            let s = OptimizerShards::new(len, parts).unwrap();
            let mut next = 0;
            for r in s.ranges() {
                prop_assert_eq!(r.start, next);
                prop_assert!(r.start % NORM_CHUNK == 0 || r.start == len);
                prop_assert!(r.end % NORM_CHUNK == 0 || r.end == len);
                next = r.end;
            }
            prop_assert_eq!(next, len);
        }

        #[test]
        fn partials_survive_the_f32_exchange(xs in proptest::collection::vec(any::<u64>(), 0..20), pad in 0usize..25) {
            let v: Vec<f64> = xs.iter().map(|&b| f64::from_bits(b)).collect();
            let enc = encode_partials(&v, pad);
            let dec = decode_partials(&enc).unwrap();
            prop_assert_eq!(dec.len(), v.len().max(pad));
            for (a, b) in v.iter().zip(&dec) {
                prop_assert_eq!(a.to_bits(), b.to_bits());
            }
        }

        #[test]
        fn gathered_shard_partials_give_the_unsharded_norm_bits(
            len in 0usize..(6 * NORM_CHUNK), parts in 1usize..=9, seed in any::<u64>()
        ) {
            let mut r = crate::seed::Rng::new(seed);
            let g: Vec<f32> = (0..len).map(|_| (r.normal() * 1e2) as f32).collect();
            let s = OptimizerShards::new(len, parts).unwrap();
            let mut gathered = Vec::new();
            for k in 0..parts {
                gathered.extend(encode_partials(&chunk_sums(&g[s.range(k)]), s.max_chunks()));
            }
            let sums = s.chunk_sums_from_gathered(&gathered).unwrap();
            prop_assert_eq!(norm_from_chunk_sums(&sums).to_bits(), global_norm(&g).to_bits());
        }
    }

    #[test]
    fn a_bad_exchange_is_an_error() {
        assert!(decode_partials(&[1.0, 2.0, 3.0]).is_err());
        assert!(decode_partials(&[0.5, 0.0, 0.0, 0.0]).is_err());
        assert!(decode_partials(&[70000.0, 0.0, 0.0, 0.0]).is_err());
        let s = OptimizerShards::new(3 * NORM_CHUNK, 2).unwrap();
        assert!(s.chunk_sums_from_gathered(&[0.0; 3]).is_err());
    }

    /// Negative control: a boundary inside a norm chunk (each rank summing
    /// its own part of the chunk, the parts then added) changes the bits.
    #[test]
    fn a_shard_boundary_inside_a_chunk_changes_the_norm_bits() {
        let mut r = crate::seed::Rng::new(7);
        let g: Vec<f32> = (0..2 * NORM_CHUNK).map(|_| r.normal() as f32).collect();
        let want = global_norm(&g).to_bits();
        let moved = (1..64).any(|cut| {
            let cut = cut * 509;
            let a = chunk_sums(&g[..cut]);
            let b = chunk_sums(&g[cut..]);
            let mixed: Vec<f64> = a.into_iter().chain(b).collect();
            norm_from_chunk_sums(&mixed).to_bits() != want
        });
        assert!(
            moved,
            "element-granular shards must change some norm's bits"
        );
    }
}
