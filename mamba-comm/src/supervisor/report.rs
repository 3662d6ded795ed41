//! What the supervisor reports about a finished world.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::behind::{behind, Behind, RankFlight};
use crate::flight::summarise_ranks;
use crate::{CommError, Result};

/// Worlds up to this many ranks list every rank's exit; larger ones
/// summarise ranks that ended alike.
const LISTED_RANKS: usize = 16;

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
    /// What the supervisor saw of every rank (process state, flight
    /// recorder ring) when the world failed, before it killed anything;
    /// empty for a world that did not fail.
    pub flight: Vec<RankFlight>,
    /// Where the supervisor kept every rank's ring as text (the launch
    /// directory, where the rings lived, is removed at the end).
    pub flight_file: Option<PathBuf>,
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

    /// The rank that held the failed world back, from the flight
    /// recorders and process states (see [`behind`](super::behind())).
    pub fn behind(&self) -> Option<Behind> {
        behind(&self.flight)
    }

    /// The first failed rank when it died by a signal the supervisor did
    /// not send (a kill -9, the OOM killer): it noticed nothing, it is the
    /// cause, and the flight recorders' "behind" (whoever had completed the
    /// fewest calls when the world was torn down) must not outrank it.
    fn died_first(&self) -> Option<usize> {
        self.first_failure.filter(|&r| {
            self.ranks.get(r).is_some_and(|e| {
                matches!(e.status, RankStatus::Signaled(_)) && !e.killed_by_supervisor
            })
        })
    }

    /// The rank a failed world is blamed on, and the "behind" finding when
    /// that is what names it: a rank that died first by a signal, else the
    /// rank the flight recorders show behind, else the first failure.
    fn blamed(&self) -> (Option<usize>, Option<Behind>) {
        if let Some(r) = self.died_first() {
            return (Some(r), None);
        }
        match self.behind() {
            Some(b) => (Some(b.rank), Some(b)),
            None => (self.first_failure, None),
        }
    }

    /// One line saying what happened: for a failed world, a rank that died
    /// first by a signal; else the rank that was behind and the call it
    /// never reached when the flight recorders tell (a stopped or hung
    /// rank, rather than the healthy rank that noticed it first); else the
    /// first failure.
    pub fn headline(&self) -> String {
        if let Some(signal) = self.stopped_by() {
            return format!("the world stopped on request (signal {signal})");
        }
        if self.success() {
            return format!("all {} ranks succeeded", self.ranks.len());
        }
        let (blamed, behind) = self.blamed();
        let mut s = match behind {
            Some(b) => b.sentence(),
            None => match blamed.and_then(|r| self.ranks.get(r)) {
                Some(e) => format!(
                    "rank {} failed first: its process (pid {}) {} after {:?}",
                    e.rank, e.pid, e.status, e.at
                ),
                None => "no rank failed".to_string(),
            },
        };
        if self.timed_out {
            s.push_str("; the world ran past its deadline and was killed");
        }
        if let Some(f) = &self.flight_file {
            s.push_str(&format!("; every rank's flight recorder: {}", f.display()));
        }
        s
    }

    /// `Ok` on success; otherwise the error a caller should surface:
    /// [`CommError::PeerFailed`] naming the rank the headline blames (see
    /// [`WorldReport::headline`]), a
    /// transport error for a world that hit its deadline, or
    /// [`CommError::Stopped`] for a world that stopped on request.
    pub fn check(&self) -> Result<()> {
        if let Some(signal) = self.stopped_by() {
            return Err(CommError::Stopped { signal });
        }
        if let (Some(r), _) = self.blamed() {
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
    /// The headline, then every rank's exit (worlds over 16 ranks: the
    /// ranks named in the headline, then one line per way of ending, with
    /// a short list of ranks).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "  {}", self.headline())?;
        let behind = self.behind().map(|b| b.rank);
        let named = |r: &RankExit| self.first_failure == Some(r.rank) || behind == Some(r.rank);
        let big = self.ranks.len() > LISTED_RANKS;
        for r in self.ranks.iter().filter(|r| !big || named(r)) {
            write!(
                f,
                "\n  rank {} (pid {}): {} at {:?}",
                r.rank, r.pid, r.status, r.at
            )?;
            if r.killed_by_supervisor {
                write!(f, " (killed by the supervisor)")?;
            }
            if self.first_failure == Some(r.rank) {
                write!(f, " <- first failure")?;
            }
            if behind == Some(r.rank) {
                write!(f, " <- behind")?;
            }
        }
        if big {
            let mut groups: Vec<((RankStatus, bool), Vec<usize>)> = Vec::new();
            for r in self.ranks.iter().filter(|r| !named(r)) {
                let key = (r.status, r.killed_by_supervisor);
                match groups.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(r.rank),
                    None => groups.push((key, vec![r.rank])),
                }
            }
            for ((status, killed), ranks) in groups {
                let by = if killed {
                    " (killed by the supervisor)"
                } else {
                    ""
                };
                write!(
                    f,
                    "\n  {} rank(s) {status}{by}: {}",
                    ranks.len(),
                    summarise_ranks(&ranks)
                )?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::flight::{CallKind, CallRecord, CallState, RingSnapshot};

    fn ring(rank: usize, completed: u64, pending: bool) -> RingSnapshot {
        let call = |seq: u64, state| CallRecord {
            seq,
            kind: CallKind::AllReduceSum,
            bytes: 40_000,
            peer: None,
            ops: 1,
            enqueued_ns: 1,
            completed_ns: (state != CallState::Pending).then_some(2),
            state,
        };
        let mut calls: Vec<CallRecord> = (1..=completed)
            .map(|s| call(s, CallState::Completed))
            .collect();
        if pending {
            calls.push(call(completed + 1, CallState::Failed));
        }
        RingSnapshot {
            rank,
            world: 0,
            pid: 1000 + rank as u32,
            begun: completed + u64::from(pending),
            completed,
            calls,
        }
    }

    /// A world of `world` ranks where every rank but `stopped` waited in
    /// call 42 (failed), and `stopped` completed 41 and was stopped.
    fn hung_world(world: usize, stopped: usize) -> WorldReport {
        let ranks = (0..world)
            .map(|r| RankExit {
                rank: r,
                pid: 1000 + r as u32,
                status: if r == 0 {
                    RankStatus::Exited(1)
                } else {
                    RankStatus::Signaled(9)
                },
                killed_by_supervisor: r != 0,
                at: Duration::from_secs(2),
            })
            .collect();
        let flight = (0..world)
            .map(|r| RankFlight {
                rank: r,
                pid: 1000 + r as u32,
                state: Some(if r == stopped { 'T' } else { 'S' }),
                ring: Some(ring(r, 41, r != stopped)),
            })
            .collect();
        WorldReport {
            ranks,
            first_failure: Some(0),
            forwarded_stop: None,
            timed_out: false,
            launch_id: "x".into(),
            elapsed: Duration::from_secs(3),
            flight,
            flight_file: None,
        }
    }

    #[test]
    fn the_headline_names_the_stopped_rank_and_the_call_it_never_reached() {
        let report = hung_world(4, 2);
        let h = report.headline();
        assert!(
            h.starts_with("rank 2 (pid 1002, stopped: process state T) was behind")
                && h.contains("last completed collective was #41 all_reduce_sum_f32")
                && h.contains("never reached call #42")
                && h.contains("ranks 0, 1, 3 got further"),
            "{h}"
        );
        match report.check() {
            Err(CommError::PeerFailed { rank: 2, detail }) => assert!(detail.contains(&h)),
            other => panic!("{other:?}"),
        }
        assert!(report
            .to_string()
            .contains("rank 2 (pid 1002): killed by signal 9"));
    }

    #[test]
    fn a_hundred_thousand_rank_report_stays_short() {
        let report = hung_world(100_000, 77_777);
        let text = report.to_string();
        assert!(text.lines().count() <= 6, "{} lines", text.lines().count());
        assert!(text.len() < 1500, "{} bytes:\n{text}", text.len());
        assert!(text.contains("rank 77777 (pid 78777, stopped"), "{text}");
        assert!(
            text.contains(
                "99998 rank(s) killed by signal 9 (killed by the supervisor): 1, 2, 3, \
                           4, 5, 6, 7, 8 and 99990 more"
            ),
            "{text}"
        );
        assert!(
            text.contains("(ranks 0, 1, 2, 3, 4, 5, 6, 7 and 99991 more got further)"),
            "{text}"
        );
    }

    #[test]
    fn without_a_laggard_the_first_failure_is_the_headline() {
        let mut report = hung_world(3, 9);
        // Every rank waited in call 42: nobody is behind.
        report.flight.iter_mut().for_each(|f| f.state = Some('S'));
        assert_eq!(report.behind(), None);
        assert!(
            report.headline().starts_with("rank 0 failed first"),
            "{}",
            report.headline()
        );
        match report.check() {
            Err(CommError::PeerFailed { rank: 0, .. }) => {}
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_rank_that_never_entered_the_call_is_behind_without_being_stopped() {
        let mut report = hung_world(3, 1);
        report.flight[1].state = Some('R');
        let b = report.behind().expect("rank 1 is behind");
        assert_eq!((b.rank, b.stopped, b.completed), (1, false, 41));
        assert_eq!(b.ahead, vec![0, 2]);
    }
}
