//! The TCP rendezvous: a tiny key/value store served by rank 0, for
//! launchers that give `MASTER_ADDR`/`MASTER_PORT` and no shared
//! filesystem (the multi-node case).
//!
//! Rank 0 serves the store inside its own process, so the store lives
//! exactly as long as rank 0's [`TcpRendezvous`]: nothing a launch published
//! survives it, and a new launch that reuses the job id and the address
//! starts from an empty store. While a store is alive it admits each rank
//! once: a process of a newer launch that reaches an older launch's
//! still-running store (same address) is refused when it claims a rank that
//! already joined, instead of reading that launch's values.
//!
//! Wire protocol (one request, one response, on a persistent connection):
//! request `op u8, key len u32 LE, key, value len u32 LE, value`;
//! response `status u8 (0 ok, 1 missing, 2 refused), len u32 LE, payload`.
//! Ops: `JOIN` (value: rank u32, world u32; must come first), `SET`, `GET`,
//! `ADD` (value: i64 LE; answers the new i64). The store never blocks a
//! request; clients poll with backoff until their deadline.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::barrier::BarrierCounts;
use super::store::{
    push_field, read_field, LaunchSecret, StoreServer, MAX_KEY, MAX_VALUE, OP_ADD, OP_GET, OP_JOIN,
    OP_SET, SECRET_LEN, ST_OK,
};
use crate::poll::Backoff;
use crate::{CommError, Rendezvous, Result};

/// A rendezvous through a store served by rank 0. See the [module docs](self).
pub struct TcpRendezvous {
    rank: usize,
    world: usize,
    location: String,
    conn: Mutex<TcpStream>,
    server: Option<StoreServer>,
    barrier_counts: BarrierCounts,
}

impl std::fmt::Debug for TcpRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpRendezvous")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .field("location", &self.location)
            .field("serving", &self.server.is_some())
            .finish()
    }
}

impl TcpRendezvous {
    /// Join the store at `host:port` as `rank` of `world`; rank 0 first
    /// starts serving it there (port 0: any free port, see
    /// [`TcpRendezvous::store_port`]). Others retry connecting until
    /// `timeout`, which also bounds every later request to the store.
    ///
    /// Keep rank 0's value alive until every rank is done with the
    /// rendezvous: dropping it stops the store.
    pub fn new(
        host: &str,
        port: u16,
        rank: usize,
        world: usize,
        secret: LaunchSecret,
        timeout: Duration,
    ) -> Result<Self> {
        if world == 0 || rank >= world {
            return Err(CommError::config(format!(
                "rank {rank} of world {world}: expected world >= 1 and rank < world"
            )));
        }
        let location = format!("tcp://{host}:{port}");
        let fail = |detail: String| CommError::Rendezvous {
            rank,
            location: location.clone(),
            timeout,
            detail,
        };
        let addrs: Vec<SocketAddr> = (host, port)
            .to_socket_addrs()
            .map_err(|e| fail(format!("cannot resolve the store host: {e}")))?
            .collect();
        if addrs.is_empty() {
            return Err(fail("the store host resolves to no address".into()));
        }
        let (server, connect_to) = if rank == 0 {
            let server = StoreServer::start(host, &addrs, world, secret).map_err(|e| {
                fail(format!(
                    "rank 0 cannot serve the store: {e} (is an earlier launch still running at \
                     this address? choose another MASTER_PORT or MAMBA_STORE_PORT)"
                ))
            })?;
            // Rank 0 reaches its own store locally, whatever the interface.
            let ip = match server.bound.ip() {
                IpAddr::V4(v4) if v4.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
                IpAddr::V6(v6) if v6.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
                ip => ip,
            };
            let target = SocketAddr::new(ip, server.port);
            (Some(server), vec![target])
        } else {
            (None, addrs)
        };
        let location = match &server {
            Some(s) => format!("tcp://{host}:{}", s.port),
            None => location.clone(),
        };
        let deadline = Instant::now() + timeout;
        let mut last = String::from("no attempt made");
        let mut backoff = Backoff::rendezvous();
        let stream = 'connect: loop {
            for a in &connect_to {
                let left = deadline.saturating_duration_since(Instant::now());
                match TcpStream::connect_timeout(
                    a,
                    left.clamp(Duration::from_millis(1), Duration::from_secs(1)),
                ) {
                    Ok(s) => break 'connect s,
                    Err(e) => last = format!("{a}: {e}"),
                }
            }
            if backoff.pause(deadline).is_err() {
                return Err(CommError::Rendezvous {
                    rank,
                    location,
                    timeout,
                    detail: format!(
                        "the store (served by rank 0) never answered; last error {last}. Is rank 0 \
                         running and is its address reachable from here?"
                    ),
                });
            }
        };
        let _ = stream.set_nodelay(true);
        stream
            .set_read_timeout(Some(timeout.max(Duration::from_millis(1))))
            .and_then(|_| stream.set_write_timeout(Some(timeout.max(Duration::from_millis(1)))))
            .map_err(|e| fail(format!("socket option: {e}")))?;
        let me = TcpRendezvous {
            rank,
            world,
            location,
            conn: Mutex::new(stream),
            server,
            barrier_counts: BarrierCounts::default(),
        };
        let mut join = Vec::with_capacity(8 + SECRET_LEN);
        join.extend_from_slice(&(rank as u32).to_le_bytes());
        join.extend_from_slice(&(world as u32).to_le_bytes());
        join.extend_from_slice(secret.bytes());
        match me.request(OP_JOIN, "", &join, timeout)? {
            (ST_OK, _) => Ok(me),
            (_, msg) => Err(CommError::Rendezvous {
                rank,
                location: me.location.clone(),
                timeout,
                detail: format!(
                    "the store refused this rank: {}",
                    String::from_utf8_lossy(&msg)
                ),
            }),
        }
    }

    /// The port rank 0's store listens on (rank 0 only).
    pub fn store_port(&self) -> Option<u16> {
        self.server.as_ref().map(|s| s.port)
    }

    /// The store's address, as used in error messages.
    pub fn location(&self) -> &str {
        &self.location
    }

    fn request(&self, op: u8, key: &str, value: &[u8], timeout: Duration) -> Result<(u8, Vec<u8>)> {
        let mut conn = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        let mut msg = Vec::with_capacity(10 + key.len() + value.len());
        msg.push(op);
        push_field(&mut msg, key.as_bytes());
        push_field(&mut msg, value);
        let res = conn.write_all(&msg).and_then(|_| {
            let mut status = [0u8; 1];
            conn.read_exact(&mut status)?;
            let payload = read_field(&mut *conn, MAX_VALUE, "oversized answer")?;
            Ok((status[0], payload))
        });
        res.map_err(|e| CommError::Rendezvous {
            rank: self.rank,
            location: self.location.clone(),
            timeout,
            detail: format!(
                "lost the store (served by rank 0): {e}; rank 0 exited or died, or stopped answering"
            ),
        })
    }

    fn check_key(key: &str) -> Result<()> {
        if key.is_empty() || key.len() > MAX_KEY as usize {
            return Err(CommError::config(format!(
                "rendezvous key {key:?} must have 1..={MAX_KEY} bytes"
            )));
        }
        Ok(())
    }
}

