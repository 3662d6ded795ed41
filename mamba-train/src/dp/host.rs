//! CPU worlds: each rank a process (or, in tests, a thread) holding the CPU
//! model, linked by the host transport.

use std::time::Duration;

use mamba_comm::bootstrap::WorldPlace;
use mamba_comm::host::{HostOptions, HostTransport};
use mamba_comm::rendezvous::{self, Rendezvous};
use mamba_reduce::{HostReducer, ReducerOptions};

use crate::error::Result;
use crate::train::RunConfig;

/// Rendezvous-key prefix of the trainer's host transport.
pub const HOST_TAG: &str = "mamba-train-host";

/// This process's link to a CPU world.
///
/// Ownership: the rendezvous is kept for the transport's lifetime (under
/// a TCP rendezvous rank 0 serves the store, and peers may still be
/// connecting through it). Dropping the transport says goodbye to every
/// peer, so a rank that finishes early is not mistaken for a failed one.
pub struct HostLink {
    /// The rendezvous the ranks met through.
    pub rendezvous: Box<dyn Rendezvous>,
    /// This rank's transport.
    pub transport: HostTransport,
}

/// Meet the other ranks of `place` and connect to them over loopback TCP
/// (a world of one needs nobody). `timeout` bounds the meeting and every
/// later wait on a peer.
pub fn connect(place: &WorldPlace, timeout: Duration) -> Result<HostLink> {
    let rendezvous = rendezvous::open(place, timeout)?;
    let opts = HostOptions {
        tag: HOST_TAG.to_string(),
        ..HostOptions::with_timeout(timeout)
    };
    let transport = HostTransport::connect(&*rendezvous, opts)?;
    Ok(HostLink {
        rendezvous,
        transport,
    })
}

/// The reducer of `run` (its contract and logical world) over `transport`.
pub fn reducer(transport: HostTransport, run: &RunConfig) -> HostReducer {
    HostReducer::new(
        transport,
        ReducerOptions::new(run.contract, run.logical_world),
    )
}
