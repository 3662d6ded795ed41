//! The all-gather of owned ranges that ZeRO-1's updated weight shards
//! travel back by: bytes only, no arithmetic, so no contract is involved.

use std::ops::Range;

use mamba_comm::Transport;

use crate::{ReduceError, Result};

/// Every rank's `owned[rank]` range of `buf` to every peer, and every
/// peer's range in, as one group (see
/// [`Reducer::all_gather_ranges`](crate::Reducer::all_gather_ranges)).
/// When the ranges tile the buffer, each rank sends and receives `(P-1)/P`
/// of it: a ring all-gather's bytes. Empty ranges send nothing. Ranges are
/// checked against the buffer before anything moves, so a bad range fails
/// this rank without a half-finished group.
pub fn all_gather_ranges<T: Transport>(
    t: &mut T,
    buf: &mut T::Buffer,
    owned: &[Range<usize>],
) -> Result<()> {
    let (world, rank) = (t.world(), t.rank());
    if owned.len() != world {
        return Err(ReduceError::config(format!(
            "all_gather_ranges got {} ranges on rank {rank}; a world of {world} needs one per rank",
            owned.len()
        )));
    }
    let len = T::buffer_len(buf);
    if let Some((k, r)) = owned
        .iter()
        .enumerate()
        .find(|(_, r)| r.start > r.end || r.end > len)
    {
        return Err(ReduceError::config(format!(
            "all_gather_ranges: rank {k}'s range {r:?} lies outside the {len}-element buffer"
        )));
    }
    if world == 1 {
        return Ok(());
    }
    let mine = owned[rank].clone();
    t.group(&mut [&mut *buf], |g| {
        // Sends before receives: portable on both transports.
        for peer in (0..world).filter(|&p| p != rank) {
            if !mine.is_empty() {
                g.send(0, mine.clone(), peer)?;
            }
        }
        for peer in (0..world).filter(|&p| p != rank) {
            if !owned[peer].is_empty() {
                g.recv(0, owned[peer].clone(), peer)?;
            }
        }
        Ok(())
    })?;
    Ok(())
}
