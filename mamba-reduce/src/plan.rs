//! The fixed-order dataflow as data: a per-rank list of steps, each a group
//! of point-to-point messages followed by fold operations.
//!
//! One plan drives every executor: the live one over any
//! [`Transport`](mamba_comm::Transport) (host threads, loopback processes,
//! NCCL on device memory) and the [`EmulatedWorld`](crate::EmulatedWorld)
//! oracle. That is how "the same dataflow" is meant literally.
//!
//! Executor contract: a step's messages run as one group that is complete
//! before the step's fold operations start, and a step's fold operations
//! complete before the next step's messages start (both executors run
//! steps strictly in order; on a GPU everything is on the communicator's
//! stream and a group is complete when `Transport::group` returns). Within
//! one step a rank never receives into a region it also sends from or
//! receives into twice ([`RankPlan::validate`] checks it), so the order in
//! which a group's messages are delivered cannot change a bit.
//!
//! # Two dataflows
//!
//! **Sharded (`P = L`, one logical rank per process).** The arena is cut
//! into chunks (by default one chunk: the whole arena), each chunk into `P`
//! contiguous shards in rank order ([`ShardPlan`]). Step `t` sends every
//! peer its shard of chunk `t` from the local arena and receives every
//! peer's copy of this rank's shard into a slot indexed by source rank; the
//! fold then writes `((g0 + g1) + ...) * fl(1/L)` over the shard, in place
//! in the arena. Step `t` also carries chunk `t - 1`'s reduced shards back
//! (each owner sends its shard to every peer, straight into the peers'
//! arenas). Ranks 0 and 1 fold with `acc = own shard` and the `P - 1`
//! received slots in ascending source order: `g0 + g1 == g1 + g0` bit for bit
//! (IEEE addition is commutative), so the chain is still the ascending one
//! and no copy is needed. Ranks `r >= 2` copy their own shard into slot `r`
//! and fold all `P` slots.
//!
//! **Pipeline (`L > P`, `B = L / P` logical ranks per process in
//! contiguous blocks).** A per-source partial sum would change the
//! association, so the running prefix travels instead. Per chunk `a`: rank
//! 0 folds its block in place, `((g0 + g1) + ...) + g_{B-1}`, and sends it to
//! rank 1; rank `p` continues the chain with `prefix + g_{pB}` (commuted
//! into `g_{pB} + prefix`, again exact) and then `+ g_{pB+1} + ...`; the last
//! rank scales by `fl(1/L)`. The finished chunk is relayed `P-1 -> 0 -> 1 ->
//! ... -> P-2` into the arenas. Rank `p` works on chunk `t - p` in step `t`,
//! so all ranks are busy on different chunks once the pipeline is full, and
//! the relay shares the steps with the forward chain.
//!
//! # Cost per reduction (`N` elements, `P` processes, `B = L/P`, `C` chunks)
//!
//! | | sharded (`B = 1`) | pipeline (`B > 1`) |
//! |---|---|---|
//! | bytes sent per rank | `2 (P-1)/P N` x 4 (ring all-reduce's) | `2 N` x 4 (ranks `P-2`, `P-1`: `N` x 4) |
//! | groups | `C + 1` | `C + 2P - 3` (`P >= 2`) |
//! | fold launches per rank | `C` (+`C` copies on ranks `>= 2`) | `C (B - 1 + [p > 0])` |
//! | scale launches per rank | `C` | `C` on rank `P-1` |
//! | scratch per rank | `n_slots * stride`, `~ (P-1)/P` chunk | one chunk (ranks `> 0`) |
//!
//! With one chunk (the default for the sharded dataflow) a `P = 2`
//! reduction is exactly two groups, one fold and one scale launch.

use std::ops::Range;

use crate::fold::mean_factor;
use crate::shard::ShardPlan;
use crate::{ReduceError, Result};

/// Which buffer an operation names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BufId {
    /// The caller's `j`-th local arena (logical rank `rank * B + j`).
    Local(usize),
    /// The reducer's scratch buffer (slots, or the incoming prefix).
    Scratch,
}

/// One point-to-point message, in elements.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum CommOp {
    Send {
        buf: BufId,
        range: Range<usize>,
        peer: usize,
    },
    Recv {
        buf: BufId,
        range: Range<usize>,
        peer: usize,
    },
}

