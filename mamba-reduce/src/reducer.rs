//! The [`Reducer`] seam and its implementation over any transport.
//!
//! Over 450 lines: the trait's docs carry the per-contract and ZeRO-1
//! contracts (most of the file), and `TransportReducer` implements exactly
//! that trait; splitting the implementation into its own file is planned.

use std::ops::Range;

use mamba_comm::Transport;

use crate::contract::ReduceContract;
use crate::exec::execute;
use crate::fold::{host_fold, mean_factor, ChainTerm, FoldOps, HostFold};
use crate::gather::all_gather_ranges;
use crate::identity::{agree, all_gather, RunIdentity};
use crate::plan::RankPlan;
use crate::{ReduceError, Result};

/// The reduction a data-parallel trainer needs, and the seam where a
/// research reducer replaces this crate's.
///
/// The trainer calls only this trait: it hands over each step's gradient
/// arenas and gets the mean back in place, asks collective yes/no
/// questions, and sums small host values. An implementation decides how the
/// bytes move and in which order the addends meet; it must say which
/// [`ReduceContract`] rows it keeps (a research reducer that keeps none
/// should report [`ReduceContract::NcclSum`], the weaker promise). Every
/// method is collective: all ranks call it, in the same order, with the
/// same shapes.
///
/// Implementations here: [`TransportReducer`] over any
/// [`Transport`] — [`HostReducer`](crate::HostReducer) (host memory, CPU
/// worlds) and, with device memory, `NcclReducer` — each with every
/// contract.
///
/// A sharded optimizer (ZeRO-1) uses two more calls, both with default
/// implementations so that a reducer written before them keeps working:
/// [`Reducer::reduce_mean_shard`] (the reduction only has to end at the
/// shard owners; by default the full [`Reducer::reduce_mean`]) and
/// [`Reducer::all_gather_ranges`] (the owners' updated weights back to
/// every rank, as bytes; by default only a world of one, where nothing
/// moves). The contract decides how the reduced values are computed, never
/// which rank ends up with them, so both work under every contract.
pub trait Reducer {
    /// Where the gradient arenas live (host `Vec<f32>`, device memory).
    type Buffer;

    /// The contract this reducer keeps.
    fn contract(&self) -> ReduceContract;

    /// `L`, the number of logical ranks whose gradients are averaged.
    fn logical_world(&self) -> usize;

    /// `P`, the number of processes.
    fn world(&self) -> usize;

    /// This process's rank in `0..P`.
    fn rank(&self) -> usize;

    /// Average the `L` logical gradient arenas of the world.
    ///
    /// What `local` holds depends on the contract:
    /// - [`ReduceContract::FixedOrder`] and [`ReduceContract::NcclSum`]:
    ///   this process's `L/P` logical arenas in ascending logical order
    ///   (logical ranks `rank * L/P ..`);
    /// - [`ReduceContract::FixedTree`]: exactly one arena, this process's
    ///   block sum — the complete binary tree over its `L/P` logical
    ///   arenas, unscaled, as a [`TreeAccumulator`](crate::TreeAccumulator)
    ///   fed in logical order yields it (so no process needs all `L/P`
    ///   arenas at once).
    ///
    /// Another count is a [`ReduceError::Config`] naming the expected one.
    /// Afterwards `local[0]` holds the mean over all `L` on every rank; the
    /// other arenas are unchanged. The first call runs the agreement check
    /// if [`Reducer::check_agreement`] was not called (with fingerprint 0).
    fn reduce_mean(&mut self, local: &mut [Self::Buffer]) -> Result<()>;

    /// [`Reducer::reduce_mean`] that only has to end at the shard owners
    /// (a reduce-scatter): `owned[k]` is rank `k`'s element range (one per
    /// rank, in rank order, disjoint; the same on every rank). Afterwards
    /// `local[0][owned[rank]]` holds exactly the bits `reduce_mean` would
    /// put there; the rest of `local[0]` is unspecified (it may hold the
    /// mean too, or this rank's own gradient).
    ///
    /// The default runs the full `reduce_mean` (every rank gets every
    /// element: correct under every contract, at an all-reduce's traffic).
    fn reduce_mean_shard(
        &mut self,
        local: &mut [Self::Buffer],
        owned: &[Range<usize>],
    ) -> Result<()> {
        let _ = owned;
        self.reduce_mean(local)
    }

