//! The world abort: how a rank that fails *outside* a collective (a CUDA
//! error in its optimizer step, a checkpoint it cannot write, a model it
//! cannot allocate) stops peers that already wait in one, at once and
//! naming it, instead of leaving them to the collective watchdog.
//!
//! Inside a collective every failure already travels: NCCL reports its own
//! errors, the host transport sends abort frames, the engine passes a local
//! phase's failure on the step's first collective. What none of them covers
//! is a rank that simply stops calling: its peers' next collective can only
//! time out. Launchers that kill the world on the first exit (the
//! self-spawn supervisor, single-node torchrun, `mpirun`) hide this; SLURM
//! without `--kill-on-bad-exit` and multi-node launches do not.
//!
//! The channel is the launch's own [rendezvous](crate::rendezvous), which
//! every rank keeps open for the whole run (the file directory, or rank 0's
//! TCP store):
//! - the failing rank calls [`post_abort`] before it exits: one value
//!   under [`WORLD_ABORT_KEY`], its rank and the error's text;
//! - every rank runs an [`AbortWatch`]: a thread that peeks at the key
//!   every [`WATCH_PERIOD`] and remembers the first record posted by
//!   another rank. The NCCL communicator's waits read that memory (no I/O
//!   in the wait loop) and fail with [`CommError::PeerFailed`] naming the
//!   poster, within about one period of the post.
//!
//! What is *not* an abort: a rendezvous that can no longer be read (rank
//! 0's store gone at the end of a run is normal) stops the watch and leaves
//! the wait to its watchdog; so does a record this rank posted itself. A
//! rank whose failure is a report of another rank's (a [`PeerFailed`] or a
//! stop request) should not post: the board names culprits, not victims.
//! The first record stays: [`post_abort`] does not overwrite one that is
//! already there (two ranks failing at the same instant may still race; the
//! board then names one of them, both genuinely failed).
//!
//! [`PeerFailed`]: CommError::PeerFailed

use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::Duration;

use crate::{CommError, Rendezvous, Result};

/// The rendezvous key of the world's abort record.
pub const WORLD_ABORT_KEY: &str = "world-abort";

/// How often an [`AbortWatch`] peeks at the rendezvous: a posted abort is
/// seen by a waiting peer within about this long. One small read per
/// period per rank (a file read, or a round trip to rank 0's store).
pub const WATCH_PERIOD: Duration = Duration::from_millis(250);

/// Longest error text a record carries (longer text is cut at a character
/// boundary): the store's values are bounded, and the peers' messages
/// should stay readable.
const MAX_DETAIL: usize = 4096;

/// An abort posted by a rank: who failed and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PostedAbort {
    /// The rank that failed.
    pub rank: usize,
    /// Its error, as it reported it.
    pub detail: String,
}

impl PostedAbort {
    /// The record as stored: the rank (u32 LE), then the text (UTF-8).
    fn encode(&self) -> Vec<u8> {
        let mut detail = self.detail.as_str();
        if detail.len() > MAX_DETAIL {
            let mut end = MAX_DETAIL;
            while !detail.is_char_boundary(end) {
                end -= 1;
            }
            detail = &detail[..end];
        }
        let mut out = Vec::with_capacity(4 + detail.len());
        out.extend_from_slice(&(self.rank as u32).to_le_bytes());
        out.extend_from_slice(detail.as_bytes());
        out
    }

    /// A stored record, or `None` for bytes no [`post_abort`] wrote.
    fn decode(bytes: &[u8]) -> Option<PostedAbort> {
        let (rank, detail) = bytes.split_first_chunk::<4>()?;
        Some(PostedAbort {
            rank: u32::from_le_bytes(*rank) as usize,
            detail: String::from_utf8_lossy(detail).into_owned(),
        })
    }
}

/// Post this rank's failure to the world (see the [module docs](self)):
/// `detail` is what its peers will print after "rank R failed: ". Does
/// nothing when a record is already posted (the first failure is the one
/// the world reports).
///
/// Errors are the rendezvous's (e.g. rank 0's store is gone); a caller on
/// its way out reports them as a warning at most, since its own error is
/// the one that matters.
pub fn post_abort(rdv: &dyn Rendezvous, detail: &str) -> Result<()> {
    if rdv.peek(WORLD_ABORT_KEY)?.is_some() {
        return Ok(());
    }
    let record = PostedAbort {
        rank: rdv.rank(),
        detail: detail.to_string(),
    };
    rdv.publish(WORLD_ABORT_KEY, &record.encode())
}

/// The abort posted to `rdv` by a rank other than this one, if any, read
/// once now. `Err` when the rendezvous cannot be read.
pub fn posted_abort(rdv: &dyn Rendezvous) -> Result<Option<PostedAbort>> {
    let me = rdv.rank();
    Ok(rdv
        .peek(WORLD_ABORT_KEY)?
        .as_deref()
        .and_then(PostedAbort::decode)
        .filter(|a| a.rank != me))
}

