//! The host transport: [`Transport`](crate::Transport) over host memory, for
//! CPU worlds and for testing every layer above without GPUs.
//!
//! Two ways to build a world:
//! - [`HostTransport::thread_world`]: one transport per thread of this
//!   process, linked by channels;
//! - [`HostTransport::connect`]: one transport per process, linked by TCP
//!   sockets (loopback by default), peers found through a
//!   [`Rendezvous`](crate::Rendezvous).
//!
//! Both share one engine, so they behave the same:
//! - **Sends never block.** A send copies the values into an unbounded queue
//!   (a channel to the peer's inbox, or to the writer thread of the peer's
//!   socket). Receives complete in program order; each waits only for its
//!   own data.
//! - **Groups.** [`Transport::group`](crate::Transport::group) runs its body
//!   eagerly. Because sends never block, any group in which each rank issues
//!   its sends before the receives that depend on them completes; a group in
//!   which two ranks each *first* wait for the other is not rescued (NCCL
//!   would match it as a unit) and fails at the deadline with an error naming
//!   the op and peer. Issue a group's sends first.
//! - **Deadlines.** Every wait ends by [`HostOptions::timeout`]; a peer that
//!   sends nothing in time is a [`CommError::Transport`](crate::CommError)
//!   error naming the operation and the peer.
//! - **Fail fast.** A peer whose socket closes without a goodbye (killed,
//!   crashed) is a [`CommError::PeerFailed`](crate::CommError) naming it, at
//!   once, whichever peer this rank was waiting for. A rank that hits any
//!   error tells every peer (an abort naming the culprit), so the whole world
//!   stops within one deadline at most, usually at once.
//! - **Orderly leave.** Dropping a transport (or
//!   [`HostTransport::shutdown`]) says goodbye to every peer; a peer that
//!   later waits for a message from a rank that left gets an error at once.
//!
//! # Arithmetic
//!
//! `all_reduce_sum_f32` is the host's "library sum" tier: its summation
//! order is *unspecified by contract*, exactly as NCCL's. (Today it gathers
//! to rank 0, adds contributions in ascending rank order and sends the result
//! back, so it is deterministic, but callers that need a fixed order must use
//! the fixed-order reducer in `mamba-reduce`, not this.) `all_reduce_max_i32`
//! is exact. All values move as bit patterns.

mod engine;
mod fault;
mod link;
mod message;
mod ops;
mod socket;

pub use engine::HostTransport;

use std::net::{IpAddr, Ipv4Addr};
use std::time::Duration;

/// Settings of a host transport.
#[derive(Clone, Debug)]
pub struct HostOptions {
    /// Deadline of every wait: one receive, or one collective as a whole
    /// (followers of a collective wait a quarter longer so that the leader,
    /// which sees who is missing, reports the culprit first). Also bounds
    /// connecting and the flush at shutdown. Must exceed the longest time one
    /// rank may compute while others already wait (e.g. an unbalanced step).
    pub timeout: Duration,
    /// Address each process listens on and advertises to its peers
    /// (socket worlds only). Loopback by default: all ranks on one host.
    pub bind: IpAddr,
    /// Prefix of the rendezvous keys used to exchange addresses, so several
    /// transports can be built over one rendezvous (each needs its own tag).
    pub tag: String,
    /// The most values one message from a peer may carry (socket worlds):
    /// a frame claiming more is refused before it is read, naming the
    /// peer. Set it to the largest buffer this rank receives (a trainer:
    /// its arena length); the default (2^32 values, 16 GiB of f32) only
    /// stops absurd lengths. Payloads are read in pieces either way, so a
    /// peer's header alone never decides an allocation.
    pub max_values: usize,
}

impl Default for HostOptions {
    /// 300 s deadline (as NCCL's collective deadline), loopback, tag "host".
    fn default() -> Self {
        HostOptions {
            timeout: Duration::from_secs(300),
            bind: IpAddr::V4(Ipv4Addr::LOCALHOST),
            tag: "host".to_string(),
            max_values: 1 << 32,
        }
    }
}

impl HostOptions {
    /// Default options with the given deadline.
    pub fn with_timeout(timeout: Duration) -> Self {
        HostOptions {
            timeout,
            ..HostOptions::default()
        }
    }
}
