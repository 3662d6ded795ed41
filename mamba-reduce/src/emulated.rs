//! The oracle: one process holds all `L` arenas and runs every rank's plan
//! of the fixed-order dataflow, delivering messages in an order of its
//! choosing.

use std::collections::VecDeque;
use std::ops::Range;

use crate::exec::apply;
use crate::fold::{FoldOps, HostFold};
use crate::plan::{BufId, CommOp, RankPlan};
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
}

/// One process playing a whole world: `L` logical arenas, spread over any
/// physical world `P` that divides `L`, reduced by the same per-rank plans
/// the live reducers run, with messages delivered in a chosen order.
///
/// It is the oracle every live world is asserted against: its result is
/// checked to be identical on every emulated rank, and the tests check it
/// equals [`host_mean`](crate::host_mean) of the arenas for every `P`,
/// chunking and delivery order.
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

    /// Run the fixed-order reduction on `world` emulated processes (each
    /// holding its contiguous block of `L / world` arenas) and return the
    /// mean, after checking every emulated rank ended with the same bits.
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
        let logical = self.logical_world();
        let len = self.len();
        let plans = (0..world)
            .map(|r| RankPlan::new(r, world, logical, len, opts.chunk_elems))
            .collect::<Result<Vec<_>>>()?;
        let blocks = logical / world;
        let mut ranks: Vec<RankState<B>> = Vec::with_capacity(world);
        for (r, p) in plans.iter().enumerate() {
            let locals = self.arenas[r * blocks..(r + 1) * blocks]
                .iter()
                .map(|a| mem.load(a))
                .collect::<Result<Vec<B>>>()?;
            // At least one element: some memories cannot hold empty buffers.
            let scratch = mem.load(&vec![f32::NAN; p.scratch_len().max(1)])?;
            ranks.push(RankState { locals, scratch });
        }
        let mut rng = match opts.delivery {
            Delivery::Shuffled(seed) => Some(SplitMix64(seed)),
            _ => None,
        };
        let n_steps = plans.iter().map(|p| p.steps.len()).max().unwrap_or(0);
        for t in 0..n_steps {
            let mut deliveries = match_messages(&plans, t)?;
            match opts.delivery {
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
            // Direct copies are as good as snapshots taken before the
            // group: validated plans never receive into a region that is
            // sent from (or received into twice) in the same step.
            for d in deliveries {
                let (src_state, dst_state) = two_ranks(&mut ranks, d.from, d.to)?;
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
            for (plan, state) in plans.iter().zip(ranks.iter_mut()) {
                if let Some(step) = plan.steps.get(t) {
                    for op in &step.compute {
                        apply(mem, op, &mut state.locals, &mut state.scratch)?;
                    }
                }
            }
        }
        mem.finish()?;
        ranks
            .iter()
            .map(|s| s.locals.first().map_or(Ok(Vec::new()), |b| mem.store(b)))
            .collect()
    }
}

/// Memory an [`EmulatedWorld`] can run in: the fold arithmetic plus moving
/// values in and out. Implemented for host memory ([`HostFold`]) and device
/// memory ([`KernelFold`](crate::KernelFold)).
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
