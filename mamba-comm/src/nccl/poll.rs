//! Deadline polling: how every wait in the communicator is bounded.
//!
//! A wait polls cheap, non-blocking queries (`cuStreamQuery`,
//! `ncclCommGetAsyncError`, each well under a microsecond) and pauses
//! between polls. The pauses decide two costs: how late a completion is
//! seen, and how much CPU the wait burns. They come in three phases, by the
//! time since the wait began:
//!
//! 1. **Spin** (the first [`Backoff::SPIN_FOR`], 5 ms): yield the core
//!    between polls, so completion is seen within a few microseconds. Every
//!    collective of the reducer's sizes (a 1 GiB all-reduce on two H200s
//!    takes about 3.4 ms) finishes in this phase; the cost is at most 5 ms
//!    of one core per wait, which is what a thread blocked in
//!    `cudaStreamSynchronize` with the default spin policy costs too.
//! 2. **Short sleeps** (until [`Backoff::PATIENT_AFTER`], 200 ms): sleeps
//!    doubling from 10 µs and capped at [`Backoff::MAX_SHORT_SLEEP`] (50 µs),
//!    so a long collective is seen at most ~50 µs (plus the kernel's timer
//!    slack, ~50 µs by default) late: under 2% of anything that got here.
//! 3. **Patient sleeps** (after 200 ms: a slow init, a finalize, a peer
//!    that is late or gone): doubling up to [`Backoff::MAX_SLEEP`] (1 ms),
//!    about a thousand wake-ups a second, until the deadline.
//!
//! No pause ever sleeps past the deadline, so the deadline semantics of the
//! watchdog are unchanged: a wait ends at most one poll after it.
//!
//! (The first version spun for 200 yields and then slept in doubling steps
//! up to 1 ms from the start, which saw a 3.4 ms all-reduce up to ~1 ms
//! late: 4.11 ms measured against PyTorch's 3.39 ms on the same machine.)

use std::time::{Duration, Instant};

/// The pause schedule of one wait (see the module docs).
pub(crate) struct Backoff {
    started: Instant,
    sleep: Duration,
}

/// What one pause does.
#[derive(Debug, PartialEq, Eq)]
enum Wait {
    Yield,
    Sleep(Duration),
}

impl Backoff {
    /// Spin (yield between polls) this long after the wait began.
    const SPIN_FOR: Duration = Duration::from_millis(5);
    /// First sleep after the spin phase.
    const FIRST_SLEEP: Duration = Duration::from_micros(10);
    /// Cap of the sleeps until [`Self::PATIENT_AFTER`].
    const MAX_SHORT_SLEEP: Duration = Duration::from_micros(50);
    /// From this long after the wait began, sleeps may grow to
    /// [`Self::MAX_SLEEP`].
    const PATIENT_AFTER: Duration = Duration::from_millis(200);
    /// Cap of every sleep.
    const MAX_SLEEP: Duration = Duration::from_millis(1);

    /// A schedule whose phases count from now.
    pub(crate) fn new() -> Self {
        Self::started_at(Instant::now())
    }

    fn started_at(started: Instant) -> Self {
        Backoff {
            started,
            sleep: Self::FIRST_SLEEP,
        }
    }

    /// The next pause, `elapsed` after the wait began and `left` before its
    /// deadline.
    fn next(&mut self, elapsed: Duration, left: Duration) -> Wait {
        if elapsed < Self::SPIN_FOR {
            return Wait::Yield;
        }
        let cap = if elapsed < Self::PATIENT_AFTER {
            Self::MAX_SHORT_SLEEP
        } else {
            Self::MAX_SLEEP
        };
        let d = self.sleep.min(cap).min(left);
        self.sleep = (self.sleep * 2).min(cap);
        Wait::Sleep(d)
    }

    /// Wait a little before the next poll; never sleeps past `deadline`.
    pub(crate) fn pause(&mut self, deadline: Instant) {
        let now = Instant::now();
        let elapsed = now.saturating_duration_since(self.started);
        match self.next(elapsed, deadline.saturating_duration_since(now)) {
            Wait::Yield => std::thread::yield_now(),
            Wait::Sleep(d) => std::thread::sleep(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(w: Wait) -> u128 {
        match w {
            Wait::Sleep(d) => d.as_micros(),
            Wait::Yield => 0,
        }
    }

    #[test]
    fn spins_then_short_sleeps_then_patient_sleeps() {
        let mut b = Backoff::new();
        let far = Duration::from_secs(10);
        // Phase 1: only yields, however many polls, for the first 5 ms.
        for ms in [0u64, 1, 2, 4] {
            for _ in 0..1000 {
                assert_eq!(b.next(Duration::from_millis(ms), far), Wait::Yield);
            }
        }
        let at = |ms: u64| Duration::from_millis(ms);
        assert_eq!(b.next(at(4) + Duration::from_micros(999), far), Wait::Yield);
        // Phase 2: doubling from 10 us, capped at 50 us.
        let short: Vec<u128> = (0..6).map(|_| us(b.next(at(6), far))).collect();
        assert_eq!(short, [10, 20, 40, 50, 50, 50]);
        // Still capped at 50 us just before 200 ms.
        assert_eq!(us(b.next(at(199), far)), 50);
        // Phase 3: doubling on towards 1 ms.
        let long: Vec<u128> = (0..6).map(|_| us(b.next(at(250), far))).collect();
        assert_eq!(long, [50, 100, 200, 400, 800, 1000]);
    }

    #[test]
    fn never_sleeps_past_the_deadline() {
        let mut b = Backoff::new();
        let late = Duration::from_secs(1);
        for _ in 0..10 {
            b.next(late, Duration::from_secs(1));
        }
        assert_eq!(
            b.next(late, Duration::from_micros(7)),
            Wait::Sleep(Duration::from_micros(7))
        );
        assert_eq!(b.next(late, Duration::ZERO), Wait::Sleep(Duration::ZERO));
        // In the short phase too.
        let mut b = Backoff::new();
        assert_eq!(
            b.next(Duration::from_millis(6), Duration::from_micros(3)),
            Wait::Sleep(Duration::from_micros(3))
        );
    }

    #[test]
    fn pause_counts_phases_from_the_start_of_the_wait() {
        // A schedule started 300 ms ago is past both phases: its first pause
        // is a sleep, bounded by the deadline.
        let started = Instant::now() - Duration::from_millis(300);
        let mut b = Backoff::started_at(started);
        assert!(matches!(
            b.next(started.elapsed(), Duration::from_secs(1)),
            Wait::Sleep(_)
        ));
        let deadline = Instant::now() + Duration::from_millis(2);
        let t = Instant::now();
        b.pause(deadline);
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{:?}",
            t.elapsed()
        );
    }
}
