//! A failed operation of the host transport, and whom to blame for it.

use crate::CommError;

/// An error on the way out of an operation, and the rank at the root of it
/// (announced to every peer).
///
/// Every failing rank announces the *root* culprit — also when it only
/// learned of the failure from another rank's abort — before it can exit.
/// Frames on a link arrive in order, so a peer that sees this rank's
/// connection close has first read the abort naming the root culprit, and a
/// chain of departures never turns into blame for the ranks that merely
/// reacted.
pub(super) struct Fault {
    pub(super) err: CommError,
    pub(super) tell: usize,
}

impl Fault {
    /// A caller's mistake on `rank` (this rank is to blame).
    pub(super) fn config(rank: usize, detail: String) -> Fault {
        Fault {
            err: CommError::config(detail),
            tell: rank,
        }
    }

    /// Peer `rank` failed (died, left, or aborted the world): it is to blame.
    pub(super) fn peer(rank: usize, detail: String) -> Fault {
        Fault {
            err: CommError::PeerFailed { rank, detail },
            tell: rank,
        }
    }

    /// `op` failed because of peer `tell` (it stopped answering, or called
    /// another operation or size).
    pub(super) fn transport(op: &str, detail: String, tell: usize) -> Fault {
        Fault {
            err: CommError::transport(op, detail),
            tell,
        }
    }
}
