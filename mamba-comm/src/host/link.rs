//! What a socket world's transport shares with its link threads: per-link
//! counters and flags, and the writers' completion reports. (Thread worlds
//! have no link threads.)

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;

use crossbeam_channel::Receiver;

/// What the threads of one socket link share with the transport.
#[derive(Debug, Default)]
pub(crate) struct LinkStats {
    /// Events written *and flushed* to the socket by the writer thread.
    pub(crate) flushed: AtomicU64,
    /// The writer thread has ended (flushed and closed, or failed).
    pub(crate) finished: AtomicBool,
    /// The reader thread saw the peer's goodbye: errors on our side of the
    /// link after that cannot hurt the peer.
    pub(crate) peer_left: AtomicBool,
}

/// Writer threads of a socket world: each sends one report on `done` when it
/// has flushed and closed its half of the connection (or failed).
pub(crate) struct Writers {
    pub(crate) done: Receiver<std::result::Result<(), String>>,
    pub(crate) count: usize,
    /// Per peer (None at this rank's index).
    pub(crate) links: Vec<Option<Arc<LinkStats>>>,
}