/// One fold operation (see [`FoldOps`](crate::FoldOps) for the semantics).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum ComputeOp {
    Sum {
        slots: BufId,
        slots_off: usize,
        n_slots: usize,
        stride: usize,
        len: usize,
        out: BufId,
        out_off: usize,
    },
    Accumulate {
        acc: BufId,
        acc_off: usize,
        slots: BufId,
        slots_off: usize,
        n_slots: usize,
        stride: usize,
        len: usize,
    },
    Copy {
        src: BufId,
        src_off: usize,
        dst: BufId,
        dst_off: usize,
        len: usize,
    },
    Scale {
        buf: BufId,
        off: usize,
        len: usize,
        factor: f32,
    },
}

/// A group of messages, then fold operations.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct Step {
    pub(crate) comm: Vec<CommOp>,
    pub(crate) compute: Vec<ComputeOp>,
}

/// Which of the two dataflows a plan uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dataflow {
    /// `P = L`: shards, slots, fold, reduced shards back.
    Sharded,
    /// `L > P`: running prefix carried rank to rank, result relayed.
    Pipeline,
}

/// Default chunk for the pipeline: 16 chunks, but none below 256 Ki
/// elements (1 MiB), where a group's fixed cost would dominate.
const PIPELINE_MIN_CHUNK: usize = 1 << 18;
const PIPELINE_CHUNKS: usize = 16;

/// What one rank's reduction moves and launches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanCost {
    /// Steps with at least one message (point-to-point groups).
    pub groups: usize,
    /// Messages sent.
    pub sends: usize,
    /// Bytes sent by this rank.
    pub bytes_sent: u64,
    /// Bytes received by this rank.
    pub bytes_received: u64,
    /// Fold launches (`sum_slots` and `accumulate`).
    pub fold_launches: usize,
    /// Device-to-device copies.
    pub copies: usize,
    /// Scale launches.
    pub scale_launches: usize,
    /// Scratch memory this rank needs, in bytes.
    pub scratch_bytes: u64,
}

/// One rank's fixed-order reduction of `len`-element arenas: every message
/// and fold operation, in order.
#[derive(Clone, Debug, PartialEq)]
pub struct RankPlan {
    rank: usize,
    world: usize,
    logical_world: usize,
    len: usize,
    chunk: usize,
    dataflow: Dataflow,
    scratch_len: usize,
    pub(crate) steps: Vec<Step>,
}

impl RankPlan {
    /// The plan of `rank` in a world of `world` processes reducing
    /// `logical_world` arenas of `len` elements (`world` must divide
    /// `logical_world`). `chunk_elems` overrides the chunk size (`None`:
    /// the whole arena for the sharded dataflow, [`RankPlan::default_chunk`]
    /// for the pipeline).
    pub fn new(
        rank: usize,
        world: usize,
        logical_world: usize,
        len: usize,
        chunk_elems: Option<usize>,
    ) -> Result<Self> {
        check_world(world, logical_world)?;
        if rank >= world {
            return Err(ReduceError::config(format!(
                "rank {rank} is outside a world of {world} ranks"
            )));
        }
        if chunk_elems == Some(0) {
            return Err(ReduceError::config(
                "chunk_elems must be at least 1 element",
            ));
        }
        let dataflow = if logical_world == world {
            Dataflow::Sharded
        } else {
            Dataflow::Pipeline
        };
        let chunk = match (chunk_elems, dataflow) {
            (Some(c), _) => c,
            (None, Dataflow::Sharded) => len.max(1),
            (None, Dataflow::Pipeline) => Self::default_chunk(len),
        };
        let mut plan = RankPlan {
            rank,
            world,
            logical_world,
            len,
            chunk,
            dataflow,
            scratch_len: 0,
            steps: Vec::new(),
        };
        match dataflow {
            Dataflow::Sharded => plan.build_sharded(),
            Dataflow::Pipeline => plan.build_pipeline(),
        }
        plan.validate()?;
        Ok(plan)
    }

