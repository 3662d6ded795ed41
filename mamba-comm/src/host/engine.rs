//! The engine shared by thread and socket worlds: one inbox per rank, one
//! non-blocking outbox per peer, deadlines on every wait, aborts that spread.
//!
//! Ownership: a `HostTransport` owns its inbox receiver and one sender per
//! peer. In a thread world a sender feeds the peer's inbox directly; in a
//! socket world it feeds the writer thread of that peer's connection, and the
//! connection's reader thread feeds this rank's inbox. Dropping the transport
//! says goodbye, drops the senders (which ends the writer threads after they
//! flush) and waits a bounded time for the flush.
//!
//! Over 450 lines (510): one state machine (inbox, per-link receive gate,
//! deadlines, goodbye) that every host operation goes through; the receive
//! gate that bounds a peer-claimed length is part of it, not a layer above.
//! The next split is the gate's bookkeeping into its own file.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::Ordering;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

use super::fault::Fault;
use super::link::{Wanted, Writers};
use super::message::{Event, Msg, OpCode};
use super::HostOptions;
use crate::flight::{CallKind, FlightRecorder};
use crate::{CommError, Result};

/// Longest time a drop/shutdown waits for queued bytes to reach the sockets.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// Longest time an error path waits for its abort frames to reach the
/// sockets (so a rank that exits right after an error still tells its peers
/// who is to blame).
const ABORT_FLUSH_LIMIT: Duration = Duration::from_secs(1);

/// A rank of a host world. See the [module docs](super) for the guarantees.
///
/// It may move between threads (it is `Send`) and is used from one thread at
/// a time. After any communication error it is unusable (every later call
/// fails with the first error's text) and its peers have been told.
pub struct HostTransport {
    pub(super) rank: usize,
    pub(super) world: usize,
    opts: HostOptions,
    inbox: Receiver<Event>,
    /// One sender per peer; `None` at this rank's own index and after leave.
    outbox: Vec<Option<Sender<Event>>>,
    /// Messages already taken from the inbox, per source rank, in arrival
    /// order (which is send order: each link is FIFO).
    pending: Vec<VecDeque<Msg>>,
    /// Data messages taken from each peer so far: the index of the next
    /// one (what a socket link's gate is told, see
    /// [`Gate`](super::link::Gate)).
    taken: Vec<u64>,
    /// Peers that said goodbye.
    departed: Vec<bool>,
    /// Events handed to each peer's outbox (compared with
    /// [`LinkStats::flushed`](super::link::LinkStats::flushed) to know when they are on the wire).
    queued: Vec<u64>,
    /// The first error, once one happened.
    poisoned: Option<String>,
    writers: Option<Writers>,
    left: bool,
    /// This rank's flight recorder (see [`crate::flight`]).
    pub(super) flight: FlightRecorder,
    /// The recorder's entry of the open group: its operations count into
    /// it instead of being calls of their own.
    pub(super) group_call: Option<u64>,
}

impl std::fmt::Debug for HostTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTransport")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("sockets", &self.writers.is_some())
            .field("poisoned", &self.poisoned)
            .finish()
    }
}

impl HostTransport {
    /// `world` transports linked by channels, one per thread, in rank order
    /// (element `r` is rank `r`). Move each to its own thread.
    pub fn thread_world(world: usize, opts: HostOptions) -> Result<Vec<HostTransport>> {
        if world == 0 {
            return Err(CommError::config(
                "a host world needs at least one rank, got 0",
            ));
        }
        let (txs, rxs): (Vec<Sender<Event>>, Vec<Receiver<Event>>) =
            (0..world).map(|_| unbounded()).unzip();
        rxs.into_iter()
            .enumerate()
            .map(|(rank, inbox)| {
                let outbox = (0..world)
                    .map(|p| (p != rank).then(|| txs[p].clone()))
                    .collect();
                let flight = FlightRecorder::from_env(rank, world, None)?;
                Ok(HostTransport::from_parts(
                    rank,
                    world,
                    opts.clone(),
                    inbox,
                    outbox,
                    None,
                    flight,
                ))
            })
            .collect()
    }

    pub(crate) fn from_parts(
        rank: usize,
        world: usize,
        opts: HostOptions,
        inbox: Receiver<Event>,
        outbox: Vec<Option<Sender<Event>>>,
        writers: Option<Writers>,
        flight: FlightRecorder,
    ) -> HostTransport {
        HostTransport {
            rank,
            world,
            opts,
            inbox,
            outbox,
            pending: (0..world).map(|_| VecDeque::new()).collect(),
            taken: vec![0; world],
            departed: vec![false; world],
            queued: vec![0; world],
            poisoned: None,
            writers,
            left: false,
            flight,
            group_call: None,
        }
    }

    /// The options this transport was built with.
    pub fn options(&self) -> &HostOptions {
        &self.opts
    }

    /// Leave the world in order: say goodbye to every peer and wait (at most
    /// 5 s) until queued bytes are on the wire. Dropping does the same but
    /// cannot report a failed flush.
    pub fn shutdown(mut self) -> Result<()> {
        self.leave()
    }

