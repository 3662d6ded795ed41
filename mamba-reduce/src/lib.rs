//! `mamba-reduce`: the gradient reduction whose bits do not depend on the
//! transport, the delivery order, the topology, the NCCL version or the
//! number of processes.
//!
//! # Contracts
//!
//! [`ReduceContract::FixedOrder`] (default): per element, the `L` logical
//! addends are summed in strictly ascending logical-rank order
//! `((g0 + g1) + g2) + ...` in f32, round-to-nearest, no contraction; the
//! mean is that sum times `fl(1/L)` (never pre-scaled addends).
//! [`ReduceContract::FixedTree`] (`L` a power of two): per element, the
//! complete binary tree over the `L` addends in logical order (`(g0 + g1)`,
//! `(g2 + g3)`, then pairs of pairs, ...), times `fl(1/L)`; the same
//! guarantees as `FixedOrder` with other bits, and a process folds its
//! block of `L/P` micro-batch gradients as they finish in `log2(L/P) + 1`
//! arenas ([`TreeAccumulator`]) instead of `L/P`.
//! [`ReduceContract::NcclSum`]: the library's all-reduce, then times
//! `fl(1/L)`; fastest, stable only on a frozen machine and configuration.
//!
//! | change between two runs | FixedOrder, FixedTree | NcclSum |
//! |---|---|---|
//! | re-run, same machine | same bits | same bits |
//! | delivery order, timing, transport (host vs NCCL) | same bits | may differ |
//! | NCCL version, topology, GPU permutation | same bits | may differ |
//! | physical world size at a fixed logical world | same bits | may differ |
//! | logical world size | differs (part of the run's identity) | differs |
//! | stop and resume from a checkpoint | same bits | same bits on a frozen machine |
//!
//! Not promised by either: NaN payload and sign bits (a NaN stays a NaN;
//! GPUs return a canonical NaN). Under `NcclSum` with `L > P` each process
//! folds its own block of `L/P` addends first and the library sums the `P`
//! block sums, so the bits also change with `P`.
//!
//! # Pieces
//!
//! - [`ShardPlan`]: contiguous shards in rank order, remainder to the lowest
//!   ranks, empty shards allowed.
//! - [`host_fold`], [`host_accumulate`], [`host_mean`]: the reference
//!   arithmetic; `kernels::FoldKernel` reproduces it bit for bit on GPUs.
//!   [`host_tree_fold`], [`host_tree_mean`]: the fixed tree's scalar
//!   reference.
//! - [`TreeAccumulator`]: the binary counter that folds a process's block
//!   of the fixed tree as its micro-batches finish, over any [`FoldOps`]
//!   (the one [`Reducer::local_fold`] offers).
//! - [`RankPlan`]: one rank's fixed-order or fixed-tree dataflow as data (messages and
//!   fold operations per step, and the waits between a comm lane and a
//!   compute lane), with its [`PlanCost`].
//! - [`EmulatedWorld`]: one process running every rank's plan, with chosen
//!   message delivery orders and, optionally, random two-lane schedules;
//!   the oracle every live world is tested against.
//! - [`Reducer`]: the seam the trainer uses and a research reducer
//!   replaces; [`TransportReducer`] implements it over any
//!   [`mamba_comm::Transport`] and a [`PlanRunner`] (a [`FoldOps`] that
//!   can run a whole plan): [`HostReducer`] (host memory, step by step)
//!   and [`NcclReducer`] (device memory, NCCL, the fold kernel, two lanes).
//! - [`PeerReducer`]: the fixed-order reduction inside one node without
//!   messages: the ranks map each other's arenas (CUDA memory-pool IPC,
//!   [`mamba_comm::ipc`]) and each shard owner folds its shard of all `L`
//!   arenas in ascending logical order in one kernel and writes the mean
//!   into every rank's arena, between two GPU barriers with a deadline and
//!   an abort value. The same per-element chain as every other path, so
//!   the same bits at the same `L`. Its host collectives go through a
//!   control [`Reducer`].
//! - [`RunIdentity`] and the agreement check every rank runs before its
//!   first reduction (the dataflow joins it: a rank on the peer fold and
//!   one on messages fail it by name).
//!
//! # The fixed-order dataflow
//!
//! **`P = L`** (one logical rank per process): the arena is cut into `C`
//! chunks and each chunk into `P` contiguous shards. Per chunk, one group
//! of sends and receives gives each owner every peer's copy of its shard in
//! a slot indexed by source rank (the scatter); the owner folds ascending
//! and scales in one `det_chain` launch, in place in its arena, its own
//! shard joining the chain at its rank's position (no copy); two steps
//! later a group sends the reduced shard to every peer, straight into their
//! arenas (the gather). Delivery order cannot matter: no region is written
//! by two messages, and a fold starts only when its group is complete.
//!
//! **`L > P`** (`P` divides `L`; process `p` holds logical ranks
//! `p*L/P ..` in ascending order): a per-source partial sum would change
//! the association, so the *running prefix* travels: rank 0 folds its
//! block, rank 1 continues the chain with its block, ..., the last rank
//! holds the sum, scales it (fused), and the result is relayed to every
//! rank. Chunked, so all ranks work on different chunks at once. The
//! per-element chain is exactly the one of `P = L`, so the result is
//! bit-identical for every `P` at fixed `L`.
//!
//! **Ending at the owners** (ZeRO-1's reduce-scatter,
//! [`Reducer::reduce_mean_shard`], [`RankPlan::ending_at_owners`]): the
//! same plans, every folding step unchanged, with each message of the
//! final distribution cut to the range its receiver owns (the relay of
//! `L > P` carries only what the ranks ahead of it own). The additions are
//! decided before the distribution, so each owned element has the
//! all-reduce's bits. A sharded plan then moves `(P-1)/P N (1 + 1/P)` per
//! rank instead of `2 (P-1)/P N` (the fold shards stay per chunk for
//! balance; a shard lands at one owner).
//!
//! **On GPUs** ([`NcclReducer`]) the whole plan is queued at once: groups
//! on the communicator's stream, folds on a second stream, with an event
//! wait only where a group and a fold touch the same elements (which keeps
//! every result of the step-by-step order; the emulated world checks it
//! with random schedules), and one host wait at the end under the
//! communicator's watchdog (`NcclComm::window`). So the fold of chunk `t`
//! can run while the next chunk moves, and no host round-trip sits between
//! groups. [`DeviceFold::set_overlap`]`(false)` runs the same plan step by
//! step instead (a host wait per group), for comparison.
//!
//! Event order alone does not make two kernels run at once: both need
//! multiprocessors. A fold on the kernels' default grid (16 blocks of 256
//! threads per SM) fills every SM, so NCCL's next transfer kernel (one
//! block per channel) could not start until the fold drained, and its
//! blocks then shared SMs with the peer's fold: two chunks were slower
//! than one at every size (docs/PERFORMANCE.md). Folds that run beside
//! transfers (plans of two or more chunks) therefore take a [`FoldGrid`]
//! ([`DeviceFold::set_overlap_grid`], default half the SMs in 1024-thread
//! blocks, one block per SM): the fold stays on its SMs and the others are
//! free for NCCL. A one-chunk plan's single fold has nothing to overlap and
//! keeps the full grid. The grid never changes a bit.
//!
//! Measured (2x H200, docs/PERFORMANCE.md, third run): even with the
//! limited grid, two or more chunks never beat one at `P = L`, because each
//! extra nonblocking group costs the host ~70-120 us, more than the fold it
//! hides. So sharded plans default to one chunk; what bounds them is the
//! one unhidden fold pass (`(P+1)/P N` x 4 HBM bytes, 6-14% of NCCL's
//! all-reduce time at 256 MiB - 1 GiB). The chunked machinery stays for
//! the `L > P` pipeline (where it is the dataflow) and for explicit chunk
//! lengths.
//!
//! # The fixed-tree dataflow
//!
//! Each process passes one arena, its block's subtree sum (the lower
//! `log2(L/P)` levels, folded as the micro-batches finished). The upper
//! `log2 P` levels run across processes by recursive halving: at level
//! `k` rank `p` and its partner `p ^ 2^k` hold the two children of the
//! same tree node over the same element range; each keeps half the range,
//! sends the other half to its partner, receives the partner's copy of
//! its half and adds it in place (one two-term `det_chain`, the last level
//! with the scale fused). Two-term sums commute exactly, so who adds does
//! not matter, and because every aligned block of ranks is a subtree the
//! result is bit-identical for every power-of-two `P`. The root's shards
//! (rank `p` ends with shard `bitrev(p)`, which keeps every level's range
//! contiguous) then travel to every peer. Bytes per rank are a ring
//! all-reduce's (`2 (P-1)/P N` x 4), in `log2(P) + 1` groups (one chunk,
//! the default); scratch is half an arena. The trainer's gradient memory
//! is `log2(L/P) + 1` arenas instead of `L/P`.
//!
//! # Bytes, launches, memory (`N` elements of 4 bytes, `C` chunks, `B = L/P`)
//!
//! | | `P = L` | `L > P` |
//! |---|---|---|
//! | bytes sent per rank | `2 (P-1)/P N` x 4 (a ring all-reduce's) | `2N` x 4; `N` x 4 on ranks `P-2`, `P-1` |
//! | point-to-point groups | `C + 2` (`2` for `C = 1`) | at most `C + 3P - 4` (`P >= 2`) |
//! | fold launches per rank (scale fused) | `C` | `C` |
//! | fold HBM bytes per rank | `(P+1)/P N` x 4 | `(B+1) N` x 4 on rank 0, `(B+2) N` x 4 on the others |
//! | fold grid | full for `C = 1`, else [`FoldGrid`] (default `ceil(SMs/2)` blocks of 1024) | the same |
//! | host waits | 1 | 1 |
//! | scratch memory | `min(C,2)` sets of `P-1` slots of `~N/(CP)`: `~(P-1)/P N` x 4 | `min(C,2)` chunks, none on rank 0 |
//! | default `C` ([`RankPlan::default_chunk`]) | 1, at every size | `sqrt((3P-3) T_link / 100 us)`, 1..=64 ([`GROUP_OVERHEAD_SEC`]) |
//!
//! What this means on two H200s (132 SMs; NVLink ~330-360 GB/s per
//! direction for NCCL point-to-point, HBM ~4 TB/s; ~100 us of host time to
//! enqueue each group, because the communicator is nonblocking and NCCL
//! launches every group from a thread it creates for it; PyTorch's NCCL
//! all-reduce there: 1 GiB in 3.39 ms, 256 MiB in 0.94 ms):
//!
//! - `P = L = 2`, 256 MiB, an explicit chunk length of 32 Mi elements
//!   (`C = 2`; the default is one chunk): each direction carries 256 MiB (four
//!   groups of 64 MiB: scatter 0, scatter 1, gather 0, gather 1), like a
//!   ring all-reduce; two folds of 96 MiB of HBM traffic each (read the
//!   own and the peer's 32 MiB shard, write 32 MiB), one launch each on 66
//!   SMs, which must stream at 3x the link rate (~1 TB/s) to hide: fold 0
//!   runs beside scatter 1, fold 1 beside gather 0. Only the first group's
//!   enqueue (which NCCL's own all-reduce pays too) and the device-side
//!   group cost remain on top of the link time, in the ideal where the
//!   later groups are enqueued while earlier ones move; measured, each
//!   extra group's ~100 us of host time was not hidden, so one chunk wins. With the fold in the
//!   open (`C = 1`, or the full grid) it adds ~0.1 ms at 256 MiB, 0.2 ms at
//!   512 MiB, 0.4 ms at 1 GiB.
//! - `P = L = 2`, 4 MiB, `C = 1`: two groups (~12 us of link time, each
//!   ~100 us to enqueue: the host, not the link, sets the time), one fold
//!   (~2 us + launch), one host wait.
//! - `L = 2P = 4`, 1 GiB, `C = 9` (the default, from the measured ~100 us
//!   per group): both directions busy with one chunk each per step for 9
//!   of 12 steps: `(C + 2)/C` x 2.98 ms ~ 3.6 ms of link time, and 11
//!   group enqueues of ~100 us (~1.1 ms of host time, behind the
//!   transfers when each group moves ~114 MiB). The former 10 us model
//!   chose `C = 30`, whose 33 enqueues put ~3.3 ms on the host (an
//!   estimate from the model, not a new measurement).
//!
//! Memory with `L > P`: under `FixedOrder` the caller holds its `L/P` arenas
//! (the chain cannot fold a rank's addends before the lower ranks' prefix
//! arrives); the reducer adds only the prefix buffer (two chunks), and
//! `local[0]` is overwritten with the mean while the other arenas are left
//! as they were. Under `FixedTree` the caller holds at most `log2(L/P) + 1`
//! ([`TreeAccumulator`]) and passes one; the reducer adds half an arena of
//! scratch (one chunk).
//!
//! Under `NcclSum`: one library all-reduce plus one scale launch (and
//! `B - 1` block folds for `L > P`). `any` is one `i32` max all-reduce.
//! `all_reduce_host` and the agreement check all-gather the values with one
//! group (`P - 1` sends and receives per rank) and fold ascending on the
//! host.

mod contract;
mod device;
mod emulated;
mod error;
mod exec;
mod fold;
mod gather;
mod host;
mod identity;
mod nccl;
mod peer;
mod plan;
mod reducer;
mod shard;
mod transport_reducer;
mod tree;

pub use contract::ReduceContract;
pub use device::{DeviceFold, FoldGrid};
pub use emulated::{Delivery, EmulateOptions, EmulatedWorld, EmulatorMemory};
pub use error::{ReduceError, Result};
pub use exec::execute;
pub use fold::{
    host_accumulate, host_fold, host_mean, host_scale, mean_factor, ChainTerm, FoldOps, HostFold,
};
pub use gather::all_gather_ranges;
pub use host::HostReducer;
pub use identity::{agree, all_gather, RunIdentity};
pub use nccl::NcclReducer;
pub use peer::{PeerOptions, PeerReducer};
pub use plan::{Dataflow, PlanCost, RankPlan, GROUP_OVERHEAD_SEC, LINK_BYTES_PER_SEC};
pub use reducer::{PlanRunner, Reducer};
pub use shard::ShardPlan;
pub use transport_reducer::{ReducerOptions, TransportReducer};
pub use tree::{host_tree_fold, host_tree_mean, TreeAccumulator};