    /// Every rank's own range of `buf` to every rank, as bytes: `owned[k]`
    /// is rank `k`'s element range (one per rank, in rank order, disjoint;
    /// the same on every rank). Afterwards `buf[owned[k]]` holds rank `k`'s
    /// values on every rank, bit for bit; elements outside every range are
    /// untouched. This is how ZeRO-1's updated weight shards travel back.
    ///
    /// The default supports a world of one (nothing moves) and refuses a
    /// larger world with a [`ReduceError::Config`] naming the missing call.
    fn all_gather_ranges(&mut self, buf: &mut Self::Buffer, owned: &[Range<usize>]) -> Result<()> {
        let _ = (buf, owned);
        if self.world() <= 1 {
            return Ok(());
        }
        Err(ReduceError::config(format!(
            "this reducer does not implement all_gather_ranges, which a sharded optimizer \
             (ZeRO-1) needs in a world of {} processes; train unsharded, or implement it",
            self.world()
        )))
    }

    /// The arithmetic a caller folds its block with before
    /// [`Reducer::reduce_mean`] under [`ReduceContract::FixedTree`] (drive a
    /// [`TreeAccumulator`](crate::TreeAccumulator) with it): the same
    /// additions, on the same memory and stream, as the reducer's own
    /// folds. `None` (the default) when the reducer offers none; a trainer
    /// then cannot run the fixed-tree contract with it. Not collective.
    fn local_fold(&mut self) -> Option<&mut dyn FoldOps<Self::Buffer>> {
        None
    }

    /// Whether `flag` is true on any rank (exact: an integer max).
    fn any(&mut self, flag: bool) -> Result<bool>;

    /// Sum `v` over the `P` processes, in place, deterministically: every
    /// rank's values are gathered and folded in ascending rank order, so the
    /// bits depend only on the `P` inputs. For a sum that is also the same
    /// for every `P` at fixed `L`, use [`Reducer::all_reduce_host_logical`].
    fn all_reduce_host(&mut self, v: &mut [f32]) -> Result<()>;

    /// Every process's `v` (same length everywhere), concatenated in rank
    /// order.
    fn all_gather_host(&mut self, v: &[f32]) -> Result<Vec<f32>>;

    /// Check, before the first reduction, that every rank presents the same
    /// identity (arena length, contract, logical world, fingerprint). A
    /// mismatch is a [`ReduceError::Disagreement`] on every rank, naming
    /// the ranks and values.
    fn check_agreement(&mut self, id: &RunIdentity) -> Result<()>;

    /// Sum small host values over the `L` logical ranks in ascending logical
    /// order: `per_logical` holds this process's `L/P` rows (one per local
    /// logical rank, ascending, all the same length). The result is the
    /// same on every rank and for every `P` at fixed `L` (e.g. a loss that
    /// is logged identically on 1 or 8 GPUs).
    fn all_reduce_host_logical(&mut self, per_logical: &[&[f32]]) -> Result<Vec<f32>> {
        let blocks = self.logical_world() / self.world().max(1);
        if per_logical.len() != blocks {
            return Err(ReduceError::config(format!(
                "all_reduce_host_logical got {} rows on rank {}, expected {blocks} (L / P)",
                per_logical.len(),
                self.rank()
            )));
        }
        let n = per_logical.first().map_or(0, |r| r.len());
        if let Some(r) = per_logical.iter().find(|r| r.len() != n) {
            return Err(ReduceError::config(format!(
                "all_reduce_host_logical rows differ in length ({} and {n})",
                r.len()
            )));
        }
        let flat: Vec<f32> = per_logical.iter().flat_map(|r| r.iter().copied()).collect();
        let all = self.all_gather_host(&flat)?;
        if n == 0 {
            return Ok(Vec::new());
        }
        let rows: Vec<&[f32]> = all.chunks(n).collect();
        let mut out = vec![0.0; n];
        host_fold(&rows, &mut out)?;
        Ok(out)
    }
}

