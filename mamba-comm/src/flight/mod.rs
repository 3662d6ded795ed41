//! The flight recorder: every rank's last collective calls, for the
//! question DDP users ask most ("which rank hung, on which call?").
//!
//! **What it records.** Each transport (host or NCCL) numbers its
//! communicating calls 1, 2, 3, ... and keeps the last [`RING_LEN`] (256)
//! in a ring: sequence number, kind (`send`, `recv`, `broadcast`,
//! `all_reduce_sum_f32`, `all_reduce_max_i32`, `barrier`, `group`,
//! `window`), bytes this rank moved, the peer (point-to-point, a
//! broadcast's root, a group's first peer), the number of operations (a
//! group or window counts as one call of that many operations), the
//! enqueue and completion times (wall clock) and whether it completed,
//! failed or is still pending. Every rank of an SPMD program makes the same
//! sequence of calls, so sequence numbers compare across ranks.
//!
//! **Where it is written.** Under a file rendezvous (the self-spawn
//! supervisor's, or `MAMBA_RENDEZVOUS_DIR`) the ring lives in a small
//! memory-mapped file of the launch directory, `flight-rank-<r>.ring`
//! ([`RING_BYTES`], 16 KiB), updated in place on every call: the supervisor
//! reads it even when the rank is stopped (SIGSTOP) or hung and can write
//! nothing itself. Elsewhere (a TCP rendezvous, thread worlds) the ring is
//! in memory. On a watchdog expiry, an abort or a peer failure (any error
//! of the transport) the rank writes its ring once: the last calls to
//! stderr, and the whole ring as text to `flight-rank-<r>.txt` in the
//! launch directory (written to a temporary name, then renamed). The
//! supervisor's report then names the rank that was behind and the call
//! it never reached (see [`crate::supervisor::WorldReport::headline`]), and
//! keeps every rank's ring in `<root>/<job>/flight-<launch>.txt` after the
//! launch directory is removed (until the job's next launch purges it).
//!
//! **Turning it off.** `MAMBA_FLIGHT_RECORDER=0` (or `off`, `false`, `no`)
//! in a rank's environment; `1`/`on` (or unset) keeps it on; anything else
//! is an error when the transport is built.
//!
//! **What it costs.** Per call: two reads of the wall clock and two stores
//! of 64 bytes into memory (mapped or not), no system call and no lock;
//! 16 KiB of memory (or one file) per rank. Nothing is formatted until a
//! failure.

mod ring;
mod text;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use memmap2::MmapMut;

pub use ring::{RingSnapshot, RING_BYTES, RING_LEN};
pub(crate) use text::{describe as text_describe, write_atomic};
pub use text::{format_calls, summarise_ranks};

use crate::bootstrap::{vars, EnvSource};
use crate::{CommError, Result};

/// Kinds of recorded calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u64)]
pub enum CallKind {
    /// A point-to-point send.
    Send = 1,
    /// A point-to-point receive.
    Recv = 2,
    /// A broadcast (peer: the root).
    Broadcast = 3,
    /// The library-sum f32 all-reduce.
    AllReduceSum = 4,
    /// The exact i32 max all-reduce.
    AllReduceMax = 5,
    /// A barrier.
    Barrier = 6,
    /// A group of sends and receives (one call).
    Group = 7,
    /// An NCCL window of groups (one call).
    Window = 8,
}

impl CallKind {
    /// The operation's name, as the transports' errors spell it.
    pub fn name(self) -> &'static str {
        match self {
            CallKind::Send => "send",
            CallKind::Recv => "recv",
            CallKind::Broadcast => "broadcast",
            CallKind::AllReduceSum => "all_reduce_sum_f32",
            CallKind::AllReduceMax => "all_reduce_max_i32",
            CallKind::Barrier => "barrier",
            CallKind::Group => "group",
            CallKind::Window => "window",
        }
    }

    fn from_code(c: u64) -> Option<CallKind> {
        Some(match c {
            1 => CallKind::Send,
            2 => CallKind::Recv,
            3 => CallKind::Broadcast,
            4 => CallKind::AllReduceSum,
            5 => CallKind::AllReduceMax,
            6 => CallKind::Barrier,
            7 => CallKind::Group,
            8 => CallKind::Window,
            _ => return None,
        })
    }
}

/// How a recorded call ended (so far).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CallState {
    /// Begun, not ended: the rank is in it (or stopped in it).
    Pending,
    /// Completed.
    Completed,
    /// Ended with an error.
    Failed,
}

