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
    /// The rank whose failure (non-zero exit or signal) was seen first.
    pub first_failure: Option<usize>,
    /// True when the world ran past its deadline and was killed.
    pub timed_out: bool,
    /// The launch's nonce (`MAMBA_LAUNCH_ID` of its ranks).
    pub launch_id: String,
    /// From the first spawn until the last rank was reaped.
    pub elapsed: Duration,
}

impl WorldReport {
    /// Every rank exited with code 0 and the deadline was not hit.
    pub fn success(&self) -> bool {
        !self.timed_out && self.ranks.iter().all(|r| r.status.success())
    }

    /// `Ok` on success; otherwise the error a caller should surface:
    /// [`CommError::PeerFailed`] naming the first failed rank, or a
    /// transport error for a world that hit its deadline.
    pub fn check(&self) -> Result<()> {
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
