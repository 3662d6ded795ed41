//! GPU worlds: each rank a process on its own GPU holding the CUDA model
//! ([`CudaReplica`]), linked by an NCCL communicator and reducing through
//! [`mamba_reduce::NcclReducer`] ([`link`]).
//!
//! One stream per rank carries everything: the communicator's
//! ([`mamba_comm::nccl::NcclComm::stream`]), which the model is built on
//! ([`crate::model::cuda::CudaModel::with_stream`]), so forward/backward,
//! the reduction and the optimizer are ordered by the stream alone.
//!
//! A world of one (one GPU) runs the same path through a 1-rank
//! communicator: the same reducer and the same fixed-order plan as every
//! `P`, which is what makes its weights the bits of `--world P` at the
//! same logical world `L`.
//!
//! Setup order on every rank ([`crate::cli::run`]): [`link::preflight`]
//! (driver, devices, kernels, NCCL), [`link::rank_device`], the run and
//! checkpoint, [`link::connect`] (rendezvous + `NcclComm::init`), the model
//! on the communicator's stream, the replica, [`link::reducer`]; at the end
//! of a successful run [`link::shutdown`] (finalize, destroy). The
//! self-spawning supervisor runs [`link::preflight`] and
//! [`link::check_world_fits`] before it starts any rank.

pub mod link;
pub mod replica;

pub use link::{check_world_fits, connect, preflight, rank_device, CudaLink, GpuHost};
pub use replica::CudaReplica;