/// One recorded call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CallRecord {
    /// Sequence number, from 1.
    pub seq: u64,
    /// What it was.
    pub kind: CallKind,
    /// Bytes this rank sent and received in it.
    pub bytes: u64,
    /// The peer, if the call has one.
    pub peer: Option<usize>,
    /// Operations in it (a group's or window's count, else 1).
    pub ops: u32,
    /// When it was enqueued, ns since the Unix epoch.
    pub enqueued_ns: u64,
    /// When it completed (or failed), ns since the Unix epoch.
    pub completed_ns: Option<u64>,
    /// How it ended.
    pub state: CallState,
}

/// Wall-clock now, ns since the Unix epoch (0 if the clock is before it).
pub(crate) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

/// Name of rank `rank`'s ring file in a launch directory.
pub fn ring_file(launch_dir: &Path, rank: usize) -> PathBuf {
    launch_dir.join(format!("flight-rank-{rank}.ring"))
}

/// Name of rank `rank`'s text dump in a launch directory.
pub fn dump_file(launch_dir: &Path, rank: usize) -> PathBuf {
    launch_dir.join(format!("flight-rank-{rank}.txt"))
}

/// Read rank `rank`'s ring from a launch directory (`None`: no ring there,
/// or not one this version wrote).
pub fn read_ring(launch_dir: &Path, rank: usize) -> Option<RingSnapshot> {
    let bytes = std::fs::read(ring_file(launch_dir, rank)).ok()?;
    ring::parse(&bytes)
}

/// Whether the environment turns the recorder on (the default) or off.
pub fn enabled(env: &dyn EnvSource) -> Result<bool> {
    match env.var(vars::MAMBA_FLIGHT_RECORDER).as_deref() {
        None | Some("1" | "on" | "true" | "yes") => Ok(true),
        Some("0" | "off" | "false" | "no") => Ok(false),
        Some(other) => Err(CommError::env(
            vars::MAMBA_FLIGHT_RECORDER,
            format!("{other:?} is not a switch: expected 0/off to turn the recorder off or 1/on"),
        )),
    }
}

/// Where a ring's bytes live.
enum Storage {
    Memory(Vec<u8>),
    Mapped(MmapMut),
}

impl Storage {
    fn bytes(&mut self) -> &mut [u8] {
        match self {
            Storage::Memory(v) => v,
            Storage::Mapped(m) => m,
        }
    }
}

/// One rank's recorder (see the [module docs](self)). Owned by its
/// transport; every method is cheap and infallible (a recorder that could
/// not map its file keeps its ring in memory and says so in its dump).
pub struct FlightRecorder {
    rank: usize,
    world: usize,
    /// `None` when turned off.
    storage: Option<Storage>,
    dir: Option<PathBuf>,
    /// Why the ring is not in a file although a directory was given.
    note: Option<String>,
    begun: u64,
    completed: u64,
    /// The calls not yet completed, newest last (at most a few: a group's
    /// or window's entry and the call inside it).
    open: Vec<CallRecord>,
    dumped: bool,
}

impl std::fmt::Debug for FlightRecorder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FlightRecorder")
            .field("rank", &self.rank)
            .field("on", &self.storage.is_some())
            .field("file", &matches!(self.storage, Some(Storage::Mapped(_))))
            .field("begun", &self.begun)
            .finish()
    }
}

impl FlightRecorder {
    /// A recorder that records nothing.
    pub fn off(rank: usize, world: usize) -> FlightRecorder {
        FlightRecorder {
            rank,
            world,
            storage: None,
            dir: None,
            note: None,
            begun: 0,
            completed: 0,
            open: Vec::new(),
            dumped: false,
        }
    }

    /// The recorder of rank `rank` as this process's environment asks
    /// ([`enabled`]): in `launch_dir` (a memory-mapped ring file, and the
    /// dump's place) when given, else in memory.
    pub fn from_env(
        rank: usize,
        world: usize,
        launch_dir: Option<&Path>,
    ) -> Result<FlightRecorder> {
        let mut r = FlightRecorder::off(rank, world);
        if !enabled(&crate::bootstrap::ProcessEnv)? {
            return Ok(r);
        }
        let mut storage = Storage::Memory(vec![0u8; RING_BYTES]);
        if let Some(dir) = launch_dir {
            match map_ring(&ring_file(dir, rank)) {
                Ok(m) => storage = Storage::Mapped(m),
                Err(e) => r.note = Some(format!("the ring file could not be mapped ({e})")),
            }
            r.dir = Some(dir.to_path_buf());
        }
        ring::init(storage.bytes(), rank, world, std::process::id());
        r.storage = Some(storage);
        Ok(r)
    }

