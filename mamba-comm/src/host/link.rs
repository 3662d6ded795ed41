//! What a socket world's transport shares with its link threads: per-link
//! counters and flags, and the writers' completion reports. (Thread worlds
//! have no link threads.)

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

use crossbeam_channel::Receiver;

use super::message::OpCode;

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
    /// Which receive the engine waits for on this link (see [`Gate`]).
    pub(crate) gate: Gate,
}

/// The receive the engine is waiting for on one link: the `index`-th data
/// message from the peer (counted from 0 over the link's life), which must
/// be a `op` message of at most `limit` values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Wanted {
    pub(crate) index: u64,
    pub(crate) op: OpCode,
    pub(crate) limit: usize,
}

/// How a link's reader learns what the receive a large frame belongs to
/// expects, before it reads (and allocates for) the frame's payload.
///
/// Frames from one peer arrive in send order and the engine takes them in
/// that order, so the reader's `n`-th data frame is the engine's `n`-th
/// receive from that peer: the reader holds a large frame until the engine
/// publishes [`Wanted`] with that index, then compares lengths. Holding a
/// frame only delays this link (the peer's sends are queued by its writer
/// thread and never block its program). Once the transport is done
/// ([`Gate::close`]) every held frame is dropped.
#[derive(Debug, Default)]
pub(crate) struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct GateState {
    wanted: Option<Wanted>,
    closed: bool,
}

impl Gate {
    fn lock(&self) -> MutexGuard<'_, GateState> {
        // The state is two plain fields, valid after any panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The engine now waits for `w`.
    pub(crate) fn want(&self, w: Wanted) {
        self.lock().wanted = Some(w);
        self.changed.notify_all();
    }

    /// The engine will take nothing more: release a waiting reader.
    pub(crate) fn close(&self) {
        self.lock().closed = true;
        self.changed.notify_all();
    }

    /// Block until the engine waits for data message `index` (its
    /// expectation) or the transport is done (`None`).
    pub(crate) fn wait_for(&self, index: u64) -> Option<Wanted> {
        let mut st = self.lock();
        loop {
            if st.closed {
                return None;
            }
            if let Some(w) = st.wanted.filter(|w| w.index == index) {
                return Some(w);
            }
            st = self.changed.wait(st).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Writer threads of a socket world: each sends one report on `done` when it
/// has flushed and closed its half of the connection (or failed).
pub(crate) struct Writers {
    pub(crate) done: Receiver<std::result::Result<(), String>>,
    pub(crate) count: usize,
    /// Per peer (None at this rank's index).
    pub(crate) links: Vec<Option<Arc<LinkStats>>>,
}