/// How a fold runs a whole fixed-order plan over a transport: the seam
/// between the plan (what moves and what is added, in which order) and the
/// machinery that runs it.
///
/// Every implementation must compute what the plan's sequential meaning
/// computes (see [`RankPlan`]), bit for bit: [`HostFold`] runs it step by
/// step over any host-memory transport; [`DeviceFold`](crate::DeviceFold)
/// queues it over NCCL as two overlapping stream lanes with one wait.
/// Outside this crate, a `PlanRunner` for a new [`FoldOps`] can run the
/// plan step by step with [`execute`](crate::execute); a [`Reducer`] that
/// does not use plans at all runs the agreement check with
/// [`agree`](crate::agree) (see `tests/src/tree.rs` for one).
pub trait PlanRunner<T: Transport>: FoldOps<T::Buffer> {
    /// Run `plan` on this rank: `locals` are the caller's
    /// [`RankPlan::local_arenas`] arenas (fixed order: the `L/P` arenas of
    /// its logical ranks, ascending; fixed tree: the block sum), `scratch`
    /// holds at least
    /// `plan.scratch_len()` elements. Afterwards `locals[0]` holds the mean
    /// on every rank and every operation has completed.
    fn run_plan(
        &mut self,
        plan: &RankPlan,
        transport: &mut T,
        locals: &mut [T::Buffer],
        scratch: &mut T::Buffer,
    ) -> Result<()>;
}

impl<T: Transport<Buffer = Vec<f32>>> PlanRunner<T> for HostFold {
    fn run_plan(
        &mut self,
        plan: &RankPlan,
        transport: &mut T,
        locals: &mut [Vec<f32>],
        scratch: &mut Vec<f32>,
    ) -> Result<()> {
        execute(plan, transport, self, locals, scratch)
    }
}

/// Settings of a [`TransportReducer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReducerOptions {
    /// The contract (default [`ReduceContract::FixedOrder`]).
    pub contract: ReduceContract,
    /// `L`; must be a multiple of the number of processes.
    pub logical_world: usize,
    /// Fixed-order chunk length in elements (`None`:
    /// [`RankPlan::default_chunk`]). Changes speed and scratch memory,
    /// never bits.
    pub chunk_elems: Option<usize>,
}

impl ReducerOptions {
    /// Options for `contract` over `logical_world` logical ranks.
    pub fn new(contract: ReduceContract, logical_world: usize) -> Self {
        ReducerOptions {
            contract,
            logical_world,
            chunk_elems: None,
        }
    }
}

/// A [`Reducer`] over any [`Transport`], with the fold arithmetic supplied
/// by a [`FoldOps`] for the transport's memory.
///
/// For ZeRO-1 it keeps the default [`Reducer::reduce_mean_shard`] (the
/// plain reduction: the sharded plan's shards are element-granular and the
/// optimizer's whole norm chunks, so ending the fold at the owners needs a
/// plan over the optimizer's partition, not built yet) and all-gathers
/// owned ranges in one group ([`all_gather_ranges`](crate::all_gather_ranges)).
///
/// Owns the transport (get it back with [`TransportReducer::into_parts`]),
/// a scratch buffer sized for the last arena length (kept between calls;
/// see the crate docs for its size), a small buffer for host exchanges, and
/// the plan for the last arena length.
pub struct TransportReducer<T: Transport, F> {
    transport: T,
    fold: F,
    opts: ReducerOptions,
    agreed: Option<RunIdentity>,
    plan: Option<RankPlan>,
    scratch: Option<T::Buffer>,
    small: Option<T::Buffer>,
}

