//! The ring's binary layout, shared by the rank that writes it and the
//! supervisor that reads it (possibly while the rank is stopped).
//!
//! Little-endian u64 words. A header of [`HEADER_WORDS`] words, then
//! [`RING_LEN`] entries of [`ENTRY_WORDS`] words:
//!
//! | header word | meaning |
//! |---|---|
//! | 0 | magic `MAMBAFR1` |
//! | 1 | layout version (1) |
//! | 2, 3 | rank, world |
//! | 4 | pid of the rank |
//! | 5 | number of entries ([`RING_LEN`]) |
//! | 6 | sequence number of the last call begun (0: none) |
//! | 7 | sequence number of the last call completed (0: none) |
//!
//! | entry word | meaning |
//! |---|---|
//! | 0 | sequence number (from 1; 0: empty slot) |
//! | 1 | kind ([`CallKind`] code) |
//! | 2 | bytes moved (this rank's sends and receives) |
//! | 3 | peer (`u64::MAX`: none) |
//! | 4 | operations (a group's or window's count, else 1) |
//! | 5 | enqueue time, ns since the Unix epoch |
//! | 6 | completion time, ns since the Unix epoch (0: not completed) |
//! | 7 | state (0 pending, 1 completed, 2 failed) << 56, then the low 56 bits of the sequence number again |
//!
//! Call `seq` lives in slot `(seq - 1) % RING_LEN`. A writer clears word 7
//! first and writes it last, so a reader that races with it sees a
//! mismatch between words 0 and 7 and skips the entry (a stopped or hung
//! rank's ring is stable, which is the case that matters).

use std::sync::atomic::{compiler_fence, Ordering};

use super::{CallKind, CallRecord, CallState};

/// Entries in a ring: the last this many calls are kept.
pub const RING_LEN: usize = 256;
pub(crate) const HEADER_WORDS: usize = 8;
pub(crate) const ENTRY_WORDS: usize = 8;
/// Size of a ring in bytes (a memory-mapped ring file is exactly this).
pub const RING_BYTES: usize = (HEADER_WORDS + RING_LEN * ENTRY_WORDS) * 8;
const MAGIC: u64 = u64::from_le_bytes(*b"MAMBAFR1");
const VERSION: u64 = 1;
const NO_PEER: u64 = u64::MAX;
const SEQ_MASK: u64 = (1 << 56) - 1;

fn put(buf: &mut [u8], word: usize, v: u64) {
    buf[word * 8..word * 8 + 8].copy_from_slice(&v.to_le_bytes());
}

fn get(buf: &[u8], word: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&buf[word * 8..word * 8 + 8]);
    u64::from_le_bytes(b)
}

/// Write a fresh header (and empty entries) into `buf` of [`RING_BYTES`].
pub(crate) fn init(buf: &mut [u8], rank: usize, world: usize, pid: u32) {
    buf.fill(0);
    put(buf, 0, MAGIC);
    put(buf, 1, VERSION);
    put(buf, 2, rank as u64);
    put(buf, 3, world as u64);
    put(buf, 4, u64::from(pid));
    put(buf, 5, RING_LEN as u64);
}

/// Store `rec` in its slot, and the header's counters `begun`/`completed`.
pub(crate) fn store(buf: &mut [u8], rec: &CallRecord, begun: u64, completed: u64) {
    let base = HEADER_WORDS + ((rec.seq.max(1) - 1) as usize % RING_LEN) * ENTRY_WORDS;
    put(buf, base + 7, 0);
    compiler_fence(Ordering::Release);
    put(buf, base + 1, rec.kind as u64);
    put(buf, base + 2, rec.bytes);
    put(buf, base + 3, rec.peer.map_or(NO_PEER, |p| p as u64));
    put(buf, base + 4, u64::from(rec.ops));
    put(buf, base + 5, rec.enqueued_ns);
    put(buf, base + 6, rec.completed_ns.unwrap_or(0));
    put(buf, base, rec.seq);
    compiler_fence(Ordering::Release);
    let state = match rec.state {
        CallState::Pending => 0u64,
        CallState::Completed => 1,
        CallState::Failed => 2,
    };
    put(buf, base + 7, (state << 56) | (rec.seq & SEQ_MASK));
    put(buf, 6, begun);
    put(buf, 7, completed);
}

/// What `parse` reads back from a ring.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RingSnapshot {
    /// The rank that wrote it.
    pub rank: usize,
    /// Its world size.
    pub world: usize,
    /// Its process id.
    pub pid: u32,
    /// Sequence number of the last call it began (0: none).
    pub begun: u64,
    /// Sequence number of the last call it completed (0: none).
    pub completed: u64,
    /// The calls still in the ring, ascending sequence numbers.
    pub calls: Vec<CallRecord>,
}

impl RingSnapshot {
    /// The call with sequence number `seq`, if still in the ring.
    pub fn call(&self, seq: u64) -> Option<&CallRecord> {
        self.calls.iter().find(|c| c.seq == seq)
    }
}

/// Read a ring written by [`init`] and [`store`]; `None` when `buf` is not
/// one (wrong size, magic or version).
pub(crate) fn parse(buf: &[u8]) -> Option<RingSnapshot> {
    if buf.len() != RING_BYTES
        || get(buf, 0) != MAGIC
        || get(buf, 1) != VERSION
        || get(buf, 5) != RING_LEN as u64
    {
        return None;
    }
    let mut calls = Vec::new();
    for slot in 0..RING_LEN {
        let base = HEADER_WORDS + slot * ENTRY_WORDS;
        let seq = get(buf, base);
        let check = get(buf, base + 7);
        if seq == 0 || check & SEQ_MASK != seq & SEQ_MASK {
            continue;
        }
        let Some(kind) = CallKind::from_code(get(buf, base + 1)) else {
            continue;
        };
        let state = match check >> 56 {
            0 => CallState::Pending,
            1 => CallState::Completed,
            _ => CallState::Failed,
        };
        let peer = get(buf, base + 3);
        let done = get(buf, base + 6);
        calls.push(CallRecord {
            seq,
            kind,
            bytes: get(buf, base + 2),
            peer: (peer != NO_PEER).then_some(peer as usize),
            ops: u32::try_from(get(buf, base + 4)).unwrap_or(u32::MAX),
            enqueued_ns: get(buf, base + 5),
            completed_ns: (done != 0).then_some(done),
            state,
        });
    }
    calls.sort_by_key(|c| c.seq);
    Some(RingSnapshot {
        rank: get(buf, 2) as usize,
        world: get(buf, 3) as usize,
        pid: u32::try_from(get(buf, 4)).unwrap_or(0),
        begun: get(buf, 6),
        completed: get(buf, 7),
        calls,
    })
}
