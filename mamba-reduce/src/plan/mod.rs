//! The fixed-order dataflow as data: a per-rank list of steps, each a group
//! of point-to-point messages followed by fold operations.
//!
//! One plan drives every executor: the step-by-step one over any
//! [`Transport`](mamba_comm::Transport) (host threads, loopback processes),
//! the two-stream one over NCCL (`device::run`), and the
//! [`EmulatedWorld`](crate::EmulatedWorld) oracle. That is how "the same
//! dataflow" is meant literally.
//!
//! # Executor contract
//!
//! The *sequential* meaning of a plan: step by step, a step's messages run
//! as one group that completes before the step's fold operations, which
//! complete before the next step's messages. Within one step a rank never
//! receives into a region it also sends from or receives into twice
//! ([`RankPlan::validate`] checks it), so the order in which a group's
//! messages are delivered cannot change a bit.
//!
//! The *two-lane* meaning, which the NCCL executor uses to overlap the fold
//! of one chunk with the transfer of the next: messages run on a comm lane
//! and fold operations on a compute lane, each lane in step order, and a
//! lane waits for the other only where the plan's regions conflict (a
//! write against a read or write of an overlapping element range of the
//! same buffer). [`lanes`] derives those waits from the plan
//! (`LaneDeps`); because every conflicting pair keeps its sequential
//! order, every two-lane schedule computes exactly what the sequential one
//! does. The emulated world checks it by running random two-lane schedules
//! ([`EmulateOptions::lanes`](crate::EmulateOptions)).
//!
//! # Three dataflows
//!
//! Two fixed-order ones, and the fixed tree's (**Tree**, `plan::tree`):
//! one block-sum arena per rank, the upper `log2 P` tree levels by
//! recursive halving, the root's shards gathered.
//!
//! **Sharded (`P = L`, one logical rank per process).** The arena is cut
//! into `C` chunks, each chunk into `P` contiguous shards in rank order
//! ([`ShardPlan`]). Step `t` sends every peer its shard of chunk `t` from
//! the local arena and receives every peer's copy of this rank's shard of
//! chunk `t` into a slot indexed by source rank (the *scatter*); its fold
//! writes `((g0 + g1) + ...) * fl(1/L)` over the shard, in place: one
//! `det_chain` whose addends are the slots in ascending source order with
//! the arena's own shard at this rank's position (no copy; ranks
//! `>= MAX_CHAIN_ADDENDS` copy their shard into a slot first). The reduced
//! shards of chunk `a` travel back in step `a + 2` (the *gather*; step
//! `a + 1` when there is one chunk), straight into the peers' arenas. The
//! lag of two steps is what lets the fold of chunk `t - 1` run during the
//! transfers of step `t`; the slots are double-buffered (chunk `a` in set
//! `a % 2`) for the same reason.
//!
//! **Pipeline (`L > P`, `B = L / P` logical ranks per process in
//! contiguous blocks).** A per-source partial sum would change the
//! association, so the running prefix travels instead. Chunk `a`: rank 0
//! folds its block in place at step `a`, `((g0 + g1) + ...) + g_{B-1}`, and
//! sends it to rank 1 at step `a + 1`. Rank `p >= 1` receives the prefix at
//! step `a + 2p - 1` into scratch set `a % 2` and continues the chain in one
//! `det_chain`: `g_{pB} + prefix` (IEEE addition commutes exactly, so this
//! is `prefix + g_{pB}`), then `+ g_{pB+1} + ...`; it forwards the prefix
//! two steps later (again so that its fold of the next chunk overlaps the
//! transfer). The last rank also multiplies by `fl(1/L)` (fused), and
//! relays the finished chunk `P-1 -> 0 -> 1 -> ... -> P-2`, one step per
//! hop. The per-element chain is exactly the one of `P = L`, so the result
//! is bit-identical for every `P` at fixed `L`.
//!
//! # Cost per reduction (`N` elements, `P` processes, `B = L/P`, `C` chunks)
//!
//! | | sharded (`B = 1`) | pipeline (`B > 1`) |
//! |---|---|---|
//! | bytes sent per rank | `2 (P-1)/P N` x 4 (a ring all-reduce's) | `2 N` x 4 (ranks `P-2`, `P-1`: `N` x 4) |
//! | steps | `C + 2` (`2` for `C = 1`) | `C + 3P - 3` (`C` for `P = 1`) |
//! | point-to-point groups | every step | at most `C + 3P - 4` (none for `P = 1`) |
//! | fold launches per rank | `C` (`det_chain`, scale fused) | `C` |
//! | fold HBM bytes per rank | `(P + 1) N/P` x 4 | rank 0: `(B + 1) N` x 4; others `(B + 2) N` x 4 |
//! | scratch per rank | `min(C, 2) (P-1)` slots of `~N/(CP)` | `min(C, 2)` chunks (ranks `> 0`) |
//!
//! See the crate docs for what this means in time on two H200s.

