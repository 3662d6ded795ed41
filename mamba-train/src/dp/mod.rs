//! Data-parallel training: one model replica per process, one gradient
//! reduction per step, the same bits for every number of processes.
//!
//! # Step semantics
//!
//! A step's global batch is `L` logical micro-batches (the logical world),
//! drawn by the rank-free seed law: micro-batch `j` of step `s` is a pure
//! function of `(seed, s, j)`. Process `p` of `P` (P divides L) computes
//! micro-batches `p*L/P .. (p+1)*L/P`, each gradient in its own arena; the
//! [`Reducer`](mamba_reduce::Reducer) folds all `L` in ascending logical
//! order (`((g0 + g1) + g2) + ...`, then times `fl(1/L)`; under
//! `fixed-tree` the complete binary tree over the `L` in logical order,
//! whose lower levels each process folds as its micro-batches finish, so it
//! keeps `log2(L/P) + 1` gradient arenas instead of `L/P`); every rank then
//! clips and steps AdamW on the same mean, so every rank holds the same
//! weights after every step. The logged loss is the ascending fold of the
//! `L` micro losses (under every contract: one value per micro-batch, no
//! memory to save). Under the fixed-order and fixed-tree contracts all of
//! this is the single-process [`Trainer`](crate::train::Trainer)'s step
//! with `logical_world = L`, bit for bit, for every `P`.
//!
//! # What the trainer guarantees
//!
//! | change between two runs | `fixed-order`, `fixed-tree` | `nccl-sum` |
//! |---|---|---|
//! | re-run, same machine and build | same bits | same bits |
//! | CPU thread count (`--threads`) | same bits | same bits |
//! | physical world `P` at a fixed `L` (1, 2, 4, ... processes) | same bits | may differ (P < L: block sums are added by the library) |
//! | launcher (self-spawn, torchrun, srun, mpirun) | same bits | same bits at the same P |
//! | stop and resume, also at another `P` | same bits | same bits at the same P, on a frozen machine |
//! | `--shard-optimizer` (ZeRO-1) on or off, at any `P` | same bits | same bits at the same P (each owner updates from the same library sum) |
//! | logical world `L` | differs (part of the run's identity) | differs |
//! | contract (`fixed-order` vs `fixed-tree`) | differs (part of the run's identity) | — |
//! | device (CPU vs CUDA) | differs (different kernels) | differs |
//! | GPU model or build (CUDA) | may differ (per-rank kernels, cuBLAS) | may differ |
//!
//! Host-transport specifics (measured by the tests, not promised): under
//! `nccl-sum` the host transport sums in ascending rank order, so with
//! `P = L` or `P = 1` it equals `fixed-order`; with `1 < P < L` it differs.
//!
//! # Faults
//!
//! - A non-finite loss or gradient on any rank skips the step on every rank
//!   (agreed through [`Reducer::any`](mamba_reduce::Reducer::any)); the
//!   step still advances and is counted (`skipped`, `skipped_steps` in the
//!   metrics).
//! - A rank that dies: the host transport fails every peer at its next wait
//!   with [`CommError::PeerFailed`]
//!   naming it; the supervisor (or launcher) ends the world.
//! - A GPU rank that fails outside a collective (its optimizer step, a
//!   checkpoint write, its model's allocation) posts its error to the
//!   world abort ([`world_abort`]) on its way out; every peer's NCCL wait
//!   watches it and fails within about 250 ms with
//!   [`CommError::PeerFailed`] naming that rank, instead of waiting for
//!   `--comm-timeout` (what a launcher that does not kill the world on the
//!   first exit, or a multi-node world, would otherwise do). Checkpoints are
//!   written atomically by rank 0, so the last one is intact and resumable.
//! - The replica check ([`DataParallel::replica_check`]) compares every
//!   rank's weights digest and step: at the start, every
//!   `--replica-check-every` steps, before every checkpoint and at the end;
//!   a difference is
//!   [`CommError::ReplicaDivergence`]
//!   on every rank.
//!
//! Test hooks that inject these faults are in `fault_hooks` (compiled only
//! with the `fault-injection` feature, which test builds turn on).
//!
//! # Running
//!
//! ```text
//! mamba-train train                                  # one process, CPU, L = 1
//! mamba-train train --logical-world 4                # one process, L = 4 (same bits as --world 4)
//! mamba-train train --world 4                        # 4 CPU processes (self-spawned), L = 4
//! mamba-train train --world 2 --resume runs/latest   # continue that run on 2 processes, same bits
//! mamba-train train --world 2 --logical-world 8 --contract nccl-sum
//! mamba-train train --world 4 --shard-optimizer      # ZeRO-1 (see [`zero`]): same bits
//! mamba-train train --world 2 --logical-world 64 --contract fixed-tree  # 6 gradient arenas, not 32
//! mamba-train train --device cuda                    # one GPU (a 1-rank NCCL world), L = 1
//! mamba-train train --device cuda --world 2          # two GPUs, one process each, L = 2
//! mamba-train train --device cuda --logical-world 2  # one GPU, the same bits as --world 2
//! mamba-train train --device cuda --world 2 --peer-fold  # the fold over mapped peer memory, same bits
//!
//! # under a launcher the launcher's world is used (--world, if given, must match):
//! torchrun --standalone --nproc-per-node 2 --no-python mamba-train train --device cuda
//! srun --ntasks-per-node 2 --gpus-per-node 2 mamba-train train --device cuda
//! mpirun -np 2 -x NCCL_NVLS_ENABLE mamba-train train --device cuda
//! ```
//!
//! Rank 0 alone writes the run directory, the progress and stdout (whose
//! last line is `weights-digest: <hex>`); every other rank prints
//! `[rank R of P] weights-digest: <hex>` on stderr, the same digest
//! (checked). Under a launcher on several nodes, `--resume` must name a
//! directory every rank can read, and the ranks meet through
//! `MASTER_ADDR`/`MASTER_PORT` (or a shared `MAMBA_RENDEZVOUS_DIR`). CPU
//! worlds use loopback sockets: one machine.
//!
//! # Backends
//!
//! [`DataParallel`] drives the one engine, [`Trainer`](crate::train::Trainer),
//! over any [`Backend`](crate::train::Backend), with a reducer whose
//! buffers are the backend's arenas: the CPU model over host arenas with
//! [`mamba_reduce::HostReducer`] ([`host`]), or the CUDA model over device
//! arenas (`CudaSlice<f32>`, its optimizer on the device too) with
//! [`mamba_reduce::NcclReducer`] over one NCCL communicator per rank, one
//! GPU per rank ([`cuda`]); with `--peer-fold`, [`mamba_reduce::PeerReducer`]
//! over that reducer (the fold over the node's mapped arenas, NCCL for the
//! host collectives only). `--device cuda` at `P = 1` runs the same path
//! over a 1-rank communicator, so its bits are those of every `P` at the
//! same `L`.

