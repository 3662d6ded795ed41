//! The oracle: one process holds all `L` arenas and runs every rank's plan
//! of the fixed-order or fixed-tree dataflow, delivering messages in an
//! order of its choosing.
//!
//! (One file, ~480 lines before its tests: the world, its delivery orders
//! and its lane schedules are one interpreter loop over shared state.)
//!
//! Over 450 lines: the oracle runs every contract's plans (fixed-order and,
//! since this round, fixed-tree) over one in-memory delivery machine whose
//! state all of them share; a per-contract split would duplicate it.

use std::collections::VecDeque;
use std::ops::Range;

use crate::contract::ReduceContract;
use crate::exec::apply;
use crate::fold::{FoldOps, HostFold};
use crate::plan::{BufId, CommOp, RankPlan};
use crate::tree::TreeAccumulator;
use crate::{ReduceError, Result};

/// In which order the emulated world delivers the messages of one group.
/// The dataflow never receives into a region twice or into a region it
/// sends from in the same group, so every order must give the same bits;
/// tests use the orders to check it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Delivery {
    /// Rank order of the receivers, then issue order.
    #[default]
    InOrder,
    /// The reverse of [`Delivery::InOrder`].
    Reversed,
    /// A pseudo-random permutation per group, from this seed.
    Shuffled(u64),
}

/// How the emulated world runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EmulateOptions {
    /// Chunk size override (as `ReducerOptions::chunk_elems`).
    pub chunk_elems: Option<usize>,
    /// Message delivery order.
    pub delivery: Delivery,
    /// `None`: run the plans step by step (the sequential meaning).
    /// `Some(seed)`: run every rank as two lanes, groups on one and folds
    /// on the other, in a pseudo-random interleaving from `seed` that only
    /// keeps the waits the plan's lane dependencies prescribe — what the
    /// NCCL executor's two streams may do. Every seed must give the bits
    /// of the sequential run.
    pub lanes: Option<u64>,
    /// Which dataflow to run: [`ReduceContract::FixedOrder`] (default) or
    /// [`ReduceContract::FixedTree`] (each emulated process first folds its
    /// block with a [`TreeAccumulator`], as a live process does, then runs
    /// the tree plan). `NcclSum` has no plan and is refused.
    pub contract: ReduceContract,
}

/// One process playing a whole world: `L` logical arenas, spread over any
/// physical world `P` that divides `L`, reduced by the same per-rank plans
/// the live reducers run, with messages delivered in a chosen order.
///
/// It is the oracle every live world is asserted against: its result is
/// checked to be identical on every emulated rank, and the tests check it
/// equals [`host_mean`](crate::host_mean) (fixed order) or
/// [`host_tree_mean`](crate::host_tree_mean) (fixed tree) of the arenas for
/// every `P`, chunking and delivery order.
#[derive(Clone, Debug)]
pub struct EmulatedWorld {
    arenas: Vec<Vec<f32>>,
}

impl EmulatedWorld {
    /// A world of `arenas.len() = L >= 1` logical ranks; every arena must
    /// have the same length.
    pub fn new(arenas: Vec<Vec<f32>>) -> Result<Self> {
        let Some(first) = arenas.first() else {
            return Err(ReduceError::config(
                "an emulated world needs at least one arena",
            ));
        };
        let len = first.len();
        if let Some((k, a)) = arenas.iter().enumerate().find(|(_, a)| a.len() != len) {
            return Err(ReduceError::config(format!(
                "arena {k} has {} elements, expected {len} like arena 0",
                a.len()
            )));
        }
        Ok(EmulatedWorld { arenas })
    }

    /// `L`.
    pub fn logical_world(&self) -> usize {
        self.arenas.len()
    }

    /// Elements per arena.
    pub fn len(&self) -> usize {
        self.arenas[0].len()
    }

    /// Whether the arenas are empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The logical arenas.
    pub fn arenas(&self) -> &[Vec<f32>] {
        &self.arenas
    }

