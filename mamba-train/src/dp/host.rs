//! CPU worlds: each rank a process (or, in tests, a thread) holding the CPU
//! model, linked by the host transport.

use std::time::Duration;

use mamba_comm::bootstrap::WorldPlace;
use mamba_comm::host::{HostOptions, HostTransport};
use mamba_comm::rendezvous::{self, Rendezvous};
use mamba_reduce::{HostReducer, ReducerOptions};

use super::{DataParallel, DpOptions};
use crate::error::Result;
use crate::train::{Backend, RunConfig, Trainer};

/// Values every rank may receive in one message whatever the arena: the
/// host all-gathers of a world of up to tens of thousands of ranks.
pub const SMALL_MESSAGES: usize = 1 << 20;

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
///
/// `arena_len` bounds what a peer may send in one message: no message of
/// the trainer's carries more than one arena (a shard, a chunk, the
/// running prefix), and the host values it gathers (losses, the replica
/// check, the agreement record) stay far below [`SMALL_MESSAGES`]; a
/// larger claim is refused before it is read.
pub fn connect(place: &WorldPlace, timeout: Duration, arena_len: usize) -> Result<HostLink> {
    let rendezvous = rendezvous::open(place, timeout)?;
    let opts = HostOptions {
        tag: HOST_TAG.to_string(),
        max_values: arena_len.max(SMALL_MESSAGES),
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

/// A single process as a one-rank world: `trainer` with the host reducer
/// over a one-rank in-process transport. The same loop (and so the same
/// bits) as `--world P` at the trainer's logical world, with no process or
/// socket around it: what the library offers for training in one process.
pub fn local<B: Backend<Arena = Vec<f32>>>(
    trainer: Trainer<B>,
    opts: DpOptions,
) -> Result<DataParallel<B, HostReducer>> {
    let mut world =
        HostTransport::thread_world(1, HostOptions::with_timeout(Duration::from_secs(60)))?;
    let transport = world.pop().ok_or_else(|| {
        crate::error::TrainError::Config("a one-rank host world has no rank".into())
    })?;
    let reducer = reducer(transport, trainer.run_config());
    DataParallel::new(trainer, reducer, opts)
}