/// A thread watching the rendezvous for another rank's abort (see the
/// [module docs](self)).
///
/// Ownership: the thread holds a clone of the rendezvous `Arc`; dropping the
/// watch wakes it at once and it exits, releasing the clone, after at most
/// the read it may be in. The thread never outlives a read of the
/// rendezvous by more than that, so rank 0's store stops within one read of
/// the watch's drop once its other owners are gone.
#[derive(Debug)]
pub struct AbortWatch {
    seen: Arc<OnceLock<PostedAbort>>,
    /// Dropped with the watch: the thread's `recv_timeout` wakes
    /// disconnected and returns.
    _stop: mpsc::Sender<()>,
}

impl AbortWatch {
    /// Start watching `rdv` every [`WATCH_PERIOD`].
    pub fn start(rdv: Arc<dyn Rendezvous>) -> Result<AbortWatch> {
        AbortWatch::with_period(rdv, WATCH_PERIOD)
    }

    /// Start watching `rdv` every `period` (tests use short ones).
    pub fn with_period(rdv: Arc<dyn Rendezvous>, period: Duration) -> Result<AbortWatch> {
        let seen = Arc::new(OnceLock::new());
        let (stop, stopped) = mpsc::channel::<()>();
        let found = seen.clone();
        let rank = rdv.rank();
        thread::Builder::new()
            .name(format!("mamba-abort-watch-{rank}"))
            .spawn(move || loop {
                match posted_abort(&*rdv) {
                    Ok(Some(abort)) => {
                        let _ = found.set(abort);
                        return;
                    }
                    Ok(None) => {}
                    // The rendezvous is gone (its end, or its host's): no
                    // more news can come this way; the watchdog decides.
                    Err(_) => return,
                }
                match stopped.recv_timeout(period) {
                    Err(RecvTimeoutError::Timeout) => {}
                    Ok(()) | Err(RecvTimeoutError::Disconnected) => return,
                }
            })
            .map_err(|e| {
                CommError::config(format!(
                    "rank {rank}: cannot start the world-abort watch thread: {e}"
                ))
            })?;
        Ok(AbortWatch { seen, _stop: stop })
    }

    /// The abort another rank posted, once the watch has seen one.
    pub fn posted(&self) -> Option<&PostedAbort> {
        self.seen.get()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::rendezvous::MemoryRendezvous;

    fn world(n: usize) -> Vec<Arc<dyn Rendezvous>> {
        MemoryRendezvous::world(n)
            .into_iter()
            .map(|r| Arc::new(r) as Arc<dyn Rendezvous>)
            .collect()
    }

    fn wait_for(watch: &AbortWatch, limit: Duration) -> Option<PostedAbort> {
        let until = Instant::now() + limit;
        while Instant::now() < until {
            if let Some(a) = watch.posted() {
                return Some(a.clone());
            }
            thread::sleep(Duration::from_millis(5));
        }
        None
    }

    #[test]
    fn a_posted_abort_reaches_the_other_ranks_watch_naming_the_poster() {
        let w = world(3);
        let watch0 = AbortWatch::with_period(w[0].clone(), Duration::from_millis(10)).unwrap();
        let watch2 = AbortWatch::with_period(w[2].clone(), Duration::from_millis(10)).unwrap();
        thread::sleep(Duration::from_millis(30));
        assert_eq!(watch0.posted(), None, "nothing was posted yet");
        post_abort(&*w[1], "CUDA error while stepping AdamW: out of memory").unwrap();
        let expected = PostedAbort {
            rank: 1,
            detail: "CUDA error while stepping AdamW: out of memory".into(),
        };
        for watch in [&watch0, &watch2] {
            assert_eq!(
                wait_for(watch, Duration::from_secs(5)),
                Some(expected.clone())
            );
        }
    }

    #[test]
    fn a_rank_does_not_see_its_own_post_and_the_first_post_stays() {
        let w = world(2);
        post_abort(&*w[0], "first").unwrap();
        post_abort(&*w[1], "second").unwrap();
        assert_eq!(
            posted_abort(&*w[0]).unwrap(),
            None,
            "rank 0 posted it itself"
        );
        assert_eq!(
            posted_abort(&*w[1]).unwrap(),
            Some(PostedAbort {
                rank: 0,
                detail: "first".into()
            }),
            "the later post must not overwrite the first"
        );
    }

    #[test]
    fn records_round_trip_and_long_text_is_cut_at_a_character_boundary() {
        let long = "é".repeat(MAX_DETAIL); // two bytes a character
        let rec = PostedAbort {
            rank: 7,
            detail: long,
        }
        .encode();
        assert!(rec.len() <= 4 + MAX_DETAIL);
        let back = PostedAbort::decode(&rec).unwrap();
        assert_eq!(back.rank, 7);
        assert!(back.detail.chars().all(|c| c == 'é'));
        assert_eq!(back.detail.len(), MAX_DETAIL);
        assert_eq!(PostedAbort::decode(&[1, 2]), None, "too short for a rank");
    }

    #[test]
    fn dropping_the_watch_stops_its_thread_and_releases_the_rendezvous() {
        let w = world(1);
        let rdv = w[0].clone();
        let watch = AbortWatch::with_period(rdv.clone(), Duration::from_secs(3600)).unwrap();
        drop(watch);
        let until = Instant::now() + Duration::from_secs(5);
        while Arc::strong_count(&rdv) > 2 && Instant::now() < until {
            thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            Arc::strong_count(&rdv),
            2,
            "the watch thread still holds the rendezvous an hour-long period after its drop"
        );
    }
}
