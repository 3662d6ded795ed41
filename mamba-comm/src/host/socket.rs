//! Socket worlds: one process per rank, a full mesh of TCP connections found
//! through a [`Rendezvous`].
//!
//! Meeting protocol (every key is prefixed with [`HostOptions::tag`]):
//! 1. rank 0 draws a 16-byte random world token and publishes it as
//!    `<tag>-token`; the others fetch it;
//! 2. every rank listens on `bind:0` and publishes its address as
//!    `<tag>-addr-<rank>` (16-byte IPv6 or v4-mapped address, 2-byte port);
//! 3. rank `i` connects to every `j < i` and introduces itself with a hello
//!    (magic, token, from, to, world); `j` answers one byte when it accepts.
//!    Stray or mistaken connections (wrong magic, token, target or world)
//!    are dropped and waited past. Lower ranks accept from higher ranks.
//!
//! Each connection then gets a writer thread (drains an unbounded queue,
//! so sends never block) and a reader thread (feeds this rank's inbox and
//! turns a broken connection into an `Event::Closed`).

use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};

use super::engine::HostTransport;
use super::link::{LinkStats, Writers};
use super::message::{decode_gated, encode, Event, OpCode};
use super::HostOptions;
use crate::bootstrap::random_bytes;
use crate::flight::FlightRecorder;
use crate::{CommError, Rendezvous, Result};

const MAGIC: &[u8; 8] = b"MAMBAHT1";
const HELLO_LEN: usize = 8 + 16 + 4 + 4 + 4;
const ADDR_LEN: usize = 18;
const TOKEN_LEN: usize = 16;

fn encode_addr(addr: SocketAddr) -> [u8; ADDR_LEN] {
    let ip = match addr.ip() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    };
    let mut out = [0u8; ADDR_LEN];
    out[..16].copy_from_slice(&ip.octets());
    out[16..].copy_from_slice(&addr.port().to_be_bytes());
    out
}

fn decode_addr(bytes: &[u8]) -> Option<SocketAddr> {
    if bytes.len() != ADDR_LEN {
        return None;
    }
    let mut octets = [0u8; 16];
    octets.copy_from_slice(&bytes[..16]);
    let v6 = Ipv6Addr::from(octets);
    let ip = match v6.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(v6),
    };
    Some(SocketAddr::new(
        ip,
        u16::from_be_bytes([bytes[16], bytes[17]]),
    ))
}

fn hello(token: &[u8; TOKEN_LEN], from: usize, to: usize, world: usize) -> [u8; HELLO_LEN] {
    let mut out = [0u8; HELLO_LEN];
    out[..8].copy_from_slice(MAGIC);
    out[8..24].copy_from_slice(token);
    out[24..28].copy_from_slice(&(from as u32).to_le_bytes());
    out[28..32].copy_from_slice(&(to as u32).to_le_bytes());
    out[32..36].copy_from_slice(&(world as u32).to_le_bytes());
    out
}

fn remaining(deadline: Instant) -> Duration {
    deadline.saturating_duration_since(Instant::now())
}

fn connect_error(rank: usize, detail: String) -> CommError {
    CommError::transport("connect", format!("rank {rank}: {detail}"))
}