    // ---- internals -------------------------------------------------------

    pub(super) fn ensure_usable(&self, op: &str) -> Result<()> {
        if let Some(first) = &self.poisoned {
            return Err(CommError::transport(
                op,
                format!(
                    "rank {} cannot use its host transport after an earlier error ({first}); \
                     tear the world down",
                    self.rank
                ),
            ));
        }
        if self.left {
            return Err(CommError::transport(
                op,
                format!("rank {} already left the world", self.rank),
            ));
        }
        Ok(())
    }

    /// Run one communicating operation, `call` = (kind, bytes this rank
    /// moves, peer) for the flight recorder (inside a group: counted into
    /// the group's entry): refuse if unusable; on error poison the
    /// transport, tell every peer who is to blame and dump the recorder.
    pub(super) fn op<R>(
        &mut self,
        op: &str,
        call: (CallKind, usize, Option<usize>),
        f: impl FnOnce(&mut Self) -> Result<R, Fault>,
    ) -> Result<R> {
        self.ensure_usable(op)?;
        let (kind, bytes, peer) = call;
        let bytes = bytes as u64;
        let seq = match self.group_call {
            Some(g) => {
                self.flight.add(g, bytes, peer);
                None
            }
            None => Some(self.flight.begin(kind, bytes, peer)),
        };
        let res = f(self);
        if let Some(s) = seq {
            self.flight.finish(s, res.is_ok());
        }
        res.map_err(|fault| self.fail(fault))
    }

    fn fail(&mut self, fault: Fault) -> CommError {
        let text = fault.err.to_string();
        let culprit = fault.tell;
        for (peer, tx) in self.outbox.iter().enumerate() {
            let Some(tx) = tx else { continue };
            // A peer whose link is gone cannot be told; nothing to do.
            if tx
                .send(Event::Abort {
                    from: self.rank,
                    culprit,
                    detail: text.clone(),
                })
                .is_ok()
            {
                self.queued[peer] += 1;
            }
        }
        self.wait_flushed(Instant::now() + self.opts.timeout.min(ABORT_FLUSH_LIMIT));
        self.flight.dump(&text);
        self.poisoned = Some(text);
        self.close_gates();
        fault.err
    }

    /// Socket worlds: this rank takes nothing more; release link readers
    /// that hold a large frame for a receive that will never come.
    fn close_gates(&self) {
        if let Some(w) = &self.writers {
            for link in w.links.iter().flatten() {
                link.gate.close();
            }
        }
    }

    /// Socket worlds: wait until every live writer has flushed what was
    /// queued for it, or until `deadline` (a stopped peer may never drain).
    fn wait_flushed(&self, deadline: Instant) {
        let Some(writers) = &self.writers else { return };
        for (peer, link) in writers.links.iter().enumerate() {
            let Some(link) = link else { continue };
            while link.flushed.load(Ordering::Acquire) < self.queued[peer]
                && !link.finished.load(Ordering::Acquire)
                && Instant::now() < deadline
            {
                thread::sleep(Duration::from_millis(1));
            }
        }
    }

    pub(super) fn check_peer(&self, peer: usize, what: &str) -> Result<(), Fault> {
        if peer >= self.world || peer == self.rank {
            return Err(Fault::config(
                self.rank,
                format!(
                    "{what} {peer} is not a peer of rank {} (expected 0..{} excluding itself)",
                    self.rank, self.world
                ),
            ));
        }
        Ok(())
    }

    pub(super) fn check_range(
        &self,
        op: &str,
        range: &Range<usize>,
        len: usize,
    ) -> Result<(), Fault> {
        if range.start > range.end || range.end > len {
            return Err(Fault::config(
                self.rank,
                format!("{op}: range {range:?} does not fit a buffer of {len} elements"),
            ));
        }
        Ok(())
    }

    pub(super) fn deadline(&self, start: Instant) -> Instant {
        start + self.opts.timeout
    }

    /// Followers of a collective wait a quarter longer than the leader, so
    /// that the leader (which knows which rank is missing) reports first.
    pub(super) fn follower_deadline(&self, start: Instant) -> Instant {
        start + self.opts.timeout + self.opts.timeout / 4 + Duration::from_millis(50)
    }

    pub(super) fn post(&mut self, peer: usize, op: &str, msg: Msg) -> Result<(), Fault> {
        if self.departed[peer] {
            return Err(Fault::peer(
                peer,
                format!(
                    "rank {peer} already left the world when rank {} sent it data for {op}",
                    self.rank
                ),
            ));
        }
        let sent = match &self.outbox[peer] {
            Some(tx) => tx
                .send(Event::Msg {
                    from: self.rank,
                    msg,
                })
                .is_ok(),
            None => false,
        };
        if sent {
            self.queued[peer] += 1;
            return Ok(());
        }
        // The peer's transport is gone. If it (or anyone) already told us
        // why, that names the root culprit; blame the peer only otherwise.
        while let Ok(ev) = self.inbox.try_recv() {
            self.absorb(ev, op)?;
        }
        if self.departed[peer] {
            Err(Fault::peer(
                peer,
                format!(
                    "rank {peer} left the world before rank {} sent it data for {op}",
                    self.rank
                ),
            ))
        } else {
            Err(Fault::peer(
                peer,
                format!(
                    "the link from rank {} to rank {peer} is closed (its transport is gone) \
                         during {op}",
                    self.rank
                ),
            ))
        }
    }