    /// Run the reduction of `opts.contract` on `world` emulated processes
    /// (each holding its contiguous block of `L / world` arenas) and return
    /// the mean, after checking every emulated rank ended with the same
    /// bits.
    pub fn reduce_mean(&self, world: usize, opts: &EmulateOptions) -> Result<Vec<f32>> {
        let per_rank = self.reduce_mean_per_rank(world, opts)?;
        let first = &per_rank[0];
        for (r, v) in per_rank.iter().enumerate().skip(1) {
            if let Some(i) = (0..v.len()).find(|&i| v[i].to_bits() != first[i].to_bits()) {
                return Err(ReduceError::invariant(format!(
                    "emulated rank {r} ends with {:e} at element {i}, rank 0 with {:e}",
                    v[i], first[i]
                )));
            }
        }
        Ok(per_rank.into_iter().next().unwrap_or_default())
    }

    /// As [`EmulatedWorld::reduce_mean`], returning every emulated rank's
    /// `locals[0]` without comparing them.
    pub fn reduce_mean_per_rank(
        &self,
        world: usize,
        opts: &EmulateOptions,
    ) -> Result<Vec<Vec<f32>>> {
        self.reduce_mean_per_rank_on(world, opts, &mut HostFold)
    }

    /// The same emulation with every arena, slot and message in `mem`'s
    /// memory and its fold arithmetic: with device memory and the fold
    /// kernels this is the single-GPU loopback harness (all ranks on one
    /// device, messages as device copies), which pins the kernels to the
    /// host fold through the whole dataflow.
    pub fn reduce_mean_per_rank_on<B, M: EmulatorMemory<B>>(
        &self,
        world: usize,
        opts: &EmulateOptions,
        mem: &mut M,
    ) -> Result<Vec<Vec<f32>>> {
        self.run_on(world, opts, None, mem)
    }

    /// The reduce-scatter plans ([`RankPlan::ending_at_owners`]) on
    /// `world` emulated processes: every emulated rank's `locals[0]`, of
    /// which only `owned[rank]` is specified (the mean there; the rest is
    /// whatever the plan left).
    pub fn reduce_scatter_per_rank(
        &self,
        world: usize,
        opts: &EmulateOptions,
        owned: &[Range<usize>],
    ) -> Result<Vec<Vec<f32>>> {
        self.reduce_scatter_per_rank_on(world, opts, owned, &mut HostFold)
    }

    /// [`EmulatedWorld::reduce_scatter_per_rank`] in `mem`'s memory with
    /// its fold arithmetic (the single-GPU loopback harness, as
    /// [`EmulatedWorld::reduce_mean_per_rank_on`]).
    pub fn reduce_scatter_per_rank_on<B, M: EmulatorMemory<B>>(
        &self,
        world: usize,
        opts: &EmulateOptions,
        owned: &[Range<usize>],
        mem: &mut M,
    ) -> Result<Vec<Vec<f32>>> {
        self.run_on(world, opts, Some(owned), mem)
    }