impl<T: Transport, F: FoldOps<T::Buffer>> TransportReducer<T, F> {
    /// A reducer over `transport` using `fold` for its arithmetic. Nothing
    /// is exchanged yet; `L % P` is checked with every rank at the first
    /// agreement check, so a misconfigured rank cannot fail alone.
    pub fn with_fold(transport: T, fold: F, opts: ReducerOptions) -> Self {
        TransportReducer {
            transport,
            fold,
            opts,
            agreed: None,
            plan: None,
            scratch: None,
            small: None,
        }
    }

    /// The options.
    pub fn options(&self) -> &ReducerOptions {
        &self.opts
    }

    /// The transport (for the trainer's own collectives; keep the order of
    /// collective calls identical on every rank).
    pub fn transport_mut(&mut self) -> &mut T {
        &mut self.transport
    }

    /// The fold arithmetic.
    pub fn fold(&self) -> &F {
        &self.fold
    }

    /// The fold arithmetic, mutably (e.g. `DeviceFold::set_overlap`).
    pub fn fold_mut(&mut self) -> &mut F {
        &mut self.fold
    }

    /// The identity every rank agreed on, once checked.
    pub fn agreed(&self) -> Option<&RunIdentity> {
        self.agreed.as_ref()
    }

    /// The transport and the fold back; scratch buffers are dropped.
    pub fn into_parts(self) -> (T, F) {
        (self.transport, self.fold)
    }

    /// The plan this rank runs for `len`-element arenas under the
    /// contract (fixed order or fixed tree; `NcclSum` has none).
    pub fn plan_for(&self, len: usize) -> Result<RankPlan> {
        RankPlan::for_contract(
            self.opts.contract,
            self.transport.rank(),
            self.transport.world(),
            self.opts.logical_world,
            len,
            self.opts.chunk_elems,
        )
    }

    fn exchange(&mut self, id: &RunIdentity, local_problem: Option<String>) -> Result<()> {
        let agreed = agree(&mut self.transport, &mut self.small, id, local_problem)?;
        self.agreed = Some(agreed);
        Ok(())
    }

    fn run_library_sum(&mut self, local: &mut [T::Buffer], len: usize) -> Result<()> {
        let Some((first, rest)) = local.split_first_mut() else {
            return Err(ReduceError::config("reduce_mean got no local arenas"));
        };
        // Fold this process's block first (ascending), so the library sums
        // P block sums: the association then depends on P (see the docs).
        for g in rest.iter() {
            self.fold
                .chain(first, 0, &[ChainTerm::Dst, ChainTerm::Buf(g, 0)], len, None)?;
        }
        if self.transport.world() > 1 && len > 0 {
            self.transport.all_reduce_sum_f32(first, 0..len)?;
        }
        if self.opts.logical_world > 1 && len > 0 {
            self.fold
                .scale(first, 0, len, mean_factor(self.opts.logical_world))?;
        }
        self.fold.finish()
    }
}

impl<T: Transport, F: PlanRunner<T>> TransportReducer<T, F> {
    fn run_planned(&mut self, local: &mut [T::Buffer], len: usize) -> Result<()> {
        if self.plan.as_ref().is_none_or(|p| p.len() != len) {
            self.plan = Some(self.plan_for(len)?);
        }
        let Some(plan) = self.plan.as_ref() else {
            return Err(ReduceError::invariant("plan missing after construction"));
        };
        let need = plan.scratch_len().max(1);
        let scratch = match self.scratch.take() {
            Some(b) if T::buffer_len(&b) >= need => b,
            _ => self.transport.alloc(need)?,
        };
        let scratch = self.scratch.insert(scratch);
        self.fold
            .run_plan(plan, &mut self.transport, local, scratch)
    }
}

impl<T: Transport, F: PlanRunner<T>> Reducer for TransportReducer<T, F> {
    type Buffer = T::Buffer;

    fn contract(&self) -> ReduceContract {
        self.opts.contract
    }

    fn logical_world(&self) -> usize {
        self.opts.logical_world
    }

    fn world(&self) -> usize {
        self.transport.world()
    }

    fn rank(&self) -> usize {
        self.transport.rank()
    }