impl HostTransport {
    /// Join a socket world: this process is rank `rdv.rank()` of
    /// `rdv.world()`. Every rank of the launch must call it with the same
    /// `opts.tag`. Fails after `opts.timeout` if some rank never shows up,
    /// naming the missing ranks.
    pub fn connect(rdv: &dyn Rendezvous, opts: HostOptions) -> Result<HostTransport> {
        let (rank, world) = (rdv.rank(), rdv.world());
        if world == 0 || rank >= world {
            return Err(CommError::config(format!(
                "rendezvous reports rank {rank} of world {world}; expected rank < world"
            )));
        }
        let (inbox_tx, inbox_rx) = unbounded();
        let flight = FlightRecorder::from_env(rank, world, rdv.shared_dir())?;
        if world == 1 {
            return Ok(HostTransport::from_parts(
                0,
                1,
                opts,
                inbox_rx,
                vec![None],
                None,
                flight,
            ));
        }
        let deadline = Instant::now() + opts.timeout;
        let max_values = opts.max_values;
        let tag = &opts.tag;
        let listener = TcpListener::bind((opts.bind, 0))
            .map_err(|e| connect_error(rank, format!("cannot listen on {}:0: {e}", opts.bind)))?;
        let local = listener
            .local_addr()
            .map_err(|e| connect_error(rank, format!("listener has no address: {e}")))?;

        let token_key = format!("{tag}-token");
        let token: [u8; TOKEN_LEN] = if rank == 0 {
            let t = random_bytes::<TOKEN_LEN>()?;
            rdv.publish(&token_key, &t)?;
            t
        } else {
            let v = rdv.fetch(&token_key, TOKEN_LEN, remaining(deadline))?;
            let mut t = [0u8; TOKEN_LEN];
            t.copy_from_slice(&v);
            t
        };
        rdv.publish(&format!("{tag}-addr-{rank}"), &encode_addr(local))?;

        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            let raw = rdv.fetch(&format!("{tag}-addr-{peer}"), ADDR_LEN, remaining(deadline))?;
            let addr = decode_addr(&raw).ok_or_else(|| {
                connect_error(rank, format!("rank {peer} published a malformed address"))
            })?;
            *slot = Some(dial(rank, peer, world, addr, &token, deadline)?);
        }
        accept_higher(&listener, rank, world, &token, &mut streams, deadline)?;

        let (done_tx, done_rx) = unbounded();
        let mut outbox = Vec::with_capacity(world);
        let mut links = Vec::with_capacity(world);
        for (peer, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else {
                outbox.push(None);
                links.push(None);
                continue;
            };
            let stats = Arc::new(LinkStats::default());
            let _ = stream.set_nodelay(true);
            stream
                .set_read_timeout(None)
                .and_then(|_| stream.set_write_timeout(None))
                .map_err(|e| {
                    connect_error(rank, format!("configuring link to rank {peer}: {e}"))
                })?;
            let read_half = stream
                .try_clone()
                .map_err(|e| connect_error(rank, format!("cloning link to rank {peer}: {e}")))?;
            let (tx, rx) = unbounded();
            let inbox = inbox_tx.clone();
            let st = stats.clone();
            thread::Builder::new()
                .name(format!("mamba-host-read-{peer}"))
                .spawn(move || reader(read_half, inbox, peer, max_values, &st))
                .map_err(|e| connect_error(rank, format!("starting reader thread: {e}")))?;
            let inbox = inbox_tx.clone();
            let done = done_tx.clone();
            let st = stats.clone();
            thread::Builder::new()
                .name(format!("mamba-host-write-{peer}"))
                .spawn(move || {
                    let res = writer(stream, rx, &inbox, &st, peer);
                    st.finished.store(true, Ordering::Release);
                    let _ = done.send(res);
                })
                .map_err(|e| connect_error(rank, format!("starting writer thread: {e}")))?;
            outbox.push(Some(tx));
            links.push(Some(stats));
        }
        let writers = Writers {
            done: done_rx,
            count: world - 1,
            links,
        };
        Ok(HostTransport::from_parts(
            rank,
            world,
            opts,
            inbox_rx,
            outbox,
            Some(writers),
            flight,
        ))
    }
}

