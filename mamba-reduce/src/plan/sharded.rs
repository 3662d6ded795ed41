//! The sharded dataflow (`P = L`): per chunk, every owner gets every
//! peer's copy of its shard in a slot indexed by source rank (the scatter),
//! folds ascending with its own shard in place at its rank's position, and
//! sends the reduced shard back (the gather). See the parent module docs.

use super::{BufId, ChainTerm, CommOp, ComputeOp, RankPlan, Step};
use crate::shard::ShardPlan;

impl RankPlan {
    pub(super) fn build_sharded(&mut self, dst_limit: usize) {
        let (p_world, rank) = (self.world, self.rank);
        let n_chunks = self.chunks();
        if p_world == 1 || n_chunks == 0 {
            // One process holding its one logical rank: the mean is the arena.
            return;
        }
        // Ranks whose own shard would sit past the kernel's first launch
        // copy it into slot `rank` and fold P slots instead of P-1 + itself.
        let copy_own = rank >= dst_limit;
        let n_slots = if copy_own { p_world } else { p_world - 1 };
        // Slot stride: the largest shard of the largest chunk, rounded up to
        // 4 elements so every slot row is 16-byte aligned (the kernel's
        // vector path).
        let largest = ShardPlan::of(self.chunk.min(self.len), p_world).max_shard_len();
        let stride = largest.next_multiple_of(4);
        let sets = n_chunks.min(2);
        let set_len = n_slots * stride;
        self.scratch_len = sets * set_len;
        let slot_of = |src: usize| {
            if copy_own || src < rank {
                src
            } else {
                src - 1
            }
        };
        let lag = n_chunks.min(2);
        let shards = |a: usize| ShardPlan::of(self.chunk_range(a).len(), p_world);
        let mut steps = vec![Step::default(); n_chunks + lag];
        for a in 0..n_chunks {
            let base = self.chunk_range(a).start;
            let plan = shards(a);
            let own = plan.range(rank);
            let set = (a % sets) * set_len;
            // Scatter of chunk a at step a: every peer's shard goes to its
            // owner; this rank's shard from every peer lands in its slot.
            let step = &mut steps[a];
            for peer in (0..p_world).filter(|&p| p != rank) {
                let theirs = plan.range(peer);
                if !theirs.is_empty() {
                    step.comm.push(CommOp::Send {
                        buf: BufId::Local(0),
                        range: base + theirs.start..base + theirs.end,
                        peer,
                    });
                }
                if !own.is_empty() {
                    let s = set + slot_of(peer) * stride;
                    step.comm.push(CommOp::Recv {
                        buf: BufId::Scratch,
                        range: s..s + own.len(),
                        peer,
                    });
                }
            }
            if !own.is_empty() {
                let off = base + own.start;
                if copy_own {
                    step.compute.push(ComputeOp::Copy {
                        src: BufId::Local(0),
                        src_off: off,
                        dst: BufId::Scratch,
                        dst_off: set + rank * stride,
                        len: own.len(),
                    });
                }
                let terms = (0..p_world)
                    .map(|src| {
                        if src == rank && !copy_own {
                            ChainTerm::Dst
                        } else {
                            ChainTerm::Buf(BufId::Scratch, set + slot_of(src) * stride)
                        }
                    })
                    .collect();
                step.compute.push(ComputeOp::Chain {
                    dst: BufId::Local(0),
                    dst_off: off,
                    terms,
                    len: own.len(),
                    factor: self.factor(),
                });
            }
            // Gather of chunk a at step a + lag: the reduced shards go back
            // to every rank, straight into the arenas.
            let step = &mut steps[a + lag];
            // (Under a reduce-scatter each message is cut to what its
            // receiver owns: `delivered`.)
            self.push_distribution(step, rank, p_world, base, own.clone(), |peer| {
                plan.range(peer)
            });
        }
        self.steps = steps;
    }
}
