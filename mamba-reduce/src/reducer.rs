//! The [`Reducer`] seam, and [`PlanRunner`]: how a fold runs a plan over a
//! transport. The implementation over any transport is
//! [`TransportReducer`](crate::TransportReducer) (`transport_reducer.rs`).

use std::ops::Range;

use mamba_comm::Transport;

use crate::contract::ReduceContract;
use crate::exec::execute;
use crate::fold::{host_fold, FoldOps, HostFold};
use crate::identity::RunIdentity;
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
/// Implementations here: [`TransportReducer`](crate::TransportReducer) over any
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
