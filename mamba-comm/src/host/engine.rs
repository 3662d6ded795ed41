//! The engine shared by thread and socket worlds: one inbox per rank, one
//! non-blocking outbox per peer, deadlines on every wait, aborts that spread.
//!
//! Ownership: a `HostTransport` owns its inbox receiver and one sender per
//! peer. In a thread world a sender feeds the peer's inbox directly; in a
//! socket world it feeds the writer thread of that peer's connection, and the
//! connection's reader thread feeds this rank's inbox. Dropping the transport
//! says goodbye, drops the senders (which ends the writer threads after they
//! flush) and waits a bounded time for the flush.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

use super::message::{Event, Msg, OpCode, Payload};
use super::HostOptions;
use crate::{CommError, Result, Transport};

/// Longest time a drop/shutdown waits for queued bytes to reach the sockets.
const FLUSH_LIMIT: Duration = Duration::from_secs(5);

/// Longest time an error path waits for its abort frames to reach the
/// sockets (so a rank that exits right after an error still tells its peers
/// who is to blame).
const ABORT_FLUSH_LIMIT: Duration = Duration::from_secs(1);

/// What the threads of one socket link share with the transport.
#[derive(Debug, Default)]
pub(crate) struct LinkStats {
    /// Events written *and flushed* to the socket by the writer thread.
    pub(crate) flushed: AtomicU64,
    /// The writer thread has ended (flushed and closed, or failed).
    pub(crate) finished: AtomicBool,
    /// The reader thread saw the peer's goodbye: errors on our side of the
    /// link after that cannot hurt the peer.
    pub(crate) peer_left: AtomicBool,
}

/// Writer threads of a socket world: each sends one report on `done` when it
/// has flushed and closed its half of the connection (or failed).
pub(crate) struct Writers {
    pub(crate) done: Receiver<std::result::Result<(), String>>,
    pub(crate) count: usize,
    /// Per peer (None at this rank's index).
    pub(crate) links: Vec<Option<Arc<LinkStats>>>,
}

/// An error on the way out of an operation, and the rank at the root of it
/// (announced to every peer).
///
/// Every failing rank announces the *root* culprit — also when it only
/// learned of the failure from another rank's abort — before it can exit.
/// Frames on a link arrive in order, so a peer that sees this rank's
/// connection close has first read the abort naming the root culprit, and a
/// chain of departures never turns into blame for the ranks that merely
/// reacted.
struct Fault {
    err: CommError,
    tell: usize,
}

impl Fault {
    fn config(rank: usize, detail: String) -> Fault {
        Fault {
            err: CommError::config(detail),
            tell: rank,
        }
    }
}