/// Connect to lower rank `peer` and have it accept us.
fn dial(
    rank: usize,
    peer: usize,
    world: usize,
    addr: SocketAddr,
    token: &[u8; TOKEN_LEN],
    deadline: Instant,
) -> Result<TcpStream> {
    let mut last_err = String::from("no attempt made");
    while Instant::now() < deadline {
        let attempt = remaining(deadline)
            .min(Duration::from_secs(1))
            .max(Duration::from_millis(1));
        match TcpStream::connect_timeout(&addr, attempt) {
            Ok(mut s) => {
                s.set_read_timeout(Some(remaining(deadline).max(Duration::from_millis(1))))
                    .map_err(|e| connect_error(rank, format!("socket option: {e}")))?;
                s.write_all(&hello(token, rank, peer, world)).map_err(|e| {
                    connect_error(rank, format!("hello to rank {peer} at {addr}: {e}"))
                })?;
                let mut ack = [0u8; 1];
                return match s.read_exact(&mut ack) {
                    Ok(()) if ack[0] == 1 => Ok(s),
                    Ok(()) => Err(connect_error(
                        rank,
                        format!("rank {peer} at {addr} refused us"),
                    )),
                    Err(e) => Err(connect_error(
                        rank,
                        format!("rank {peer} at {addr} did not accept our hello: {e}"),
                    )),
                };
            }
            Err(e) => {
                last_err = e.to_string();
                thread::sleep(Duration::from_millis(10));
            }
        }
    }
    Err(connect_error(
        rank,
        format!(
            "could not reach rank {peer} at {addr} before the deadline (last error: {last_err})"
        ),
    ))
}

/// Accept one connection from every rank above `rank`.
fn accept_higher(
    listener: &TcpListener,
    rank: usize,
    world: usize,
    token: &[u8; TOKEN_LEN],
    streams: &mut [Option<TcpStream>],
    deadline: Instant,
) -> Result<()> {
    listener
        .set_nonblocking(true)
        .map_err(|e| connect_error(rank, format!("socket option: {e}")))?;
    let missing = |streams: &[Option<TcpStream>]| -> Vec<usize> {
        (rank + 1..world)
            .filter(|&p| streams[p].is_none())
            .collect()
    };
    while !missing(streams).is_empty() {
        if Instant::now() >= deadline {
            return Err(connect_error(
                rank,
                format!(
                    "ranks {:?} did not connect within the deadline (they never started, died, \
                     or use a different rendezvous)",
                    missing(streams)
                ),
            ));
        }
        let mut s = match listener.accept() {
            Ok((s, _)) => s,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(2));
                continue;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(connect_error(rank, format!("accept failed: {e}"))),
        };
        // A stray connection must not hold us past the deadline.
        let wait = remaining(deadline)
            .min(Duration::from_secs(5))
            .max(Duration::from_millis(1));
        if s.set_nonblocking(false)
            .and_then(|_| s.set_read_timeout(Some(wait)))
            .is_err()
        {
            continue;
        }
        let mut h = [0u8; HELLO_LEN];
        if s.read_exact(&mut h).is_err() || &h[..8] != MAGIC || &h[8..24] != token {
            continue;
        }
        let word = |i: usize| u32::from_le_bytes([h[i], h[i + 1], h[i + 2], h[i + 3]]) as usize;
        let (from, to, their_world) = (word(24), word(28), word(32));
        if to != rank
            || their_world != world
            || from <= rank
            || from >= world
            || streams[from].is_some()
        {
            continue;
        }
        if s.write_all(&[1]).is_ok() {
            streams[from] = Some(s);
        }
    }
    Ok(())
}

