//! Which rank held a failed world back: the supervisor's reading of the
//! ranks' flight recorders (see [`crate::flight`]) and process states.

use std::path::Path;

use crate::flight::{self, format_calls, summarise_ranks, CallRecord, CallState, RingSnapshot};

/// What the supervisor saw of one rank when the world failed, before it
/// killed anything.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankFlight {
    /// The rank.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Its state letter from `/proc/<pid>/stat` (`T`: stopped, e.g. by
    /// SIGSTOP; `R`, `S`, `D`: running, sleeping, in the kernel), `None`
    /// when it had already ended.
    pub state: Option<char>,
    /// Its flight recorder's ring, if it kept one in the launch directory.
    pub ring: Option<RingSnapshot>,
}

impl RankFlight {
    /// Stopped by a signal (or a debugger): it cannot move by itself.
    pub fn stopped(&self) -> bool {
        matches!(self.state, Some('T' | 't'))
    }

    /// (last call begun, last call completed): how far it got.
    fn progress(&self) -> (u64, u64) {
        self.ring
            .as_ref()
            .map_or((0, 0), |r| (r.begun, r.completed))
    }
}

/// The rank that was behind, and the call it never reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Behind {
    /// The rank.
    pub rank: usize,
    /// Its process id.
    pub pid: u32,
    /// It was stopped (process state `T`).
    pub stopped: bool,
    /// Its last completed collective, if any is in its ring.
    pub last_completed: Option<CallRecord>,
    /// The sequence number of its last completed call (0: none).
    pub completed: u64,
    /// The call it had begun and not completed, if any (it is stuck in it).
    pub stuck_in: Option<CallRecord>,
    /// The ranks that got further (began a later call).
    pub ahead: Vec<usize>,
}

/// Read every rank's state and ring (`pids[r]`, `alive[r]`) from `launch_dir`.
pub(crate) fn observe(launch_dir: &Path, pids: &[u32], alive: &[bool]) -> Vec<RankFlight> {
    pids.iter()
        .enumerate()
        .map(|(rank, &pid)| RankFlight {
            rank,
            pid,
            state: alive
                .get(rank)
                .copied()
                .unwrap_or(false)
                .then(|| proc_state(pid))
                .flatten(),
            ring: flight::read_ring(launch_dir, rank),
        })
        .collect()
}

/// The state letter of `/proc/<pid>/stat` (Linux), `None` elsewhere or
/// when the process is gone.
pub(crate) fn proc_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // "pid (comm) S ...": comm may contain spaces and parentheses.
    let after = &stat[stat.rfind(')')? + 1..];
    after.trim_start().chars().next()
}

/// The rank that held the world back: a stopped rank first (the least far
/// of them), else the rank that got least far, provided another got
/// further. "Far" is the last call begun, then the last completed: a rank
/// stuck waiting in call `n` began `n`, a rank that never reached it did
/// not. `None` when every rank got equally far and none was stopped.
pub fn behind(ranks: &[RankFlight]) -> Option<Behind> {
    let pick = ranks
        .iter()
        .filter(|r| r.ring.is_some() || r.stopped())
        .min_by_key(|r| (!r.stopped(), r.progress(), r.rank))?;
    let mine = pick.progress();
    let ahead: Vec<usize> = ranks
        .iter()
        .filter(|r| r.ring.is_some() && r.progress() > mine)
        .map(|r| r.rank)
        .collect();
    if !pick.stopped() && ahead.is_empty() {
        return None;
    }
    let ring = pick.ring.as_ref();
    let completed = ring.map_or(0, |r| r.completed);
    Some(Behind {
        rank: pick.rank,
        pid: pick.pid,
        stopped: pick.stopped(),
        last_completed: ring.and_then(|r| r.call(completed)).cloned(),
        completed,
        stuck_in: ring
            .and_then(|r| r.call(r.begun))
            .filter(|c| c.state == CallState::Pending)
            .cloned(),
        ahead,
    })
}

impl Behind {
    /// One sentence: who, how it stood, its last completed collective, the
    /// call it never reached (or is stuck in), and who got further.
    pub fn sentence(&self) -> String {
        let mut s = format!("rank {} (pid {}", self.rank, self.pid);
        if self.stopped {
            s.push_str(", stopped: process state T");
        }
        s.push_str(") was behind: ");
        match &self.last_completed {
            Some(c) => s.push_str(&format!(
                "its last completed collective was #{} {}",
                c.seq,
                crate::flight::text_describe(c)
            )),
            None if self.completed > 0 => s.push_str(&format!(
                "its last completed collective was #{} (no longer in its ring)",
                self.completed
            )),
            None => s.push_str("it completed no collective"),
        }
        match &self.stuck_in {
            Some(c) => s.push_str(&format!(
                "; it is stuck in #{} {}",
                c.seq,
                crate::flight::text_describe(c)
            )),
            None => s.push_str(&format!("; it never reached call #{}", self.completed + 1)),
        }
        if !self.ahead.is_empty() {
            s.push_str(&format!(
                " (ranks {} got further)",
                summarise_ranks(&self.ahead)
            ));
        }
        s
    }
}

/// Every rank's ring as text (what the supervisor keeps after the launch
/// directory is removed).
pub(crate) fn rings_text(ranks: &[RankFlight], headline: &str) -> String {
    let now = crate::flight::now_ns();
    let mut out = format!("{headline}\n");
    for r in ranks {
        let state = r
            .state
            .map_or("ended".to_string(), |c| format!("state {c}"));
        match &r.ring {
            Some(ring) => out.push_str(&format!(
                "rank {} (pid {}, {state}): began #{}, completed #{}\n{}\n",
                r.rank,
                r.pid,
                ring.begun,
                ring.completed,
                format_calls(&ring.calls, now)
            )),
            None => out.push_str(&format!(
                "rank {} (pid {}, {state}): no flight recorder ring\n",
                r.rank, r.pid
            )),
        }
    }
    out
}
