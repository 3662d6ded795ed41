//! What the supervisor reports about a finished world.

use std::fmt;
use std::time::Duration;

use crate::{CommError, Result};

/// How one rank's process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RankStatus {
    /// It exited with this code.
    Exited(i32),
    /// It was ended by this signal (9 = SIGKILL).
    Signaled(i32),
}

impl RankStatus {
    /// Exit code 0.
    pub fn success(self) -> bool {
        self == RankStatus::Exited(0)
    }

    /// The stop signal this status reports a requested stop for: exit code
    /// `128 + signal` for SIGTERM or SIGINT (a rank that handled the
    /// request, see [`crate::stop_signal`]). Being *killed* by a signal is
    /// not a requested stop.
    pub fn stop_signal(self) -> Option<i32> {
        match self {
            RankStatus::Exited(code) => crate::stop_signal::STOP_SIGNALS
                .into_iter()
                .find(|&s| crate::stop_signal::stop_status(s) == code),
            RankStatus::Signaled(_) => None,
        }
    }

    /// Neither success nor a requested stop.
    pub fn failed(self) -> bool {
        !self.success() && self.stop_signal().is_none()
    }
}

impl fmt::Display for RankStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RankStatus::Exited(c) => write!(f, "exited with code {c}"),
            RankStatus::Signaled(s) => write!(f, "killed by signal {s}"),
        }
    }
}

/// One rank's end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankExit {
    /// The rank.
    pub rank: usize,
    /// Its process id (reaped: it no longer exists when the report is made).
    pub pid: u32,
    /// How it ended.
    pub status: RankStatus,
    /// True when the supervisor killed it (teardown after another rank's
    /// failure, or the world's deadline), false when it ended by itself.
    pub killed_by_supervisor: bool,
    /// When the supervisor saw it end, measured from the first spawn.
    pub at: Duration,
}

/// Every rank's end, in rank order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldReport {
    /// One entry per rank, `ranks[r].rank == r`.
    pub ranks: Vec<RankExit>,
    /// The rank whose failure (non-zero exit or signal, other than a
    /// requested stop) was seen first.
    pub first_failure: Option<usize>,
    /// The stop signal the supervisor received and forwarded to every
    /// rank, if any (ranks may also have been signalled directly).
    pub forwarded_stop: Option<i32>,
    /// True when the world ran past its deadline and was killed.
    pub timed_out: bool,
    /// The launch's nonce (`MAMBA_LAUNCH_ID` of its ranks).
    pub launch_id: String,
    /// From the first spawn until the last rank was reaped.
    pub elapsed: Duration,
}

impl WorldReport {
    /// The signal of a world that stopped on request: no rank failed and at
    /// least one (normally every one) exited with a requested stop.
    pub fn stopped_by(&self) -> Option<i32> {
        if self.first_failure.is_some() || self.timed_out {
            return None;
        }
        self.ranks.iter().find_map(|r| r.status.stop_signal())
    }

    /// Every rank exited with code 0 and the deadline was not hit.
    pub fn success(&self) -> bool {
        !self.timed_out && self.ranks.iter().all(|r| r.status.success())
    }

    /// `Ok` on success; otherwise the error a caller should surface:
    /// [`CommError::PeerFailed`] naming the first failed rank, a transport
    /// error for a world that hit its deadline, or [`CommError::Stopped`]
    /// for a world that stopped on request.
    pub fn check(&self) -> Result<()> {
        if let Some(signal) = self.stopped_by() {
            return Err(CommError::Stopped { signal });
        }
        if let Some(r) = self.first_failure {
            let e = &self.ranks[r];
            return Err(CommError::PeerFailed {
                rank: r,
                detail: format!(
                    "its process (pid {}) {} after {:?}; the supervisor ended the other ranks:\n{self}",
                    e.pid, e.status, e.at
                ),
            });
        }
        if self.timed_out {
            return Err(CommError::transport(
                "world",
                format!("the world ran past its deadline and was killed:\n{self}"),
            ));
        }
        Ok(())
    }
}

impl fmt::Display for WorldReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.ranks.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(
                f,
                "  rank {} (pid {}): {} at {:?}",
                r.rank, r.pid, r.status, r.at
            )?;
            if r.killed_by_supervisor {
                write!(f, " (killed by the supervisor)")?;
            }
            if self.first_failure == Some(r.rank) {
                write!(f, " <- first failure")?;
            }
        }
        Ok(())
    }
}
