//! `mamba-comm`: a fail-fast communicator and the world around it.
//!
//! Layers, bottom up:
//! - [`transport::Transport`]: the byte-movement interface (send, recv,
//!   broadcast, group, sum/max all-reduce, barrier) shared by NCCL and the
//!   host transport;
//! - [`rendezvous::Rendezvous`]: how ranks of one launch meet;
//! - the NCCL communicator, the host transport, the launcher bootstrap and the
//!   self-spawn supervisor;
//! - [`flight`]: the flight recorder (every rank's last collective calls,
//!   written out on failure and read by the supervisor);
//! - [`world_abort`]: how a rank that fails outside a collective stops the
//!   peers already waiting in one, naming itself.

pub mod bootstrap;
pub mod error;
pub mod flight;
pub mod host;
pub mod ipc;
pub mod nccl;
mod poll;
pub mod rendezvous;
pub mod stop_signal;
pub mod supervisor;
pub mod transport;
pub mod world_abort;

pub use error::{CommError, Result};
pub use rendezvous::Rendezvous;
pub use transport::Transport;