    /// Handle one inbox event while waiting inside `op`.
    fn absorb(&mut self, ev: Event, op: &str) -> Result<(), Fault> {
        match ev {
            Event::Msg { from, msg } => {
                self.pending[from].push_back(msg);
                Ok(())
            }
            Event::Bye { from } => {
                self.departed[from] = true;
                Ok(())
            }
            Event::Abort {
                from,
                culprit,
                detail,
            } => Err(Fault::peer(
                culprit,
                format!(
                    "rank {from} aborted the world ({detail}); rank {} was in {op}",
                    self.rank
                ),
            )),
            Event::Refused { from, detail } => Err(Fault::transport(
                op,
                format!("{detail} (noticed by rank {} during {op})", self.rank),
                from,
            )),
            Event::Closed { from, detail } => {
                if self.departed[from] {
                    // The end of stream after an orderly goodbye.
                    Ok(())
                } else {
                    Err(Fault::peer(
                        from,
                        format!("{detail} (noticed by rank {} during {op})", self.rank),
                    ))
                }
            }
        }
    }

    /// Wait for the next message from `peer`, which must belong to `code`
    /// and is expected to carry at most `limit` values: in a socket world
    /// the link's reader refuses a larger frame from `peer` before reading
    /// its payload (see [`Gate`](super::link::Gate)).
    pub(super) fn take(
        &mut self,
        peer: usize,
        op: &str,
        code: OpCode,
        limit: usize,
        deadline: Instant,
    ) -> Result<Msg, Fault> {
        if let Some(link) = self
            .writers
            .as_ref()
            .and_then(|w| w.links.get(peer))
            .and_then(Option::as_ref)
        {
            link.gate.want(Wanted {
                index: self.taken[peer],
                op: code,
                limit,
            });
        }
        loop {
            if let Some(msg) = self.pending[peer].pop_front() {
                self.taken[peer] += 1;
                if msg.op != code {
                    return Err(Fault::transport(
                        op,
                        format!(
                            "rank {} expected a {} message from rank {peer} but received a {} \
                                 message with {} values: the ranks called different operations",
                            self.rank,
                            code.name(),
                            msg.op.name(),
                            msg.payload.len()
                        ),
                        peer,
                    ));
                }
                return Ok(msg);
            }
            if self.departed[peer] {
                return Err(Fault::peer(
                    peer,
                    format!(
                        "rank {peer} left the world (closed its transport) while rank {} \
                             waited for its part of {op}",
                        self.rank
                    ),
                ));
            }
            match self.inbox.recv_deadline(deadline) {
                Ok(ev) => self.absorb(ev, op)?,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Fault::transport(
                        op,
                        format!(
                            "rank {} waited {:?} (the deadline) for rank {peer} and received \
                                 nothing: rank {peer} stopped answering (hung, stopped, or not in \
                                 this operation)",
                            self.rank, self.opts.timeout
                        ),
                        peer,
                    ));
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Fault::peer(
                        peer,
                        format!(
                            "every link into rank {} is closed while it waited for rank \
                                 {peer} in {op}",
                            self.rank
                        ),
                    ));
                }
            }
        }
    }

    /// Say goodbye (or, while panicking, abort naming this rank), close every
    /// link and wait a bounded time for the writer threads to flush.
    fn leave(&mut self) -> Result<()> {
        if self.left {
            return Ok(());
        }
        self.left = true;
        if self.poisoned.is_none() {
            let ev = if thread::panicking() {
                Event::Abort {
                    from: self.rank,
                    culprit: self.rank,
                    detail: format!("rank {} panicked", self.rank),
                }
            } else {
                Event::Bye { from: self.rank }
            };
            for tx in self.outbox.iter().flatten() {
                let _ = tx.send(ev.clone());
            }
        }
        self.outbox.clear();
        self.close_gates();
        let Some(writers) = self.writers.take() else {
            return Ok(());
        };
        let deadline = Instant::now() + self.opts.timeout.min(FLUSH_LIMIT);
        let mut problems = Vec::new();
        for _ in 0..writers.count {
            match writers.done.recv_deadline(deadline) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => problems.push(e),
                Err(_) => {
                    problems.push(format!(
                        "queued data was not flushed within {:?}",
                        self.opts.timeout.min(FLUSH_LIMIT)
                    ));
                    break;
                }
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(CommError::transport("shutdown", problems.join("; ")))
        }
    }
}

impl Drop for HostTransport {
    fn drop(&mut self) {
        // Errors cannot be reported from Drop; `shutdown` reports them.
        let _ = self.leave();
    }
}
