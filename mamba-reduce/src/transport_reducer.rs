//! [`TransportReducer`]: the [`Reducer`] over any [`Transport`], every
//! contract, with the fold arithmetic of a [`FoldOps`] for the transport's
//! memory.

use std::ops::Range;

use mamba_comm::Transport;

use crate::contract::ReduceContract;
use crate::fold::{host_fold, mean_factor, ChainTerm, FoldOps};
use crate::gather::all_gather_ranges;
use crate::identity::{agree, all_gather, RunIdentity};
use crate::plan::RankPlan;
use crate::reducer::{PlanRunner, Reducer};
use crate::{ReduceError, Result};

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
/// For ZeRO-1, [`Reducer::reduce_mean_shard`] runs the contract's plan
/// cut to end at the owners ([`RankPlan::ending_at_owners`]: the same
/// additions, a smaller final distribution) and
/// [`Reducer::all_gather_ranges`] moves owned ranges in one group
/// ([`all_gather_ranges`](crate::all_gather_ranges)). Under
/// [`ReduceContract::NcclSum`] the shard reduction is the full library
/// all-reduce. The owned ranges are checked across ranks at the first
/// `reduce_mean_shard` (a mismatch would pair messages of different sizes)
/// and must stay those afterwards.
///
/// Owns the transport (get it back with [`TransportReducer::into_parts`]),
/// a scratch buffer sized for the last plan (kept between calls; see the
/// crate docs for its size), a small buffer for host exchanges, and the
/// plan of the last call (all-reduce or reduce-scatter).
pub struct TransportReducer<T: Transport, F> {
    transport: T,
    fold: F,
    opts: ReducerOptions,
    agreed: Option<RunIdentity>,
    /// The owned ranges every rank presented at the first
    /// `reduce_mean_shard`.
    agreed_owners: Option<Vec<Range<usize>>>,
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
            agreed_owners: None,
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
    /// contract (fixed order or fixed tree; `NcclSum` has none), ending on
    /// every rank or, with `owned`, at the owners.
    pub fn plan_for(&self, len: usize, owned: Option<&[Range<usize>]>) -> Result<RankPlan> {
        RankPlan::ending_at(
            self.opts.contract,
            self.transport.rank(),
            self.transport.world(),
            self.opts.logical_world,
            len,
            self.opts.chunk_elems,
            owned,
        )
    }

    /// The arena length of `local`, after checking its shape (the count
    /// the contract expects, equal lengths) and, at the first reduction,
    /// running the agreement check (with this rank's problem, if any, so
    /// that every rank fails alike); later, the length every rank agreed on.
    fn checked_len(&mut self, local: &[T::Buffer]) -> Result<usize> {
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
        Ok(len)
    }

    /// At the first shard reduction, every rank's owned ranges against
    /// rank 0's (one small all-gather; a mismatch fails every rank alike);
    /// afterwards, the same ranges or a local error. Ranges that differ
    /// between ranks would pair messages of different sizes.
    fn agree_on_owners(&mut self, owned: &[Range<usize>]) -> Result<()> {
        if let Some(agreed) = &self.agreed_owners {
            if agreed.as_slice() != owned {
                return Err(ReduceError::config(format!(
                    "rank {} passed owned ranges {owned:?} to reduce_mean_shard, but every rank \
                     agreed on {agreed:?} at its first call; the partition must not change",
                    self.transport.rank()
                )));
            }
            return Ok(());
        }
        let digest = RunIdentity::fingerprint_of(format!("{owned:?}").as_bytes());
        let mine: Vec<f32> = (0..4)
            .map(|k| ((digest >> (16 * k)) & 0xffff) as f32)
            .collect();
        let all = all_gather(&mut self.transport, &mut self.small, &mine)?;
        let differing: Vec<usize> = all
            .chunks(4)
            .enumerate()
            .filter(|(_, d)| *d != all[..4].as_ref())
            .map(|(k, _)| k)
            .collect();
        if !differing.is_empty() {
            return Err(ReduceError::Disagreement {
                detail: format!(
                    "the owned ranges of reduce_mean_shard differ from rank 0's on ranks {} \
                     (this rank passed {owned:?}); expected every rank to pass the same partition",
                    short_list(&differing)
                ),
            });
        }
        self.agreed_owners = Some(owned.to_vec());
        Ok(())
    }

    fn exchange(&mut self, id: &RunIdentity, local_problem: Option<String>) -> Result<()> {
        // The chunk length decides message sizes: it joins the identity,
        // unless a reducer that drives this one for its collectives (the
        // peer fold) already filled in its own dataflow.
        let id = if id.chunk_elems == 0 {
            id.with_chunk(self.opts.chunk_elems)
        } else {
            *id
        };
        let agreed = agree(&mut self.transport, &mut self.small, &id, local_problem)?;
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
    fn run_planned(
        &mut self,
        local: &mut [T::Buffer],
        len: usize,
        owned: Option<&[Range<usize>]>,
    ) -> Result<()> {
        if self
            .plan
            .as_ref()
            .is_none_or(|p| p.len() != len || p.owners() != owned)
        {
            self.plan = Some(self.plan_for(len, owned)?);
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
        let len = self.checked_len(local)?;
        match self.opts.contract {
            ReduceContract::FixedOrder | ReduceContract::FixedTree => {
                self.run_planned(local, len, None)
            }
            ReduceContract::NcclSum => self.run_library_sum(local, len),
        }
    }

    /// The plan cut to end at the owners; the library's full all-reduce
    /// under nccl-sum (it has no plan to cut).
    fn reduce_mean_shard(&mut self, local: &mut [T::Buffer], owned: &[Range<usize>]) -> Result<()> {
        let len = self.checked_len(local)?;
        self.agree_on_owners(owned)?;
        match self.opts.contract {
            ReduceContract::FixedOrder | ReduceContract::FixedTree => {
                self.run_planned(local, len, Some(owned))
            }
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

/// At most eight ranks, then how many more (a large world must not print
/// every rank).
fn short_list(ranks: &[usize]) -> String {
    let shown: Vec<String> = ranks.iter().take(8).map(|r| r.to_string()).collect();
    match ranks.len().saturating_sub(8) {
        0 => shown.join(", "),
        more => format!("{} and {more} more", shown.join(", ")),
    }
}
