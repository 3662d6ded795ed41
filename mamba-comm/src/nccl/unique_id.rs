//! The unique-id exchange: rank 0 asks NCCL for a fresh 128-byte id and
//! publishes it; every other rank fetches exactly 128 bytes before the
//! deadline. The rendezvous does the atomic publish (temporary file, then
//! rename) and the deadline polling; this module decides who does what and
//! checks what comes back.

use std::time::Instant;

use super::api::NcclApi;
use super::{UNIQUE_ID_BYTES, UNIQUE_ID_KEY};
use crate::{CommError, Rendezvous, Result};

/// This rank's copy of the world's unique id.
pub(crate) fn exchange(
    api: &dyn NcclApi,
    rank: usize,
    rdv: &dyn Rendezvous,
    deadline: Instant,
) -> Result<[u8; 128]> {
    if rank == 0 {
        let id = api.unique_id().map_err(|e| {
            CommError::transport(
                "init",
                format!("ncclGetUniqueId failed on rank 0: {} (check NCCL_SOCKET_IFNAME and the network)", api.error_string(e.0)),
            )
        })?;
        rdv.publish(UNIQUE_ID_KEY, &id)?;
        return Ok(id);
    }
    let left = deadline.saturating_duration_since(Instant::now());
    let bytes = rdv.fetch(UNIQUE_ID_KEY, UNIQUE_ID_BYTES, left)?;
    let n = bytes.len();
    bytes.try_into().map_err(|_| {
        CommError::transport(
            "init",
            format!(
                "rank {rank}: the unique id fetched from the rendezvous has {n} bytes; expected \
                 {UNIQUE_ID_BYTES}"
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;
    use crate::nccl::fake::{FakeNccl, Script};
    use crate::rendezvous::MemoryRendezvous;

    #[test]
    fn every_rank_gets_rank_zeros_id() {
        let fake = FakeNccl::new(Script::default());
        let rdvs = MemoryRendezvous::world(3);
        let deadline = Instant::now() + Duration::from_secs(20);
        let ids: Vec<[u8; 128]> = std::thread::scope(|s| {
            let hs: Vec<_> = rdvs
                .iter()
                .enumerate()
                .rev() // the fetching ranks start first and must wait
                .map(|(r, rdv)| {
                    let fake = Arc::clone(&fake);
                    s.spawn(move || exchange(&*fake, r, rdv, deadline).expect("exchange"))
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        assert!(ids.iter().all(|id| *id == ids[0]));
        assert!(ids[0].iter().any(|&b| b != 0));
    }

    #[test]
    fn a_missing_rank_zero_is_a_rendezvous_error_at_the_deadline() {
        let fake = FakeNccl::new(Script::default());
        let rdvs = MemoryRendezvous::world(2);
        let start = Instant::now();
        let err = exchange(&*fake, 1, &rdvs[1], start + Duration::from_millis(200)).unwrap_err();
        let took = start.elapsed();
        assert!(
            took >= Duration::from_millis(150) && took < Duration::from_secs(2),
            "{took:?}"
        );
        match err {
            CommError::Rendezvous { rank, .. } => assert_eq!(rank, 1),
            other => panic!("expected a rendezvous error, got {other:?}"),
        }
    }
}