    /// True when recording.
    pub fn is_on(&self) -> bool {
        self.storage.is_some()
    }

    /// Record the start of a call; returns its sequence number (0 when off).
    pub fn begin(&mut self, kind: CallKind, bytes: u64, peer: Option<usize>) -> u64 {
        if self.storage.is_none() {
            return 0;
        }
        self.begun += 1;
        let rec = CallRecord {
            seq: self.begun,
            kind,
            bytes,
            peer,
            ops: u32::from(!matches!(kind, CallKind::Group | CallKind::Window)),
            enqueued_ns: now_ns(),
            completed_ns: None,
            state: CallState::Pending,
        };
        self.write(&rec);
        self.open.push(rec);
        self.begun
    }

    /// [`FlightRecorder::begin`] of an empty `kind` (a group or window)
    /// when `own`, else nothing (0).
    pub fn begin_if(&mut self, own: bool, kind: CallKind) -> u64 {
        if own {
            self.begin(kind, 0, None)
        } else {
            0
        }
    }

    /// Count one operation of `bytes` with `peer` into the open call `seq`
    /// (a group or window).
    pub fn add(&mut self, seq: u64, bytes: u64, peer: Option<usize>) {
        let Some(i) = self.open.iter().position(|c| c.seq == seq) else {
            return;
        };
        let rec = &mut self.open[i];
        rec.bytes += bytes;
        rec.ops = rec.ops.saturating_add(1);
        rec.peer = rec.peer.or(peer);
        let rec = rec.clone();
        self.write(&rec);
    }

    /// Record the end of call `seq`.
    pub fn finish(&mut self, seq: u64, ok: bool) {
        let Some(i) = self.open.iter().position(|c| c.seq == seq) else {
            return;
        };
        let mut rec = self.open.remove(i);
        rec.completed_ns = Some(now_ns());
        rec.state = if ok {
            self.completed = self.completed.max(seq);
            CallState::Completed
        } else {
            CallState::Failed
        };
        self.write(&rec);
    }

    fn write(&mut self, rec: &CallRecord) {
        let (begun, completed) = (self.begun, self.completed);
        if let Some(s) = self.storage.as_mut() {
            ring::store(s.bytes(), rec, begun, completed);
        }
    }

    /// The ring as it stands.
    pub fn snapshot(&mut self) -> Option<RingSnapshot> {
        let s = self.storage.as_mut()?;
        ring::parse(s.bytes())
    }

    /// Write the ring out, once per recorder: its last calls to stderr and
    /// all of it to `flight-rank-<r>.txt` in the launch directory (atomic:
    /// a temporary name, then a rename). `reason` is the error that made
    /// this rank give up. Never fails: a dump that cannot be written says
    /// so on stderr.
    pub fn dump(&mut self, reason: &str) {
        if self.dumped {
            return;
        }
        self.dumped = true;
        let Some(snap) = self.snapshot() else {
            return;
        };
        let now = now_ns();
        let file = self.dir.as_deref().map(|d| dump_file(d, self.rank));
        let mut head = format!(
            "mamba-comm flight recorder: rank {} of {} (pid {}) gave up after call #{} ({} \
             completed): {reason}",
            self.rank,
            self.world,
            std::process::id(),
            snap.begun,
            snap.completed
        );
        if let Some(n) = &self.note {
            head.push_str(&format!("\n  ({n}; the ring was kept in memory)"));
        }
        let mut shown = snap.calls.clone();
        let skip = shown.len().saturating_sub(text::STDERR_CALLS);
        shown.drain(..skip);
        let mut err = format!("{head}\n{}", format_calls(&shown, now));
        if let Some(f) = &file {
            let full = format!("{head}\n{}", format_calls(&snap.calls, now));
            match text::write_atomic(f, full.as_bytes()) {
                Ok(()) => err.push_str(&format!("\n  whole ring: {}", f.display())),
                Err(e) => err.push_str(&format!("\n  (could not write {}: {e})", f.display())),
            }
        }
        eprintln!("{err}");
    }
}

/// Create (or truncate) `path` as a private ring file and map it.
fn map_ring(path: &Path) -> std::io::Result<MmapMut> {
    let file: File = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)?;
    file.set_len(RING_BYTES as u64)?;
    // SAFETY: the file was just created (or truncated) by this process,
    // mode 0600, inside the launch directory, which is private to this
    // user (0700). Nothing else writes it (the supervisor only reads) or
    // changes its length while it is mapped, so the mapping stays valid
    // memory of RING_BYTES for the recorder's life.
    unsafe { MmapMut::map_mut(&file) }
}

#[cfg(test)]
mod tests;