mod chunk;
pub(crate) mod lanes;
mod ops;
mod owners;
mod pipeline;
mod sharded;
mod tree;
mod validate;

use std::ops::Range;

use crate::contract::ReduceContract;
use crate::fold::{mean_factor, ChainTerm};
use crate::{ReduceError, Result};
use lanes::{lane_deps, LaneDeps};

pub use chunk::{GROUP_OVERHEAD_SEC, LINK_BYTES_PER_SEC};
pub(crate) use ops::{overlaps, BufId, CommOp, ComputeOp, Step};

/// Position limit of the arena's own shard in a sharded chain: the fold
/// kernel takes [`kernels::MAX_CHAIN_ADDENDS`] addends per launch and
/// continues longer chains from the output, so the output's own values must
/// be among the first that many. Ranks at or past it copy their shard into a
/// slot first.
pub(crate) const CHAIN_DST_LIMIT: usize = kernels::MAX_CHAIN_ADDENDS;

/// Which dataflow a plan uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dataflow {
    /// Fixed order, `P = L`: shards, slots, fold, reduced shards back.
    Sharded,
    /// Fixed order, `L > P`: running prefix carried rank to rank, result
    /// relayed.
    Pipeline,
    /// Fixed tree (any power-of-two `P` dividing `L`): one block-sum arena
    /// per rank, the upper `log2 P` tree levels by recursive halving, the
    /// root's shards gathered (`plan::tree`).
    Tree,
}

/// What one rank's reduction moves and launches.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanCost {
    /// Steps of the plan (with or without messages).
    pub steps: usize,
    /// Steps with at least one message (point-to-point groups).
    pub groups: usize,
    /// Messages sent.
    pub sends: usize,
    /// Bytes sent by this rank.
    pub bytes_sent: u64,
    /// Bytes received by this rank.
    pub bytes_received: u64,
    /// Fold kernel launches (`det_chain`; a chain of more than
    /// [`kernels::MAX_CHAIN_ADDENDS`] addends takes several).
    pub fold_launches: usize,
    /// Device-to-device copies.
    pub copies: usize,
    /// Separate scale launches (0: the scale is fused into the fold).
    pub scale_launches: usize,
    /// Bytes the fold operations read and write in device memory.
    pub fold_bytes: u64,
    /// Scratch memory this rank needs, in bytes.
    pub scratch_bytes: u64,
}

/// One rank's fixed-order reduction of `len`-element arenas: every message
/// and fold operation, in order, and the waits between the two lanes.
#[derive(Clone, Debug, PartialEq)]
pub struct RankPlan {
    rank: usize,
    world: usize,
    logical_world: usize,
    len: usize,
    chunk: usize,
    dataflow: Dataflow,
    scratch_len: usize,
    /// Where the reduction ends: `None`, on every rank (an all-reduce);
    /// `Some(owned)`, only `owned[k]` at rank `k` (a reduce-scatter; see
    /// [`RankPlan::ending_at_owners`]).
    owners: Option<Vec<Range<usize>>>,
    pub(crate) steps: Vec<Step>,
    pub(crate) lanes: Vec<LaneDeps>,
}

impl RankPlan {
    /// The plan of `rank` under `contract` ([`RankPlan::new`] for
    /// [`ReduceContract::FixedOrder`], [`RankPlan::tree`] for
    /// [`ReduceContract::FixedTree`]; [`ReduceContract::NcclSum`] has no
    /// plan: the library sums).
    pub fn for_contract(
        contract: ReduceContract,
        rank: usize,
        world: usize,
        logical_world: usize,
        len: usize,
        chunk_elems: Option<usize>,
    ) -> Result<Self> {
        Self::ending_at(contract, rank, world, logical_world, len, chunk_elems, None)
    }

    /// The fixed-tree plan of `rank` in a world of `world` processes
    /// reducing `logical_world` (a power of two that `world` divides)
    /// logical ranks whose block sums are `len`-element arenas: every rank
    /// passes one arena, its block's subtree sum. `chunk_elems` overrides
    /// the chunk length (`None`: one chunk, as sharded fixed-order plans).
    pub fn tree(
        rank: usize,
        world: usize,
        logical_world: usize,
        len: usize,
        chunk_elems: Option<usize>,
    ) -> Result<Self> {
        ReduceContract::FixedTree.check_logical_world(logical_world)?;
        Self::build(
            rank,
            world,
            logical_world,
            len,
            chunk_elems,
            Dataflow::Tree,
            CHAIN_DST_LIMIT,
            None,
        )
    }