    /// The pipeline's default chunk for a `len`-element arena.
    pub fn default_chunk(len: usize) -> usize {
        len.div_ceil(PIPELINE_CHUNKS).max(PIPELINE_MIN_CHUNK)
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }
    /// Number of processes.
    pub fn world(&self) -> usize {
        self.world
    }
    /// Number of logical ranks `L`.
    pub fn logical_world(&self) -> usize {
        self.logical_world
    }
    /// Local arenas per process, `L / P`.
    pub fn blocks(&self) -> usize {
        self.logical_world / self.world
    }
    /// Arena length in elements.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the arena is empty (the plan then does nothing).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Chunk length in elements.
    pub fn chunk(&self) -> usize {
        self.chunk
    }
    /// Which dataflow the plan uses.
    pub fn dataflow(&self) -> Dataflow {
        self.dataflow
    }
    /// Scratch elements the executor must provide.
    pub fn scratch_len(&self) -> usize {
        self.scratch_len
    }

    /// Bytes, messages and launches of this rank's reduction.
    pub fn cost(&self) -> PlanCost {
        let mut c = PlanCost {
            scratch_bytes: 4 * self.scratch_len as u64,
            ..PlanCost::default()
        };
        for step in &self.steps {
            if !step.comm.is_empty() {
                c.groups += 1;
            }
            for op in &step.comm {
                match op {
                    CommOp::Send { range, .. } => {
                        c.sends += 1;
                        c.bytes_sent += 4 * range.len() as u64;
                    }
                    CommOp::Recv { range, .. } => c.bytes_received += 4 * range.len() as u64,
                }
            }
            for op in &step.compute {
                match op {
                    ComputeOp::Sum { .. } | ComputeOp::Accumulate { .. } => c.fold_launches += 1,
                    ComputeOp::Copy { .. } => c.copies += 1,
                    ComputeOp::Scale { .. } => c.scale_launches += 1,
                }
            }
        }
        c
    }

    fn chunk_range(&self, a: usize) -> Range<usize> {
        let start = a * self.chunk;
        start..(start + self.chunk).min(self.len)
    }

    fn n_chunks(&self) -> usize {
        self.len.div_ceil(self.chunk)
    }

    fn scale_op(&self, off: usize, len: usize) -> Option<ComputeOp> {
        (self.logical_world > 1 && len > 0).then(|| ComputeOp::Scale {
            buf: BufId::Local(0),
            off,
            len,
            factor: mean_factor(self.logical_world),
        })
    }