/// A rank of a host world. See the [module docs](super) for the guarantees.
///
/// It may move between threads (it is `Send`) and is used from one thread at
/// a time. After any communication error it is unusable (every later call
/// fails with the first error's text) and its peers have been told.
pub struct HostTransport {
    rank: usize,
    world: usize,
    opts: HostOptions,
    inbox: Receiver<Event>,
    /// One sender per peer; `None` at this rank's own index and after leave.
    outbox: Vec<Option<Sender<Event>>>,
    /// Messages already taken from the inbox, per source rank, in arrival
    /// order (which is send order: each link is FIFO).
    pending: Vec<VecDeque<Msg>>,
    /// Peers that said goodbye.
    departed: Vec<bool>,
    /// Events handed to each peer's outbox (compared with
    /// [`LinkStats::flushed`] to know when they are on the wire).
    queued: Vec<u64>,
    /// The first error, once one happened.
    poisoned: Option<String>,
    writers: Option<Writers>,
    left: bool,
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
        Ok(rxs
            .into_iter()
            .enumerate()
            .map(|(rank, inbox)| {
                let outbox = (0..world)
                    .map(|p| (p != rank).then(|| txs[p].clone()))
                    .collect();
                HostTransport::from_parts(rank, world, opts.clone(), inbox, outbox, None)
            })
            .collect())
    }

    pub(crate) fn from_parts(
        rank: usize,
        world: usize,
        opts: HostOptions,
        inbox: Receiver<Event>,
        outbox: Vec<Option<Sender<Event>>>,
        writers: Option<Writers>,
    ) -> HostTransport {
        HostTransport {
            rank,
            world,
            opts,
            inbox,
            outbox,
            pending: (0..world).map(|_| VecDeque::new()).collect(),
            departed: vec![false; world],
            queued: vec![0; world],
            poisoned: None,
            writers,
            left: false,
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

    fn usable(&self, op: &str) -> Result<()> {
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

    /// Run one communicating operation: refuse if unusable; on error poison
    /// the transport and tell every peer who is to blame.
    fn op<R>(&mut self, op: &str, f: impl FnOnce(&mut Self) -> Result<R, Fault>) -> Result<R> {
        self.usable(op)?;
        f(self).map_err(|fault| self.fail(fault))
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
        self.poisoned = Some(text);
        fault.err
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

    fn check_peer(&self, peer: usize, what: &str) -> Result<(), Fault> {
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

    fn check_range(&self, op: &str, range: &Range<usize>, len: usize) -> Result<(), Fault> {
        if range.start > range.end || range.end > len {
            return Err(Fault::config(
                self.rank,
                format!("{op}: range {range:?} does not fit a buffer of {len} elements"),
            ));
        }
        Ok(())
    }

    fn deadline(&self, start: Instant) -> Instant {
        start + self.opts.timeout
    }

    /// Followers of a collective wait a quarter longer than the leader, so
    /// that the leader (which knows which rank is missing) reports first.
    fn follower_deadline(&self, start: Instant) -> Instant {
        start + self.opts.timeout + self.opts.timeout / 4 + Duration::from_millis(50)
    }

    fn post(&mut self, peer: usize, op: &str, msg: Msg) -> Result<(), Fault> {
        if self.departed[peer] {
            return Err(Fault {
                err: CommError::PeerFailed {
                    rank: peer,
                    detail: format!(
                        "rank {peer} already left the world when rank {} sent it data for {op}",
                        self.rank
                    ),
                },
                tell: peer,
            });
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
            Err(Fault {
                err: CommError::PeerFailed {
                    rank: peer,
                    detail: format!(
                        "rank {peer} left the world before rank {} sent it data for {op}",
                        self.rank
                    ),
                },
                tell: peer,
            })
        } else {
            Err(Fault {
                err: CommError::PeerFailed {
                    rank: peer,
                    detail: format!(
                        "the link from rank {} to rank {peer} is closed (its transport is gone) \
                         during {op}",
                        self.rank
                    ),
                },
                tell: peer,
            })
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
            } => Err(Fault {
                err: CommError::PeerFailed {
                    rank: culprit,
                    detail: format!(
                        "rank {from} aborted the world ({detail}); rank {} was in {op}",
                        self.rank
                    ),
                },
                tell: culprit,
            }),
            Event::Closed { from, detail } => {
                if self.departed[from] {
                    // The end of stream after an orderly goodbye.
                    Ok(())
                } else {
                    Err(Fault {
                        err: CommError::PeerFailed {
                            rank: from,
                            detail: format!("{detail} (noticed by rank {} during {op})", self.rank),
                        },
                        tell: from,
                    })
                }
            }
        }
    }

    /// Wait for the next message from `peer`, which must belong to `code`.
    fn take(
        &mut self,
        peer: usize,
        op: &str,
        code: OpCode,
        deadline: Instant,
    ) -> Result<Msg, Fault> {
        loop {
            if let Some(msg) = self.pending[peer].pop_front() {
                if msg.op != code {
                    return Err(Fault {
                        err: CommError::transport(
                            op,
                            format!(
                                "rank {} expected a {} message from rank {peer} but received a {} \
                                 message with {} values: the ranks called different operations",
                                self.rank,
                                code.name(),
                                msg.op.name(),
                                msg.payload.len()
                            ),
                        ),
                        tell: peer,
                    });
                }
                return Ok(msg);
            }
            if self.departed[peer] {
                return Err(Fault {
                    err: CommError::PeerFailed {
                        rank: peer,
                        detail: format!(
                            "rank {peer} left the world (closed its transport) while rank {} \
                             waited for its part of {op}",
                            self.rank
                        ),
                    },
                    tell: peer,
                });
            }
            match self.inbox.recv_deadline(deadline) {
                Ok(ev) => self.absorb(ev, op)?,
                Err(RecvTimeoutError::Timeout) => {
                    return Err(Fault {
                        err: CommError::transport(
                            op,
                            format!(
                                "rank {} waited {:?} (the deadline) for rank {peer} and received \
                                 nothing: rank {peer} stopped answering (hung, stopped, or not in \
                                 this operation)",
                                self.rank, self.opts.timeout
                            ),
                        ),
                        tell: peer,
                    });
                }
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(Fault {
                        err: CommError::PeerFailed {
                            rank: peer,
                            detail: format!(
                                "every link into rank {} is closed while it waited for rank \
                                 {peer} in {op}",
                                self.rank
                            ),
                        },
                        tell: peer,
                    });
                }
            }
        }
    }

    /// The next `code` message from `peer`, which must carry exactly `len`
    /// values of `T`.
    fn take_values<T: Wire>(
        &mut self,
        peer: usize,
        op: &str,
        code: OpCode,
        len: usize,
        deadline: Instant,
    ) -> Result<Vec<T>, Fault> {
        let msg = self.take(peer, op, code, deadline)?;
        match T::values(msg.payload) {
            Ok(v) if v.len() == len => Ok(v),
            Ok(v) => Err(self.size_mismatch(peer, op, T::KIND, len, &T::payload(v))),
            Err(other) => Err(self.size_mismatch(peer, op, T::KIND, len, &other)),
        }
    }

    /// The star all-reduce of both reductions (for a world of two or more):
    /// every follower sends its `values` to rank 0 as `gather`; rank 0
    /// folds them into its own with `combine`, in ascending rank order, and
    /// sends the result to every follower as `result`, so all ranks end
    /// with the same values. Rank 0 waits for the gathers until
    /// [`Self::deadline`], followers for the result until the later
    /// [`Self::follower_deadline`], both counted from `start`.
    fn star_all_reduce<T: Wire>(
        &mut self,
        op: &str,
        start: Instant,
        values: &mut [T],
        (gather, result): (OpCode, OpCode),
        combine: impl Fn(&mut T, T),
    ) -> Result<(), Fault> {
        if self.rank == 0 {
            let mut acc = values.to_vec();
            let deadline = self.deadline(start);
            for p in 1..self.world {
                let v = self.take_values::<T>(p, op, gather, acc.len(), deadline)?;
                for (a, x) in acc.iter_mut().zip(v) {
                    combine(a, x);
                }
            }
            for p in 1..self.world {
                let msg = Msg {
                    op: result,
                    payload: T::payload(acc.clone()),
                };
                self.post(p, op, msg)?;
            }
            values.copy_from_slice(&acc);
        } else {
            let msg = Msg {
                op: gather,
                payload: T::payload(values.to_vec()),
            };
            self.post(0, op, msg)?;
            let deadline = self.follower_deadline(start);
            let v = self.take_values::<T>(0, op, result, values.len(), deadline)?;
            values.copy_from_slice(&v);
        }
        Ok(())
    }

    fn size_mismatch(&self, peer: usize, op: &str, kind: &str, len: usize, got: &Payload) -> Fault {
        let got = match got {
            Payload::Empty => "no values".to_string(),
            Payload::F32(v) => format!("{} f32 values", v.len()),
            Payload::I32(v) => format!("{} i32 values", v.len()),
        };
        Fault {
            err: CommError::transport(
                op,
                format!(
                    "rank {} expected {len} {kind} values from rank {peer} but received {got}: \
                     the ranks passed different sizes",
                    self.rank
                ),
            ),
            tell: peer,
        }
    }

    fn take_token(
        &mut self,
        peer: usize,
        op: &str,
        code: OpCode,
        deadline: Instant,
    ) -> Result<(), Fault> {
        let msg = self.take(peer, op, code, deadline)?;
        match msg.payload {
            Payload::Empty => Ok(()),
            other => Err(self.size_mismatch(peer, op, "no", 0, &other)),
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

/// The end of `count` values copied at `offset` into or out of a buffer of
/// `buf_len` elements, or a config error naming the copy (`what`) when they
/// do not fit.
fn copy_end(what: &str, offset: usize, count: usize, buf_len: usize) -> Result<usize> {
    offset
        .checked_add(count)
        .filter(|&e| e <= buf_len)
        .ok_or_else(|| {
            CommError::config(format!(
                "{what} of {count} values at offset {offset} does not fit a buffer of {buf_len} \
                 elements"
            ))
        })
}

/// An element type the host transport carries: how a vector of it travels
/// in a [`Payload`], and its name in size-mismatch errors.
trait Wire: Copy {
    const KIND: &'static str;
    fn payload(v: Vec<Self>) -> Payload;
    /// The values of `p` if it carries this type, else `p` back.
    fn values(p: Payload) -> std::result::Result<Vec<Self>, Payload>;
}

/// `impl Wire` for an element type carried by the `Payload` variant named.
macro_rules! wire {
    ($t:ty, $variant:ident) => {
        impl Wire for $t {
            const KIND: &'static str = stringify!($t);
            fn payload(v: Vec<$t>) -> Payload {
                Payload::$variant(v)
            }
            fn values(p: Payload) -> std::result::Result<Vec<$t>, Payload> {
                match p {
                    Payload::$variant(v) => Ok(v),
                    other => Err(other),
                }
            }
        }
    };
}

wire!(f32, F32);
wire!(i32, I32);

impl Drop for HostTransport {
    fn drop(&mut self) {
        // Errors cannot be reported from Drop; `shutdown` reports them.
        let _ = self.leave();
    }
}

impl Transport for HostTransport {
    type Buffer = Vec<f32>;

    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn alloc(&mut self, len: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; len])
    }

    fn buffer_len(buf: &Vec<f32>) -> usize {
        buf.len()
    }

    fn upload(&mut self, src: &[f32], dst: &mut Vec<f32>, offset: usize) -> Result<()> {
        let end = copy_end("upload", offset, src.len(), dst.len())?;
        dst[offset..end].copy_from_slice(src);
        Ok(())
    }

    fn download(&mut self, src: &Vec<f32>, offset: usize, dst: &mut [f32]) -> Result<()> {
        let end = copy_end("download", offset, dst.len(), src.len())?;
        dst.copy_from_slice(&src[offset..end]);
        Ok(())
    }

    /// Runs `body` eagerly: sends are queued at once and never block,
    /// receives complete in program order (see the module docs).
    fn group<R>(&mut self, body: impl FnOnce(&mut Self) -> Result<R>) -> Result<R> {
        self.usable("group")?;
        body(self)
    }

    fn send(&mut self, buf: &Vec<f32>, range: Range<usize>, peer: usize) -> Result<()> {
        self.op("send", |t| {
            t.check_peer(peer, "send to")?;
            t.check_range("send", &range, buf.len())?;
            let msg = Msg {
                op: OpCode::P2p,
                payload: Payload::F32(buf[range].to_vec()),
            };
            t.post(peer, "send", msg)
        })
    }

    fn recv(&mut self, buf: &mut Vec<f32>, range: Range<usize>, peer: usize) -> Result<()> {
        self.op("recv", |t| {
            t.check_peer(peer, "recv from")?;
            t.check_range("recv", &range, buf.len())?;
            let deadline = t.deadline(Instant::now());
            let v = t.take_values::<f32>(peer, "recv", OpCode::P2p, range.len(), deadline)?;
            buf[range].copy_from_slice(&v);
            Ok(())
        })
    }

    fn broadcast(&mut self, buf: &mut Vec<f32>, range: Range<usize>, root: usize) -> Result<()> {
        self.op("broadcast", |t| {
            if root >= t.world {
                return Err(Fault::config(
                    t.rank,
                    format!("broadcast root {root} is outside 0..{}", t.world),
                ));
            }
            t.check_range("broadcast", &range, buf.len())?;
            if t.rank == root {
                let data = buf[range].to_vec();
                for p in (0..t.world).filter(|&p| p != root) {
                    let msg = Msg {
                        op: OpCode::Broadcast,
                        payload: Payload::F32(data.clone()),
                    };
                    t.post(p, "broadcast", msg)?;
                }
            } else {
                let deadline = t.deadline(Instant::now());
                let v = t.take_values::<f32>(
                    root,
                    "broadcast",
                    OpCode::Broadcast,
                    range.len(),
                    deadline,
                )?;
                buf[range].copy_from_slice(&v);
            }
            Ok(())
        })
    }

    /// Library-sum tier: order unspecified by contract (currently: rank 0
    /// adds contributions in ascending rank order).
    fn all_reduce_sum_f32(&mut self, buf: &mut Vec<f32>, range: Range<usize>) -> Result<()> {
        const OP: &str = "all_reduce_sum_f32";
        self.op(OP, |t| {
            t.check_range(OP, &range, buf.len())?;
            let start = Instant::now();
            if t.world == 1 {
                return Ok(());
            }
            t.star_all_reduce(
                OP,
                start,
                &mut buf[range],
                (OpCode::SumGather, OpCode::SumResult),
                |a, x| *a += x,
            )
        })
    }

    fn all_reduce_max_i32(&mut self, values: &mut [i32]) -> Result<()> {
        const OP: &str = "all_reduce_max_i32";
        self.op(OP, |t| {
            let start = Instant::now();
            if t.world == 1 {
                return Ok(());
            }
            t.star_all_reduce(
                OP,
                start,
                values,
                (OpCode::MaxGather, OpCode::MaxResult),
                |a, x| *a = (*a).max(x),
            )
        })
    }

    fn barrier(&mut self) -> Result<()> {
        const OP: &str = "barrier";
        self.op(OP, |t| {
            let start = Instant::now();
            if t.world == 1 {
                return Ok(());
            }
            let token = || Msg {
                op: OpCode::BarrierRelease,
                payload: Payload::Empty,
            };
            if t.rank == 0 {
                let deadline = t.deadline(start);
                for p in 1..t.world {
                    t.take_token(p, OP, OpCode::BarrierArrive, deadline)?;
                }
                for p in 1..t.world {
                    t.post(p, OP, token())?;
                }
            } else {
                let arrive = Msg {
                    op: OpCode::BarrierArrive,
                    payload: Payload::Empty,
                };
                t.post(0, OP, arrive)?;
                let deadline = t.follower_deadline(start);
                t.take_token(0, OP, OpCode::BarrierRelease, deadline)?;
            }
            Ok(())
        })
    }
}
