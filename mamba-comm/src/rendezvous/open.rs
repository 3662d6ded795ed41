//! Choosing the rendezvous a [`WorldPlace`] calls for.

use std::time::Duration;

use super::{FileRendezvous, LaunchSecret, MemoryRendezvous, Rendezvous, TcpRendezvous};
use crate::bootstrap::WorldPlace;
use crate::{CommError, Result};

/// Open the rendezvous of this launch:
/// - a world of one: in memory (nobody to meet);
/// - a rendezvous directory with a supervisor's launch id: the files under
///   `<root>/<job>/<launch_id>/`;
/// - a rendezvous directory without one: the same, after the launch-nonce
///   handshake ([`FileRendezvous::join`], waits up to `timeout` for all
///   ranks);
/// - otherwise `MASTER_ADDR`/port: the TCP store served by rank 0 (keep
///   rank 0's handle alive until every rank is done with it).
pub fn open(place: &WorldPlace, timeout: Duration) -> Result<Box<dyn Rendezvous>> {
    if place.world == 1 {
        return Ok(Box::new(MemoryRendezvous::solo()));
    }
    if let Some(root) = &place.rendezvous_dir {
        let r: Box<dyn Rendezvous> = match &place.launch_id {
            Some(launch) => Box::new(FileRendezvous::with_launch_id(
                root,
                &place.job_id,
                launch,
                place.rank,
                place.world,
            )?),
            None => Box::new(FileRendezvous::join(
                root,
                &place.job_id,
                place.rank,
                place.world,
                timeout,
            )?),
        };
        return Ok(r);
    }
    if let Some((host, port)) = &place.master {
        return Ok(Box::new(TcpRendezvous::new(
            host,
            *port,
            place.rank,
            place.world,
            LaunchSecret::of_job(&place.job_id),
            timeout,
        )?));
    }
    Err(CommError::config(format!(
        "a world of {} ranks needs a rendezvous: set MAMBA_RENDEZVOUS_DIR (a directory every rank \
         sees) or MASTER_ADDR and MASTER_PORT",
        place.world
    )))
}