    fn build_sharded(&mut self) {
        let (p_world, rank) = (self.world, self.rank);
        let n_chunks = self.n_chunks();
        if p_world == 1 || n_chunks == 0 {
            // One process holding its one logical rank: the mean is the arena.
            return;
        }
        let commute = rank <= 1;
        let n_slots = if commute { p_world - 1 } else { p_world };
        // Slot stride: the largest shard of the largest chunk, rounded up to
        // 4 elements so every slot row is 16-byte aligned (the kernel's
        // vector path).
        let largest = ShardPlan::of(self.chunk.min(self.len), p_world).max_shard_len();
        let stride = largest.div_ceil(4) * 4;
        self.scratch_len = n_slots * stride;
        let slot_of = |src: usize| if commute && src > rank { src - 1 } else { src };
        let shards = |a: usize| ShardPlan::of(self.chunk_range(a).len(), p_world);
        let mut steps = Vec::with_capacity(n_chunks + 1);
        for t in 0..=n_chunks {
            let mut step = Step::default();
            if t < n_chunks {
                // Scatter: every peer's shard of chunk t goes to its owner;
                // this rank's shard from every peer lands in its slot.
                let base = self.chunk_range(t).start;
                let plan = shards(t);
                let own = plan.range(rank);
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
                        let s = slot_of(peer) * stride;
                        step.comm.push(CommOp::Recv {
                            buf: BufId::Scratch,
                            range: s..s + own.len(),
                            peer,
                        });
                    }
                }
                if !own.is_empty() {
                    let off = base + own.start;
                    if commute {
                        step.compute.push(ComputeOp::Accumulate {
                            acc: BufId::Local(0),
                            acc_off: off,
                            slots: BufId::Scratch,
                            slots_off: 0,
                            n_slots,
                            stride,
                            len: own.len(),
                        });
                    } else {
                        step.compute.push(ComputeOp::Copy {
                            src: BufId::Local(0),
                            src_off: off,
                            dst: BufId::Scratch,
                            dst_off: rank * stride,
                            len: own.len(),
                        });
                        step.compute.push(ComputeOp::Sum {
                            slots: BufId::Scratch,
                            slots_off: 0,
                            n_slots,
                            stride,
                            len: own.len(),
                            out: BufId::Local(0),
                            out_off: off,
                        });
                    }
                    step.compute.extend(self.scale_op(off, own.len()));
                }
            }
            if t >= 1 {
                // Gather: chunk t-1's reduced shards go back to every rank.
                let base = self.chunk_range(t - 1).start;
                let plan = shards(t - 1);
                let own = plan.range(rank);
                for peer in (0..p_world).filter(|&p| p != rank) {
                    if !own.is_empty() {
                        step.comm.push(CommOp::Send {
                            buf: BufId::Local(0),
                            range: base + own.start..base + own.end,
                            peer,
                        });
                    }
                    let theirs = plan.range(peer);
                    if !theirs.is_empty() {
                        step.comm.push(CommOp::Recv {
                            buf: BufId::Local(0),
                            range: base + theirs.start..base + theirs.end,
                            peer,
                        });
                    }
                }
            }
            steps.push(step);
        }
        self.steps = steps;
    }

    fn build_pipeline(&mut self) {
        let (p_world, rank, blocks) = (self.world, self.rank, self.blocks());
        let n_chunks = self.n_chunks();
        if n_chunks == 0 {
            return;
        }
        if rank > 0 {
            self.scratch_len = self.chunk.min(self.len);
        }
        let n_steps = if p_world == 1 {
            n_chunks
        } else {
            n_chunks + 2 * p_world - 2
        };
        // Chunk index `t - d` if it exists.
        let at = |t: usize, d: usize| t.checked_sub(d).filter(|&a| a < n_chunks);
        let mut steps = Vec::with_capacity(n_steps);
        for t in 0..n_steps {
            let mut step = Step::default();
            if p_world > 1 {
                // Forward chain: the prefix of chunk t-rank arrives from the
                // left; the prefix finished last step leaves to the right.
                if rank > 0 {
                    if let Some(a) = at(t, rank) {
                        let n = self.chunk_range(a).len();
                        step.comm.push(CommOp::Recv {
                            buf: BufId::Scratch,
                            range: 0..n,
                            peer: rank - 1,
                        });
                    }
                }
                if rank < p_world - 1 {
                    if let Some(a) = at(t, rank + 1) {
                        step.comm.push(CommOp::Send {
                            buf: BufId::Local(0),
                            range: self.chunk_range(a),
                            peer: rank + 1,
                        });
                    }
                }
                // Relay of finished chunks: P-1 -> 0 -> 1 -> ... -> P-2.
                if rank == p_world - 1 {
                    if let Some(a) = at(t, p_world) {
                        step.comm.push(CommOp::Send {
                            buf: BufId::Local(0),
                            range: self.chunk_range(a),
                            peer: 0,
                        });
                    }
                } else {
                    if let Some(a) = at(t, p_world + rank) {
                        let from = if rank == 0 { p_world - 1 } else { rank - 1 };
                        step.comm.push(CommOp::Recv {
                            buf: BufId::Local(0),
                            range: self.chunk_range(a),
                            peer: from,
                        });
                    }
                    if rank + 2 < p_world {
                        if let Some(a) = at(t, p_world + rank + 1) {
                            step.comm.push(CommOp::Send {
                                buf: BufId::Local(0),
                                range: self.chunk_range(a),
                                peer: rank + 1,
                            });
                        }
                    }
                }
            }
            if let Some(a) = at(t, rank) {
                let r = self.chunk_range(a);
                let n = r.len();
                if rank > 0 {
                    // prefix + g_{rank*B}, computed as g_{rank*B} + prefix.
                    step.compute.push(ComputeOp::Accumulate {
                        acc: BufId::Local(0),
                        acc_off: r.start,
                        slots: BufId::Scratch,
                        slots_off: 0,
                        n_slots: 1,
                        stride: n,
                        len: n,
                    });
                }
                for j in 1..blocks {
                    step.compute.push(ComputeOp::Accumulate {
                        acc: BufId::Local(0),
                        acc_off: r.start,
                        slots: BufId::Local(j),
                        slots_off: r.start,
                        n_slots: 1,
                        stride: n,
                        len: n,
                    });
                }
                if rank == p_world - 1 {
                    step.compute.extend(self.scale_op(r.start, n));
                }
            }
            steps.push(step);
        }
        self.steps = steps;
    }

    /// Check the plan's own invariants: every range inside its buffer, no
    /// message to self, and within a step no received region overlapping
    /// another received or a sent region of the same buffer (so delivery
    /// order cannot matter), and no fold operation whose output aliases its
    /// input buffer.
    pub fn validate(&self) -> Result<()> {
        let bad = |step: usize, what: String| {
            Err(ReduceError::invariant(format!(
                "rank {} step {step}: {what}",
                self.rank
            )))
        };
        let size = |b: BufId| match b {
            BufId::Local(j) if j < self.blocks() => Some(self.len),
            BufId::Local(_) => None,
            BufId::Scratch => Some(self.scratch_len),
        };
        let within =
            |b: BufId, r: &Range<usize>| size(b).is_some_and(|n| r.start <= r.end && r.end <= n);
        for (t, step) in self.steps.iter().enumerate() {
            let mut recvs: Vec<(BufId, Range<usize>)> = Vec::new();
            let mut sends: Vec<(BufId, Range<usize>)> = Vec::new();
            for op in &step.comm {
                let (buf, range, peer, list) = match op {
                    CommOp::Send { buf, range, peer } => (*buf, range, *peer, &mut sends),
                    CommOp::Recv { buf, range, peer } => (*buf, range, *peer, &mut recvs),
                };
                if peer == self.rank || peer >= self.world {
                    return bad(t, format!("message with peer {peer}"));
                }
                if !within(buf, range) || range.is_empty() {
                    return bad(t, format!("message range {range:?} invalid in {buf:?}"));
                }
                list.push((buf, range.clone()));
            }
            let overlap = |a: &Range<usize>, b: &Range<usize>| a.start < b.end && b.start < a.end;
            for (i, (b, r)) in recvs.iter().enumerate() {
                let clash = recvs[i + 1..].iter().chain(sends.iter());
                if clash.clone().any(|(b2, r2)| b2 == b && overlap(r, r2)) {
                    return bad(
                        t,
                        format!("received region {b:?} {r:?} overlaps another message"),
                    );
                }
            }
            for op in &step.compute {
                let ok = match op {
                    ComputeOp::Sum {
                        slots,
                        slots_off,
                        n_slots,
                        stride,
                        len,
                        out,
                        out_off,
                    } => {
                        *n_slots >= 1
                            && slots != out
                            && within(
                                *slots,
                                &(*slots_off..slots_off + (n_slots - 1) * stride + len),
                            )
                            && within(*out, &(*out_off..out_off + len))
                    }
                    ComputeOp::Accumulate {
                        acc,
                        acc_off,
                        slots,
                        slots_off,
                        n_slots,
                        stride,
                        len,
                    } => {
                        slots != acc
                            && (*n_slots == 0
                                || within(
                                    *slots,
                                    &(*slots_off..slots_off + (n_slots - 1) * stride + len),
                                ))
                            && within(*acc, &(*acc_off..acc_off + len))
                    }
                    ComputeOp::Copy {
                        src,
                        src_off,
                        dst,
                        dst_off,
                        len,
                    } => {
                        src != dst
                            && within(*src, &(*src_off..src_off + len))
                            && within(*dst, &(*dst_off..dst_off + len))
                    }
                    ComputeOp::Scale { buf, off, len, .. } => within(*buf, &(*off..off + len)),
                };
                if !ok {
                    return bad(
                        t,
                        format!("fold operation out of bounds or aliased: {op:?}"),
                    );
                }
            }
        }
        Ok(())
    }
}