/// Drain `rx` onto the socket; flush whenever the queue runs dry (and count
/// what was flushed in `stats`). When the transport drops its sender, flush
/// and close our write half, so the peer reads a clean end after our
/// goodbye.
///
/// Errors are reported (as `Event::Closed` to this rank and as the result)
/// only while they can matter: once this rank has queued its goodbye or an
/// abort it is leaving, and once the peer said goodbye it needs nothing
/// more; a peer that exits and resets the connection is then not a failure.
fn writer(
    stream: TcpStream,
    rx: Receiver<Event>,
    inbox: &Sender<Event>,
    stats: &LinkStats,
    peer: usize,
) -> std::result::Result<(), String> {
    let mut out = BufWriter::with_capacity(1 << 16, &stream);
    let mut bytes = Vec::new();
    let mut unflushed = 0u64;
    let mut leaving = false;
    for ev in rx.iter() {
        leaving |= matches!(ev, Event::Bye { .. } | Event::Abort { .. });
        bytes.clear();
        encode(&ev, &mut bytes);
        unflushed += 1;
        let mut res = out.write_all(&bytes);
        if res.is_ok() && rx.is_empty() {
            res = out.flush();
            if res.is_ok() {
                stats.flushed.fetch_add(unflushed, Ordering::Release);
                unflushed = 0;
            }
        }
        if let Err(e) = res {
            if leaving || stats.peer_left.load(Ordering::Acquire) {
                return Ok(());
            }
            let detail =
                format!("writing to rank {peer} failed ({e}): its process died or the link broke");
            let _ = inbox.send(Event::Closed {
                from: peer,
                detail: detail.clone(),
            });
            return Err(detail);
        }
    }
    let res = out.flush();
    if res.is_ok() {
        stats.flushed.fetch_add(unflushed, Ordering::Release);
    }
    // The peer may already have closed (and reset) its end: nothing to report.
    let _ = stream.shutdown(Shutdown::Write);
    match res {
        Err(e) if !leaving && !stats.peer_left.load(Ordering::Acquire) => {
            Err(format!("flushing the link to rank {peer}: {e}"))
        }
        _ => Ok(()),
    }
}

/// Frames of at most this many values are read as they arrive, before
/// their receive is posted (what keeps small collectives pipelined); a
/// larger frame waits at the link's [`Gate`](super::link::Gate) until the
/// receive it belongs to says how much it expects.
const EAGER_VALUES: u64 = 1 << 16;