    fn reduce_mean(&mut self, local: &mut [T::Buffer]) -> Result<()> {
        let len = local.first().map_or(0, |b| T::buffer_len(b));
        let (world, logical) = (self.transport.world(), self.opts.logical_world);
        let blocks = if world > 0 && logical % world == 0 {
            logical / world
        } else {
            0
        };
        let tree = self.opts.contract == ReduceContract::FixedTree;
        let expected = if tree { 1 } else { blocks };
        // With L % P != 0 (or, for the tree, L not a power of two) every
        // rank fails the agreement check identically; only a rank-local
        // mistake is reported as a local problem.
        let local_problem = if blocks > 0 && local.len() != expected {
            Some(if tree {
                format!(
                    "rank {} passed {} local arenas to reduce_mean; under the fixed-tree \
                     contract each process passes 1, the tree sum of its block of {blocks} \
                     logical ranks (fold them with a TreeAccumulator)",
                    self.transport.rank(),
                    local.len()
                )
            } else {
                format!(
                    "rank {} passed {} local arenas to reduce_mean; with logical world {logical} \
                     over {world} processes each process passes {blocks} (its contiguous block \
                     of logical ranks, ascending)",
                    self.transport.rank(),
                    local.len()
                )
            })
        } else if blocks == 0 {
            None
        } else {
            local
                .iter()
                .enumerate()
                .find(|(_, b)| T::buffer_len(b) != len)
                .map(|(j, b)| {
                    format!(
                        "local arena {j} of rank {} has {} elements, expected {len} like local arena 0",
                        self.transport.rank(),
                        T::buffer_len(b)
                    )
                })
        };
        if self.agreed.is_none() {
            let id = RunIdentity::new(len, self.opts.contract, logical, 0);
            self.exchange(&id, local_problem)?;
        } else if let Some(p) = local_problem {
            return Err(ReduceError::config(p));
        }
        if let Some(agreed) = self.agreed {
            if agreed.arena_len != len as u64 {
                return Err(ReduceError::config(format!(
                    "reduce_mean got arenas of {len} elements on rank {}, but every rank agreed \
                     on {} at the agreement check",
                    self.transport.rank(),
                    agreed.arena_len
                )));
            }
        }
        match self.opts.contract {
            ReduceContract::FixedOrder | ReduceContract::FixedTree => self.run_planned(local, len),
            ReduceContract::NcclSum => self.run_library_sum(local, len),
        }
    }

    /// One group over the transport ([`crate::gather::all_gather_ranges`]).
    fn all_gather_ranges(&mut self, buf: &mut T::Buffer, owned: &[Range<usize>]) -> Result<()> {
        all_gather_ranges(&mut self.transport, buf, owned)
    }

    fn local_fold(&mut self) -> Option<&mut dyn FoldOps<T::Buffer>> {
        Some(&mut self.fold)
    }

    fn any(&mut self, flag: bool) -> Result<bool> {
        let mut v = [i32::from(flag)];
        if self.transport.world() > 1 {
            self.transport.all_reduce_max_i32(&mut v)?;
        }
        Ok(v[0] != 0)
    }

    fn all_reduce_host(&mut self, v: &mut [f32]) -> Result<()> {
        let n = v.len();
        let world = self.transport.world();
        if world == 1 || n == 0 {
            return Ok(());
        }
        let all = all_gather(&mut self.transport, &mut self.small, v)?;
        let rows: Vec<&[f32]> = all.chunks(n).collect();
        host_fold(&rows, v)
    }

    fn all_gather_host(&mut self, v: &[f32]) -> Result<Vec<f32>> {
        all_gather(&mut self.transport, &mut self.small, v)
    }

    fn check_agreement(&mut self, id: &RunIdentity) -> Result<()> {
        let mut problem = None;
        if id.contract != self.opts.contract || id.logical_world != self.opts.logical_world as u64 {
            problem = Some(format!(
                "rank {} was asked to agree on contract {} and logical world {}, but its reducer \
                 was built for contract {} and logical world {}",
                self.transport.rank(),
                id.contract,
                id.logical_world,
                self.opts.contract,
                self.opts.logical_world
            ));
        }
        self.exchange(id, problem)
    }
}