/// `world >= 1`, `logical_world >= 1`, `world` divides `logical_world`.
pub(crate) fn check_world(world: usize, logical_world: usize) -> Result<()> {
    if world == 0 || logical_world == 0 {
        return Err(ReduceError::config(format!(
            "world ({world}) and logical world ({logical_world}) must both be at least 1"
        )));
    }
    if logical_world % world != 0 {
        return Err(ReduceError::config(format!(
            "logical world {logical_world} is not a multiple of the physical world {world}; \
             choose a logical world that every physical world size you use divides \
             (e.g. 8 for 1, 2, 4 or 8 processes)"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn two_ranks_one_chunk_is_two_groups_one_fold_one_scale() {
        for rank in 0..2 {
            let p = RankPlan::new(rank, 2, 2, 1 << 20, None).unwrap();
            let c = p.cost();
            assert_eq!(p.dataflow(), Dataflow::Sharded);
            assert_eq!(
                (c.groups, c.fold_launches, c.scale_launches, c.copies),
                (2, 1, 1, 0)
            );
            // Half the arena out in each phase: one all-reduce's bytes.
            assert_eq!(c.bytes_sent, 4 << 20);
            assert_eq!(c.bytes_received, 4 << 20);
            assert_eq!(c.scratch_bytes, 2 << 20);
        }
    }

    #[test]
    fn sharded_bytes_match_ring_all_reduce() {
        let (world, len) = (8, 8 * 1000);
        for rank in 0..world {
            let c = RankPlan::new(rank, world, world, len, None).unwrap().cost();
            assert_eq!(c.bytes_sent, 4 * 2 * 7 * 1000);
            assert_eq!(c.copies, usize::from(rank >= 2));
        }
    }

    #[test]
    fn pipeline_bytes_are_near_one_all_reduce() {
        let len = 1 << 20;
        for rank in 0..2 {
            let p = RankPlan::new(rank, 2, 4, len, Some(len / 16)).unwrap();
            assert_eq!(p.dataflow(), Dataflow::Pipeline);
            let c = p.cost();
            assert_eq!(c.bytes_sent, 4 * len as u64);
            assert_eq!(c.groups, 16 + 2 * 2 - 3);
            assert_eq!(c.fold_launches, 16 * (1 + usize::from(rank > 0)));
        }
    }

    #[test]
    fn pipeline_sends_at_most_twice_the_arena() {
        let len = 1000;
        let sent: Vec<u64> = (0..4)
            .map(|r| {
                RankPlan::new(r, 4, 8, len, Some(64))
                    .unwrap()
                    .cost()
                    .bytes_sent
            })
            .collect();
        assert_eq!(
            sent,
            vec![
                8 * len as u64,
                8 * len as u64,
                4 * len as u64,
                4 * len as u64
            ]
        );
        let got: Vec<u64> = (0..4)
            .map(|r| {
                RankPlan::new(r, 4, 8, len, Some(64))
                    .unwrap()
                    .cost()
                    .bytes_received
            })
            .collect();
        assert_eq!(
            got,
            vec![
                4 * len as u64,
                8 * len as u64,
                8 * len as u64,
                4 * len as u64
            ]
        );
    }

    #[test]
    fn bad_worlds_are_config_errors() {
        assert!(RankPlan::new(0, 3, 4, 10, None)
            .unwrap_err()
            .to_string()
            .contains("not a multiple"));
        assert!(RankPlan::new(2, 2, 2, 10, None).is_err());
        assert!(RankPlan::new(0, 2, 2, 10, Some(0)).is_err());
        assert!(RankPlan::new(0, 0, 2, 10, None).is_err());
    }

    proptest! {
        #[test]
        fn every_plan_validates_and_messages_pair_up(
            world in 1usize..=8,
            blocks in 1usize..=3,
            len in 0usize..300,
            chunk in proptest::option::of(1usize..64),
        ) {
            let l = world * blocks;
            let plans: Vec<RankPlan> =
                (0..world).map(|r| RankPlan::new(r, world, l, len, chunk).unwrap()).collect();
            let steps = plans.iter().map(|p| p.steps.len()).max().unwrap_or(0);
            for t in 0..steps {
                for a in 0..world {
                    for b in 0..world {
                        let sent: Vec<usize> = plans[a].steps.get(t).map_or(vec![], |s| s.comm.iter().filter_map(|op| match op {
                            CommOp::Send { range, peer, .. } if *peer == b => Some(range.len()),
                            _ => None,
                        }).collect());
                        let got: Vec<usize> = plans[b].steps.get(t).map_or(vec![], |s| s.comm.iter().filter_map(|op| match op {
                            CommOp::Recv { range, peer, .. } if *peer == a => Some(range.len()),
                            _ => None,
                        }).collect());
                        prop_assert_eq!(sent, got, "step {} {} -> {}", t, a, b);
                    }
                }
            }
        }
    }
}
