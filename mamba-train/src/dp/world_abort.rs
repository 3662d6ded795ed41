//! A GPU rank's own failure, posted to the world abort
//! ([`mamba_comm::world_abort`]) on its way out, so that peers already
//! waiting in a collective fail at once naming it instead of waiting for
//! `--comm-timeout`.
//!
//! Which failures post: every error of the rank's own (a CUDA error, a
//! checkpoint it could not write, a disagreement it found), not those that
//! report someone else's: [`CommError::PeerFailed`] (this rank is a victim;
//! posting would blame it) and stop requests (no failure at all). With
//! `--peer-fold` the same failures are also posted to the peers' flags
//! ([`mamba_reduce::PeerReducer::abort`]), for a peer already waiting in a
//! peer-fold barrier rather than in NCCL. CPU
//! worlds need no board: the host transport carries a departed or aborting
//! rank to every peer in-band.

use mamba_comm::world_abort::post_abort;
use mamba_comm::{CommError, Rendezvous};

use crate::error::TrainError;

/// True when `e` is this rank's own failure (see the module docs).
pub fn is_own_failure(e: &TrainError) -> bool {
    !matches!(
        e,
        TrainError::Comm(CommError::PeerFailed { .. } | CommError::Stopped { .. })
            | TrainError::Stopped { .. }
    )
}

/// Post `e` through `rdv` when it is this rank's own failure; `Ok(true)`
/// when it was posted (or another rank's record was already there, which
/// stays). An error is the rendezvous's: report it as a warning, the
/// rank's own error is the one to return.
pub fn post_failure(rdv: &dyn Rendezvous, e: &TrainError) -> mamba_comm::Result<bool> {
    if !is_own_failure(e) {
        return Ok(false);
    }
    post_abort(rdv, &e.to_string())?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use mamba_comm::rendezvous::MemoryRendezvous;
    use mamba_comm::world_abort::posted_abort;

    use super::*;

    #[test]
    fn own_failures_are_posted_and_read_by_the_peers_naming_this_rank() {
        let w = MemoryRendezvous::world(2);
        let e = TrainError::Cuda {
            what: "stepping AdamW".into(),
            detail: "CUDA_ERROR_OUT_OF_MEMORY".into(),
        };
        assert!(post_failure(&w[1], &e).unwrap());
        let got = posted_abort(&w[0]).unwrap().expect("posted");
        assert_eq!(got.rank, 1);
        assert_eq!(got.detail, e.to_string());
    }

    #[test]
    fn reports_of_another_ranks_failure_and_stops_are_not_posted() {
        let victims = [
            TrainError::Comm(CommError::PeerFailed {
                rank: 0,
                detail: "rank 0 exited".into(),
            }),
            TrainError::Comm(CommError::Stopped { signal: 15 }),
            TrainError::Stopped {
                signal: 2,
                rank: 0,
                step: 3,
                detail: String::new(),
            },
        ];
        let w = MemoryRendezvous::world(2);
        for e in &victims {
            assert!(!is_own_failure(e), "{e}");
            assert!(!post_failure(&w[1], e).unwrap(), "{e}");
        }
        assert_eq!(
            posted_abort(&w[0]).unwrap(),
            None,
            "nothing may be on the board"
        );
        // Negative control: the same board does carry an own failure.
        let own = TrainError::Config("the ranks disagree on the run".into());
        assert!(post_failure(&w[1], &own).unwrap());
        assert!(posted_abort(&w[0]).unwrap().is_some());
    }
}