    fn run_on<B, M: EmulatorMemory<B>>(
        &self,
        world: usize,
        opts: &EmulateOptions,
        owned: Option<&[Range<usize>]>,
        mem: &mut M,
    ) -> Result<Vec<Vec<f32>>> {
        let logical = self.logical_world();
        let len = self.len();
        let plans = (0..world)
            .map(|r| {
                RankPlan::ending_at(
                    opts.contract,
                    r,
                    world,
                    logical,
                    len,
                    opts.chunk_elems,
                    owned,
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let blocks = logical / world;
        let mut ranks: Vec<RankState<B>> = Vec::with_capacity(world);
        for (r, p) in plans.iter().enumerate() {
            let block = &self.arenas[r * blocks..(r + 1) * blocks];
            let locals = if opts.contract == ReduceContract::FixedTree {
                let mut acc = TreeAccumulator::new(blocks, len)?;
                for a in block {
                    let leaf = mem.load(a)?;
                    acc.push(mem, leaf)?;
                }
                vec![acc.finish()?]
            } else {
                block
                    .iter()
                    .map(|a| mem.load(a))
                    .collect::<Result<Vec<B>>>()?
            };
            // At least one element: some memories cannot hold empty buffers.
            let scratch = mem.load(&vec![f32::NAN; p.scratch_len().max(1)])?;
            ranks.push(RankState { locals, scratch });
        }
        let mut rng = match opts.delivery {
            Delivery::Shuffled(seed) => Some(SplitMix64(seed)),
            _ => None,
        };
        match opts.lanes {
            None => {
                let n_steps = plans.iter().map(|p| p.steps.len()).max().unwrap_or(0);
                for t in 0..n_steps {
                    deliver(&plans, &mut ranks, mem, t, opts.delivery, &mut rng)?;
                    for (plan, state) in plans.iter().zip(ranks.iter_mut()) {
                        if let Some(step) = plan.steps.get(t) {
                            for op in &step.compute {
                                apply(mem, op, &mut state.locals, &mut state.scratch)?;
                            }
                        }
                    }
                }
            }
            Some(seed) => run_lanes(&plans, &mut ranks, mem, opts.delivery, &mut rng, seed, true)?,
        }
        mem.finish()?;
        ranks
            .iter()
            .map(|s| s.locals.first().map_or(Ok(Vec::new()), |b| mem.store(b)))
            .collect()
    }
}

/// Deliver step `t`'s messages of every rank in the chosen order.
fn deliver<B, M: EmulatorMemory<B>>(
    plans: &[RankPlan],
    ranks: &mut [RankState<B>],
    mem: &mut M,
    t: usize,
    delivery: Delivery,
    rng: &mut Option<SplitMix64>,
) -> Result<()> {
    let mut deliveries = match_messages(plans, t)?;
    match delivery {
        Delivery::InOrder => {}
        Delivery::Reversed => deliveries.reverse(),
        Delivery::Shuffled(_) => {
            if let Some(rng) = rng.as_mut() {
                for i in (1..deliveries.len()).rev() {
                    let j = (rng.next() % (i as u64 + 1)) as usize;
                    deliveries.swap(i, j);
                }
            }
        }
    }
    // Direct copies are as good as snapshots taken before the group:
    // validated plans never receive into a region that is sent from (or
    // received into twice) in the same step.
    for d in deliveries {
        let (src_state, dst_state) = two_ranks(ranks, d.from, d.to)?;
        let src = match d.src_buf {
            BufId::Scratch => &src_state.scratch,
            BufId::Local(j) => &src_state.locals[j],
        };
        let dst = match d.dst_buf {
            BufId::Scratch => &mut dst_state.scratch,
            BufId::Local(j) => &mut dst_state.locals[j],
        };
        mem.copy(src, d.src_start, dst, d.dst_start, d.len)?;
    }
    Ok(())
}

/// The steps of `plan` that have messages (`comm`) or fold operations.
fn lane_steps(plan: &RankPlan, comm: bool) -> Vec<usize> {
    (0..plan.steps.len())
        .filter(|&t| {
            let s = &plan.steps[t];
            if comm {
                !s.comm.is_empty()
            } else {
                !s.compute.is_empty()
            }
        })
        .collect()
}

/// Whether a lane that has finished its steps up to `done` has passed the
/// step `dep` another lane waits for.
fn passed(dep: Option<usize>, done: Option<usize>) -> bool {
    dep.is_none_or(|d| done.is_some_and(|x| x >= d))
}

/// Run every rank as a comm lane and a compute lane (see
/// [`EmulateOptions::lanes`]): at each point pick, pseudo-randomly from
/// `seed`, one runnable action — a whole group of some step (all its ranks'
/// comm lanes have reached it and may start it) or one rank's fold
/// operations of its next step. With `respect_deps` false the lanes ignore
/// the plan's waits (a negative control: the tests show that then the bits
/// change, so the waits are what keeps them).
fn run_lanes<B, M: EmulatorMemory<B>>(
    plans: &[RankPlan],
    ranks: &mut [RankState<B>],
    mem: &mut M,
    delivery: Delivery,
    delivery_rng: &mut Option<SplitMix64>,
    seed: u64,
    respect_deps: bool,
) -> Result<()> {
    let mut rng = SplitMix64(seed);
    let comm: Vec<Vec<usize>> = plans.iter().map(|p| lane_steps(p, true)).collect();
    let compute: Vec<Vec<usize>> = plans.iter().map(|p| lane_steps(p, false)).collect();
    let world = plans.len();
    let (mut comm_pos, mut compute_pos) = (vec![0usize; world], vec![0usize; world]);
    let done = |steps: &[usize], pos: usize| pos.checked_sub(1).map(|i| steps[i]);
    loop {
        // (Some(t), _): the group of step t; (None, r): rank r's next folds.
        let mut actions: Vec<(Option<usize>, usize)> = Vec::new();
        let mut groups: Vec<usize> = (0..world)
            .filter_map(|r| comm[r].get(comm_pos[r]).copied())
            .collect();
        groups.sort_unstable();
        groups.dedup();
        for t in groups {
            let ready = (0..world).all(|r| {
                let member = plans[r].steps.get(t).is_some_and(|s| !s.comm.is_empty());
                !member
                    || (comm[r].get(comm_pos[r]) == Some(&t)
                        && (!respect_deps
                            || passed(
                                plans[r].lanes[t].comm_after,
                                done(&compute[r], compute_pos[r]),
                            )))
            });
            if ready {
                actions.push((Some(t), 0));
            }
        }
        for r in 0..world {
            if let Some(&t) = compute[r].get(compute_pos[r]) {
                if !respect_deps
                    || passed(plans[r].lanes[t].compute_after, done(&comm[r], comm_pos[r]))
                {
                    actions.push((None, r));
                }
            }
        }
        if actions.is_empty() {
            let finished = (0..world)
                .all(|r| comm_pos[r] == comm[r].len() && compute_pos[r] == compute[r].len());
            if finished {
                return Ok(());
            }
            return Err(ReduceError::invariant(format!(
                "the lanes deadlocked: comm lanes at {comm_pos:?} of {:?}, compute lanes at \
                 {compute_pos:?} of {:?}",
                comm.iter().map(Vec::len).collect::<Vec<_>>(),
                compute.iter().map(Vec::len).collect::<Vec<_>>()
            )));
        }
        let pick = (rng.next() % actions.len() as u64) as usize;
        match actions[pick] {
            (Some(t), _) => {
                deliver(plans, ranks, mem, t, delivery, delivery_rng)?;
                for r in 0..world {
                    if comm[r].get(comm_pos[r]) == Some(&t) {
                        comm_pos[r] += 1;
                    }
                }
            }
            (None, r) => {
                let t = compute[r][compute_pos[r]];
                let state = &mut ranks[r];
                for op in &plans[r].steps[t].compute {
                    apply(mem, op, &mut state.locals, &mut state.scratch)?;
                }
                compute_pos[r] += 1;
            }
        }
    }
}

/// Memory an [`EmulatedWorld`] can run in: the fold arithmetic plus moving
/// values in and out. Implemented for host memory ([`HostFold`]) and device
/// memory ([`DeviceFold`](crate::DeviceFold)).
pub trait EmulatorMemory<B>: FoldOps<B> {
    /// A buffer holding `values`.
    fn load(&mut self, values: &[f32]) -> Result<B>;
    /// The values of `buf` (after every operation so far completed).
    fn store(&mut self, buf: &B) -> Result<Vec<f32>>;
}

impl EmulatorMemory<Vec<f32>> for HostFold {
    fn load(&mut self, values: &[f32]) -> Result<Vec<f32>> {
        Ok(values.to_vec())
    }

    fn store(&mut self, buf: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(buf.clone())
    }
}

struct RankState<B> {
    locals: Vec<B>,
    scratch: B,
}

/// Rank `a`'s state shared and rank `b`'s mutable (`a != b`: plans never
/// message self).
fn two_ranks<B>(
    ranks: &mut [RankState<B>],
    a: usize,
    b: usize,
) -> Result<(&RankState<B>, &mut RankState<B>)> {
    if a == b || a.max(b) >= ranks.len() {
        return Err(ReduceError::invariant(format!(
            "message from rank {a} to rank {b}"
        )));
    }
    if a < b {
        let (lo, hi) = ranks.split_at_mut(b);
        Ok((&lo[a], &mut hi[0]))
    } else {
        let (lo, hi) = ranks.split_at_mut(a);
        Ok((&hi[0], &mut lo[b]))
    }
}

/// Messages from one rank to another in issue order: (buffer, range).
type Queue = VecDeque<(BufId, Range<usize>)>;

/// One matched message.
struct Transfer {
    from: usize,
    src_buf: BufId,
    src_start: usize,
    to: usize,
    dst_buf: BufId,
    dst_start: usize,
    len: usize,
}

/// Pair step `t`'s sends and receives: the `k`-th send from `a` to `b`
/// matches the `k`-th receive on `b` from `a` (NCCL's and the host
/// transport's rule). Anything unmatched or of different lengths is a plan
/// bug.
fn match_messages(plans: &[RankPlan], t: usize) -> Result<Vec<Transfer>> {
    let world = plans.len();
    // outbox[a][b]: (buffer, range) sent from a to b, in issue order.
    let mut outbox: Vec<Vec<Queue>> = (0..world)
        .map(|_| (0..world).map(|_| VecDeque::new()).collect())
        .collect();
    for (a, plan) in plans.iter().enumerate() {
        for op in plan.steps.get(t).map_or(&[][..], |s| &s.comm[..]) {
            if let CommOp::Send { buf, range, peer } = op {
                outbox[a][*peer].push_back((*buf, range.clone()));
            }
        }
    }
    let mut out = Vec::new();
    for (b, plan) in plans.iter().enumerate() {
        for op in plan.steps.get(t).map_or(&[][..], |s| &s.comm[..]) {
            if let CommOp::Recv { buf, range, peer } = op {
                let (src_buf, src) = outbox[*peer][b].pop_front().ok_or_else(|| {
                    ReduceError::invariant(format!(
                        "step {t}: rank {b} receives from {peer}, which sends nothing more"
                    ))
                })?;
                if src.len() != range.len() {
                    return Err(ReduceError::invariant(format!(
                        "step {t}: rank {peer} sends {} elements to rank {b}, which expects {}",
                        src.len(),
                        range.len()
                    )));
                }
                out.push(Transfer {
                    from: *peer,
                    src_buf,
                    src_start: src.start,
                    to: b,
                    dst_buf: *buf,
                    dst_start: range.start,
                    len: range.len(),
                });
            }
        }
    }
    for (a, row) in outbox.iter().enumerate() {
        for (b, q) in row.iter().enumerate() {
            if !q.is_empty() {
                return Err(ReduceError::invariant(format!(
                    "step {t}: {} message(s) from rank {a} to rank {b} are never received",
                    q.len()
                )));
            }
        }
    }
    Ok(out)
}

/// A small deterministic generator for delivery permutations.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fold::host_mean;

    fn arenas(logical: usize, len: usize) -> Vec<Vec<f32>> {
        let mut rng = SplitMix64(len as u64 * 31 + logical as u64);
        (0..logical)
            .map(|_| {
                (0..len)
                    .map(|_| (rng.next() >> 40) as f32 * 2f32.powi((rng.next() % 40) as i32 - 40))
                    .collect()
            })
            .collect()
    }

    /// Run the lanes of `world` ranks over `a`, optionally ignoring the waits.
    fn lanes(
        a: &[Vec<f32>],
        world: usize,
        chunk: usize,
        seed: u64,
        respect: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let (logical, len) = (a.len(), a[0].len());
        let plans = (0..world)
            .map(|r| RankPlan::new(r, world, logical, len, Some(chunk)))
            .collect::<Result<Vec<_>>>()?;
        let blocks = logical / world;
        let mut mem = HostFold;
        let mut ranks: Vec<RankState<Vec<f32>>> = plans
            .iter()
            .enumerate()
            .map(|(r, p)| RankState {
                locals: a[r * blocks..(r + 1) * blocks].to_vec(),
                scratch: vec![f32::NAN; p.scratch_len().max(1)],
            })
            .collect();
        run_lanes(
            &plans,
            &mut ranks,
            &mut mem,
            Delivery::InOrder,
            &mut None,
            seed,
            respect,
        )?;
        Ok(ranks.into_iter().map(|s| s.locals[0].clone()).collect())
    }

    #[test]
    fn lane_schedules_keep_the_bits_and_ignoring_the_waits_does_not() {
        for (logical, world) in [(2, 2), (3, 3), (4, 2), (6, 3)] {
            let a = arenas(logical, 2000);
            let refs: Vec<&[f32]> = a.iter().map(|v| v.as_slice()).collect();
            let want: Vec<u32> = host_mean(&refs)
                .unwrap()
                .iter()
                .map(|x| x.to_bits())
                .collect();
            let mut broken = 0;
            for seed in 0..40 {
                for got in lanes(&a, world, 256, seed, true).unwrap() {
                    let bits: Vec<u32> = got.iter().map(|x| x.to_bits()).collect();
                    assert!(bits == want, "L={logical} P={world} seed {seed}");
                }
                // Without the waits a fold may read a slot before its group
                // filled it (NaN) or a group may send a shard before its
                // fold: some schedule must show it.
                let wrong = lanes(&a, world, 256, seed, false)
                    .unwrap()
                    .iter()
                    .any(|got| got.iter().map(|x| x.to_bits()).collect::<Vec<_>>() != want);
                broken += usize::from(wrong);
            }
            assert!(
                broken > 0,
                "L={logical} P={world}: no schedule without waits went wrong"
            );
        }
    }
}