pub mod cuda;
pub mod engine;
#[cfg(feature = "fault-injection")]
pub mod fault_hooks;
pub mod host;
pub mod replica_check;
pub mod world_abort;
pub mod zero;
#[cfg(test)]
mod zero_tests;

pub use engine::{DataParallel, DpOptions};
#[cfg(feature = "fault-injection")]
pub use fault_hooks::FaultHooks;
pub use replica_check::ReplicaState;
pub use zero::ZeroShards;

use mamba_comm::CommError;
use mamba_reduce::ReduceError;

use crate::error::TrainError;

/// A reducer error as the trainer's: transport failures (a dead peer,
/// a deadline) keep their [`CommError`]; ranks that disagree on the run
/// are configuration errors.
pub fn reduce_err(e: ReduceError) -> TrainError {
    match e {
        ReduceError::Comm(c) => TrainError::Comm(c),
        ReduceError::Kernel(k) => TrainError::Kernel(k),
        ReduceError::Device { op, detail } => TrainError::Cuda { what: op, detail },
        ReduceError::Config(s) => TrainError::Config(format!("gradient reduction: {s}")),
        ReduceError::Disagreement { detail } => {
            TrainError::Config(format!("the ranks disagree on the run: {detail}"))
        }
        ReduceError::Invariant(s) => TrainError::Comm(CommError::transport(
            "gradient reduction",
            format!("internal error in mamba-reduce (please report): {s}"),
        )),
    }
}