    /// The fixed-order plan of `rank` in a world of `world` processes
    /// reducing `logical_world` arenas of `len` elements (`world` must divide
    /// `logical_world`). `chunk_elems` overrides the chunk length (`None`:
    /// [`RankPlan::default_chunk`]).
    pub fn new(
        rank: usize,
        world: usize,
        logical_world: usize,
        len: usize,
        chunk_elems: Option<usize>,
    ) -> Result<Self> {
        Self::with_dst_limit(
            rank,
            world,
            logical_world,
            len,
            chunk_elems,
            CHAIN_DST_LIMIT,
        )
    }

    /// [`RankPlan::new`] with another own-shard position limit (tests use a
    /// small one to exercise the copy fallback of large worlds).
    pub(crate) fn with_dst_limit(
        rank: usize,
        world: usize,
        logical_world: usize,
        len: usize,
        chunk_elems: Option<usize>,
        dst_limit: usize,
    ) -> Result<Self> {
        let dataflow = if logical_world == world {
            Dataflow::Sharded
        } else {
            Dataflow::Pipeline
        };
        Self::build(
            rank,
            world,
            logical_world,
            len,
            chunk_elems,
            dataflow,
            dst_limit,
            None,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn build(
        rank: usize,
        world: usize,
        logical_world: usize,
        len: usize,
        chunk_elems: Option<usize>,
        dataflow: Dataflow,
        dst_limit: usize,
        owners: Option<Vec<Range<usize>>>,
    ) -> Result<Self> {
        check_world(world, logical_world)?;
        if let Some(owned) = &owners {
            owners::check(owned, world, len)?;
        }
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
        // A tree plan is chunked like a sharded one (one chunk by default).
        let default_logical = match dataflow {
            Dataflow::Tree => world,
            _ => logical_world,
        };
        let chunk = chunk_elems
            .unwrap_or_else(|| Self::default_chunk(len, world, default_logical))
            .max(1);
        let mut plan = RankPlan {
            rank,
            world,
            logical_world,
            len,
            chunk,
            dataflow,
            scratch_len: 0,
            owners,
            steps: Vec::new(),
            lanes: Vec::new(),
        };
        match dataflow {
            Dataflow::Sharded => plan.build_sharded(dst_limit.max(1)),
            Dataflow::Pipeline => plan.build_pipeline(),
            Dataflow::Tree => plan.build_tree(),
        }
        plan.validate()?;
        plan.lanes = lane_deps(&plan.steps);
        Ok(plan)
    }

    /// The default chunk length for `len`-element arenas reduced by `world`
    /// processes over `logical_world` logical ranks: see the `chunk` module for the
    /// model (and the crate docs for the counts). Never changes bits.
    pub fn default_chunk(len: usize, world: usize, logical_world: usize) -> usize {
        chunk::default_chunk(len, world, logical_world)
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
    /// Logical ranks per process, `L / P`.
    pub fn blocks(&self) -> usize {
        self.logical_world / self.world
    }
    /// Arenas the caller passes: `L / P` for fixed-order plans (one per
    /// local logical rank), 1 for a tree plan (the block's subtree sum).
    pub fn local_arenas(&self) -> usize {
        match self.dataflow {
            Dataflow::Tree => 1,
            _ => self.blocks(),
        }
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
    /// Number of chunks.
    pub fn chunks(&self) -> usize {
        self.len.div_ceil(self.chunk)
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
            steps: self.steps.len(),
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
                    ComputeOp::Chain { terms, len, .. } => {
                        c.fold_launches += chain_launches(terms.len());
                        c.fold_bytes += 4 * (*len as u64) * (terms.len() as u64 + 1);
                    }
                    ComputeOp::Copy { len, .. } => {
                        c.copies += 1;
                        c.fold_bytes += 8 * *len as u64;
                    }
                }
            }
        }
        c
    }

    fn chunk_range(&self, a: usize) -> Range<usize> {
        let start = a * self.chunk;
        start..(start + self.chunk).min(self.len)
    }

    fn factor(&self) -> Option<f32> {
        (self.logical_world > 1).then(|| mean_factor(self.logical_world))
    }
}

/// Kernel launches of one chain of `n` addends: the first launch takes
/// [`kernels::MAX_CHAIN_ADDENDS`], every further one that many minus one
/// (it starts from the output).
pub(crate) fn chain_launches(n: usize) -> usize {
    let max = kernels::MAX_CHAIN_ADDENDS;
    if n <= max {
        1
    } else {
        1 + (n - max).div_ceil(max - 1)
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
mod tests;
