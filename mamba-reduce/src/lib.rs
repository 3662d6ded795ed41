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
//! [`ReduceContract::NcclSum`]: the library's all-reduce, then times
//! `fl(1/L)`; fastest, stable only on a frozen machine and configuration.
//!
//! | change between two runs | FixedOrder | NcclSum |
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
//! - [`RankPlan`]: one rank's fixed-order dataflow as data (messages and
//!   fold operations per step), with its [`PlanCost`].
//! - [`EmulatedWorld`]: one process running every rank's plan, with chosen
//!   message delivery orders; the oracle every live world is tested
//!   against.
//! - [`Reducer`]: the seam the trainer uses and a research reducer
//!   replaces; [`TransportReducer`] implements it over any
//!   [`mamba_comm::Transport`] and a [`FoldOps`]: [`HostReducer`] (host
//!   memory) and [`NcclReducer`] (device memory, NCCL, the fold kernel).
//! - [`RunIdentity`] and the agreement check every rank runs before its
//!   first reduction.
//!
//! # The fixed-order dataflow
//!
//! **`P = L`** (one logical rank per process): the arena is cut into
//! `P` contiguous shards (per chunk; one chunk by default). One group of
//! sends and receives gives each owner every peer's copy of its shard in a
//! slot indexed by source rank; the owner folds ascending and scales, in
//! place in its arena; a second group sends the reduced shard to every
//! peer, straight into their arenas. Delivery order cannot matter: no
//! region is written by two messages, and the fold starts only when the
//! group is complete.
//!
//! **`L > P`** (`P` divides `L`; process `p` holds logical ranks
//! `p*L/P ..` in ascending order): a per-source partial sum would change
//! the association, so the *running prefix* travels: rank 0 folds its
//! block, rank 1 continues the chain with its block
//! (`det_accumulate_ranks`), ..., the last rank holds the sum, scales it,
//! and the result is relayed to every rank. Chunked, so all ranks work on
//! different chunks at once. The per-element chain is exactly the one of
//! `P = L`, so the result is bit-identical for every `P` at fixed `L`.
//!
//! # Bytes, launches, memory (`N` elements of 4 bytes, `C` chunks)
//!
//! | | `P = L` | `L > P` (`B = L/P`) |
//! |---|---|---|
//! | bytes sent per rank | `2 (P-1)/P N` (a ring all-reduce's) | `N` on ranks `P-2`, `P-1`; `2N` on the others |
//! | point-to-point groups | `C + 1` (2 by default) | `C + 2P - 3` |
//! | fold launches | `C` per rank (+`C` copies on ranks `>= 2`) | `C (B - 1)` on rank 0, `C B` on others |
//! | scale launches | `C` per rank | `C` on rank `P-1` |
//! | scratch memory | `(P-1)` slots (`P` on ranks `>= 2`) of `ceil(N/(CP))` rounded to 4: about `N (P-1)/P` by default | one chunk, `N/16` (min 1 MiB) by default, none on rank 0 |
//!
//! On two GPUs a fixed-order reduction of one chunk is therefore exactly:
//! one group moving `N/2` each way, one fold kernel reading `N` and writing
//! `N/2` (ranks 0 and 1 accumulate into their own shard, no copy), one
//! scale kernel over `N/2`, one group moving `N/2` each way; the same bytes
//! on the links as NCCL's ring all-reduce, plus `2.5 N` elements (`10 N`
//! bytes) of HBM traffic per rank for the arithmetic, and two host waits
//! (the communicator completes each group before returning). Everything
//! runs on the communicator's stream. Under `NcclSum`: one library
//! all-reduce plus one scale launch (and `B - 1` block folds for `L > P`).
//!
//! Memory with `L > P`: the caller holds its `L/P` arenas (that is what a
//! process running `L/P` logical ranks needs anyway); the reducer adds only
//! the one-chunk prefix buffer, and `local[0]` is overwritten with the
//! mean while the other arenas are left as they were.
//!
//! `any` is one `i32` max all-reduce. `all_reduce_host` and the agreement
//! check all-gather the values with one group (`P - 1` sends and receives
//! per rank) and fold ascending on the host.

mod contract;
mod device;
mod emulated;
mod error;
mod exec;
mod fold;
mod host;
mod identity;
mod nccl;
mod plan;
mod reducer;
mod shard;

pub use contract::ReduceContract;
pub use device::KernelFold;
pub use emulated::{Delivery, EmulateOptions, EmulatedWorld, EmulatorMemory};
pub use error::{ReduceError, Result};
pub use fold::{host_accumulate, host_fold, host_mean, host_scale, mean_factor, FoldOps, HostFold};
pub use host::HostReducer;
pub use identity::RunIdentity;
pub use nccl::NcclReducer;
pub use plan::{Dataflow, PlanCost, RankPlan};
pub use reducer::{Reducer, ReducerOptions, TransportReducer};
pub use shard::ShardPlan;