impl Rendezvous for TcpRendezvous {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        TcpRendezvous::check_key(key)?;
        if value.len() > MAX_VALUE as usize {
            return Err(CommError::config(format!(
                "rendezvous value of {} bytes exceeds the store's limit of {MAX_VALUE}",
                value.len()
            )));
        }
        match self.request(OP_SET, key, value, Duration::ZERO)? {
            (ST_OK, _) => Ok(()),
            (_, msg) => Err(CommError::Rendezvous {
                rank: self.rank,
                location: format!("{}/{key}", self.location),
                timeout: Duration::ZERO,
                detail: format!(
                    "the store refused the value: {}",
                    String::from_utf8_lossy(&msg)
                ),
            }),
        }
    }

    fn fetch(&self, key: &str, len: usize, timeout: Duration) -> Result<Vec<u8>> {
        TcpRendezvous::check_key(key)?;
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::rendezvous();
        let mut seen_len = None;
        loop {
            match self.request(OP_GET, key, &[], timeout)? {
                (ST_OK, v) if v.len() == len => return Ok(v),
                (ST_OK, v) => seen_len = Some(v.len()),
                _ => {}
            }
            if backoff.pause(deadline).is_err() {
                let detail = match seen_len {
                    Some(n) => format!("expected exactly {len} bytes; the store holds {n}"),
                    None => format!(
                        "expected a value of exactly {len} bytes; it was never published (the \
                         publishing rank has not reached this point, or died)"
                    ),
                };
                return Err(CommError::Rendezvous {
                    rank: self.rank,
                    location: format!("{}/{key}", self.location),
                    timeout,
                    detail,
                });
            }
        }
    }

    fn peek(&self, key: &str) -> Result<Option<Vec<u8>>> {
        TcpRendezvous::check_key(key)?;
        match self.request(OP_GET, key, &[], Duration::ZERO)? {
            (ST_OK, v) => Ok(Some(v)),
            _ => Ok(None),
        }
    }

    fn barrier(&self, name: &str, timeout: Duration) -> Result<()> {
        let gen = self.barrier_counts.next(name);
        let key = format!("barrier/{name}/{gen}");
        TcpRendezvous::check_key(&key)?;
        self.request(OP_ADD, &key, &1i64.to_le_bytes(), timeout)?;
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::rendezvous();
        loop {
            let count = match self.request(OP_GET, &key, &[], timeout)? {
                (ST_OK, v) if v.len() == 8 => {
                    i64::from_le_bytes([v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]])
                }
                _ => 0,
            };
            if count >= self.world as i64 {
                return Ok(());
            }
            if backoff.pause(deadline).is_err() {
                return Err(CommError::Rendezvous {
                    rank: self.rank,
                    location: format!("{}/{key}", self.location),
                    timeout,
                    detail: format!(
                        "barrier {name:?} (#{gen}): {count} of {} ranks arrived",
                        self.world
                    ),
                });
            }
        }
    }
}