/// Feed every event from `peer` into the inbox; a broken or closed
/// connection becomes `Event::Closed` (ignored by the engine after a
/// goodbye). A data frame of more than [`EAGER_VALUES`] values is read
/// only once the engine waits for it and only if it carries at most what
/// that receive expects; otherwise it becomes `Event::Refused` naming the
/// peer, nothing of its payload is read, and the reader stops.
fn reader(
    stream: impl Read,
    inbox: Sender<Event>,
    peer: usize,
    max_values: usize,
    stats: &LinkStats,
) {
    let mut input = BufReader::with_capacity(1 << 16, stream);
    // Data frames seen on this link: the index of the next one.
    let mut frames: u64 = 0;
    let mut admit = |op: OpCode, count: u64| -> Option<String> {
        let index = frames;
        frames += 1;
        if count <= EAGER_VALUES {
            return None;
        }
        match stats.gate.wait_for(index) {
            None => Some(format!(
                "rank {peer}'s {} frame of {count} values was not read: this rank's transport \
                 takes nothing more",
                op.name()
            )),
            Some(w) if count > w.limit as u64 || op != w.op => Some(format!(
                "rank {peer} sent a {} frame claiming {count} values where the receive it \
                 belongs to (a {} of at most {} values) expects less: the ranks passed \
                 different sizes or called different operations (nothing of the frame was \
                 read or allocated)",
                op.name(),
                w.op.name(),
                w.limit
            )),
            Some(_) => None,
        }
    };
    loop {
        let ev = match decode_gated(&mut input, peer, max_values, &mut admit) {
            Ok(Some(ev)) => ev,
            Ok(None) => Event::Closed {
                from: peer,
                detail: format!(
                    "rank {peer} closed its connection without a goodbye (its process died or \
                     exited without dropping its transport)"
                ),
            },
            Err(e) => Event::Closed {
                from: peer,
                detail: format!(
                    "reading from rank {peer} failed: {e} (its process died or the link broke)"
                ),
            },
        };
        if matches!(ev, Event::Bye { .. }) {
            stats.peer_left.store(true, Ordering::Release);
        }
        let last = matches!(ev, Event::Closed { .. } | Event::Refused { .. });
        if inbox.send(ev).is_err() || last {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::link::Wanted;
    use crate::host::message::{Msg, Payload};
    use std::os::unix::net::UnixStream;

    fn frame(values: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let msg = Msg {
            op: OpCode::P2p,
            payload: Payload::F32(vec![0.25; values]),
        };
        encode(&Event::Msg { from: 0, msg }, &mut out);
        out
    }

    /// A hand-crafted frame header (tag, op, kind, count) claiming `count`
    /// f32 values, with no payload behind it.
    fn lying_header(count: u64) -> Vec<u8> {
        let mut h = frame(1)[..11].to_vec();
        h[3..11].copy_from_slice(&count.to_le_bytes());
        h
    }

    fn start_reader(peer: usize) -> (UnixStream, Arc<LinkStats>, Receiver<Event>) {
        let (ours, theirs) = UnixStream::pair().expect("socket pair");
        let stats = Arc::new(LinkStats::default());
        let (tx, rx) = unbounded();
        let st = stats.clone();
        thread::spawn(move || reader(theirs, tx, peer, usize::MAX, &st));
        (ours, stats, rx)
    }

    #[test]
    fn a_large_frame_claiming_more_than_its_receive_expects_is_refused_unread() {
        let (mut wire, stats, inbox) = start_reader(3);
        wire.write_all(&lying_header(1 << 30)).expect("write");
        // Held until the receive it belongs to is posted: nothing yet.
        assert!(inbox.recv_timeout(Duration::from_millis(100)).is_err());
        stats.gate.want(Wanted {
            index: 0,
            op: OpCode::P2p,
            limit: 10,
        });
        match inbox.recv_timeout(Duration::from_secs(5)) {
            Ok(Event::Refused { from: 3, detail }) => assert!(
                detail.contains("rank 3")
                    && detail.contains("1073741824 values")
                    && detail.contains("at most 10"),
                "{detail}"
            ),
            other => panic!("{other:?}"),
        }
        // The reader stopped (and closed its end): nothing more arrives.
        let _ = wire.write_all(&frame(2));
        assert!(inbox.recv_timeout(Duration::from_millis(100)).is_err());
    }

    /// The case the first gate (26b7fcb, reverted) got wrong: a large frame
    /// queued behind small ones belongs to a later receive than the one
    /// waiting when it arrives.
    #[test]
    fn small_frames_pass_at_once_and_a_large_one_waits_for_its_own_receive() {
        let (wire, stats, inbox) = start_reader(1);
        let big = EAGER_VALUES as usize + 1;
        // The large frame fills the socket buffer while it is held: write
        // from another thread, as a peer's writer thread does.
        let writer = thread::spawn(move || {
            let mut wire = wire;
            wire.write_all(&frame(2)).expect("write");
            wire.write_all(&frame(big)).expect("write");
            wire
        });
        let first = inbox
            .recv_timeout(Duration::from_secs(5))
            .expect("small frame");
        assert!(matches!(&first, Event::Msg { msg, .. } if msg.payload.len() == 2));
        // The receive of message 0 (2 values) is the one waiting: the large
        // frame (message 1) is not compared with it.
        stats.gate.want(Wanted {
            index: 0,
            op: OpCode::P2p,
            limit: 2,
        });
        assert!(inbox.recv_timeout(Duration::from_millis(100)).is_err());
        stats.gate.want(Wanted {
            index: 1,
            op: OpCode::P2p,
            limit: big,
        });
        let second = inbox
            .recv_timeout(Duration::from_secs(5))
            .expect("large frame");
        assert!(matches!(&second, Event::Msg { msg, .. } if msg.payload.len() == big));
        drop(writer.join().expect("writer"));
    }

    #[test]
    fn a_closed_gate_releases_a_held_frame() {
        let (mut wire, stats, inbox) = start_reader(2);
        wire.write_all(&lying_header(1 << 20)).expect("write");
        stats.gate.close();
        match inbox.recv_timeout(Duration::from_secs(5)) {
            Ok(Event::Refused { from: 2, detail }) => {
                assert!(detail.contains("takes nothing more"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn addresses_roundtrip() {
        for a in ["127.0.0.1:5000", "[::1]:65535", "10.1.2.3:1"] {
            let addr: SocketAddr = a.parse().expect("addr");
            assert_eq!(decode_addr(&encode_addr(addr)), Some(addr));
        }
        assert_eq!(decode_addr(&[0u8; 5]), None);
    }
}
