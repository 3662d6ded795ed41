//! Deadline polling: how every wait in the communicator is bounded.

use std::time::{Duration, Instant};

/// Spins (yielding) for the first polls, then sleeps with doubling pauses up
/// to [`Backoff::MAX_SLEEP`], never past the deadline. Short collectives are
/// seen complete within microseconds; long ones cost at most one pause of
/// latency and no busy core.
pub(crate) struct Backoff {
    polls: u32,
    sleep: Duration,
}

/// What one pause does.
#[derive(Debug, PartialEq, Eq)]
enum Wait {
    Yield,
    Sleep(Duration),
}

impl Backoff {
    const SPINS: u32 = 200;
    const FIRST_SLEEP: Duration = Duration::from_micros(20);
    const MAX_SLEEP: Duration = Duration::from_millis(1);

    pub(crate) fn new() -> Self {
        Backoff {
            polls: 0,
            sleep: Self::FIRST_SLEEP,
        }
    }

    /// The next pause, given the time `left` until the deadline.
    fn next(&mut self, left: Duration) -> Wait {
        if self.polls < Self::SPINS {
            self.polls += 1;
            return Wait::Yield;
        }
        let d = self.sleep.min(left);
        self.sleep = (self.sleep * 2).min(Self::MAX_SLEEP);
        Wait::Sleep(d)
    }

    /// Wait a little before the next poll; never sleeps past `deadline`.
    pub(crate) fn pause(&mut self, deadline: Instant) {
        match self.next(deadline.saturating_duration_since(Instant::now())) {
            Wait::Yield => std::thread::yield_now(),
            Wait::Sleep(d) => std::thread::sleep(d),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spins_then_doubles_up_to_the_cap() {
        let mut b = Backoff::new();
        let far = Duration::from_secs(10);
        for _ in 0..Backoff::SPINS {
            assert_eq!(b.next(far), Wait::Yield);
        }
        let sleeps: Vec<Duration> = (0..9)
            .map(|_| match b.next(far) {
                Wait::Sleep(d) => d,
                Wait::Yield => Duration::ZERO,
            })
            .collect();
        let us: Vec<u128> = sleeps.iter().map(|d| d.as_micros()).collect();
        assert_eq!(us, [20, 40, 80, 160, 320, 640, 1000, 1000, 1000]);
    }

    #[test]
    fn never_sleeps_past_the_deadline() {
        let mut b = Backoff::new();
        for _ in 0..Backoff::SPINS + 10 {
            b.next(Duration::from_secs(1));
        }
        assert_eq!(
            b.next(Duration::from_micros(7)),
            Wait::Sleep(Duration::from_micros(7))
        );
        assert_eq!(b.next(Duration::ZERO), Wait::Sleep(Duration::ZERO));
    }
}
