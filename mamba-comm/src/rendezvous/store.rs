//! The TCP store: served by rank 0 of a [`super::TcpRendezvous`], one
//! thread per connection. The wire protocol is described in the `tcp`
//! module's docs; its constants live here, with the side that enforces them.

use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

pub(super) const OP_JOIN: u8 = 1;
pub(super) const OP_SET: u8 = 2;
pub(super) const OP_GET: u8 = 3;
pub(super) const OP_ADD: u8 = 4;

pub(super) const ST_OK: u8 = 0;
pub(super) const ST_MISSING: u8 = 1;
pub(super) const ST_REFUSED: u8 = 2;

pub(super) const MAX_KEY: u32 = 1024;
pub(super) const MAX_VALUE: u32 = 1 << 20;

struct StoreState {
    world: usize,
    secret: LaunchSecret,
    joined: Vec<bool>,
    values: HashMap<String, Vec<u8>>,
}

/// The store's threads: an accept loop and one thread per connection.
/// Dropping it stops accepting, shuts every connection down and waits for
/// the accept loop (which polls a stop flag every few milliseconds).
pub(super) struct StoreServer {
    pub(super) port: u16,
    pub(super) bound: SocketAddr,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    accept: Option<JoinHandle<()>>,
}

impl StoreServer {
    /// Serve the store of a world of `world` ranks that present `secret`,
    /// listening at [`bind_address`]`(host, addrs)`.
    pub(super) fn start(
        host: &str,
        addrs: &[SocketAddr],
        world: usize,
        secret: LaunchSecret,
    ) -> std::io::Result<StoreServer> {
        let bind = bind_address(host, addrs);
        let listener = TcpListener::bind(bind)?;
        let bound = listener.local_addr()?;
        let port = bound.port();
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let state = Arc::new(Mutex::new(StoreState {
            world,
            secret,
            joined: vec![false; world],
            values: HashMap::new(),
        }));
        let accept = {
            let (stop, conns) = (stop.clone(), conns.clone());
            thread::Builder::new()
                .name("mamba-store".into())
                .spawn(move || accept_loop(listener, stop, conns, state))?
        };
        Ok(StoreServer {
            port,
            bound,
            stop,
            conns,
            accept: Some(accept),
        })
    }
}

impl Drop for StoreServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(h) = self.accept.take() {
            let _ = h.join();
        }
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    state: Arc<Mutex<StoreState>>,
) {
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((s, _)) => {
                if s.set_nonblocking(false).is_err() {
                    continue;
                }
                let _ = s.set_nodelay(true);
                if let Ok(c) = s.try_clone() {
                    conns.lock().unwrap_or_else(|p| p.into_inner()).push(c);
                }
                let state = state.clone();
                let _ = thread::Builder::new()
                    .name("mamba-store-conn".into())
                    .spawn(move || serve(s, state));
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => thread::sleep(Duration::from_millis(5)),
            Err(_) => thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// One length-prefixed field of the wire protocol: a `u32` LE length,
/// refused (as `oversized`) above `max`, then that many bytes. Both sides
/// read with it.
pub(super) fn read_field(r: &mut impl Read, max: u32, oversized: &str) -> std::io::Result<Vec<u8>> {
    let mut n = [0u8; 4];
    r.read_exact(&mut n)?;
    let len = u32::from_le_bytes(n);
    if len > max {
        return Err(std::io::Error::new(ErrorKind::InvalidData, oversized));
    }
    let mut field = vec![0u8; len as usize];
    r.read_exact(&mut field)?;
    Ok(field)
}

/// Append `bytes` as one length-prefixed field (the writer's side of
/// [`read_field`]); callers keep fields within the protocol's limits.
pub(super) fn push_field(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn read_frame(s: &mut TcpStream) -> std::io::Result<(u8, String, Vec<u8>)> {
    let mut op = [0u8; 1];
    s.read_exact(&mut op)?;
    let key = read_field(s, MAX_KEY, "oversized key")?;
    let value = read_field(s, MAX_VALUE, "oversized value")?;
    let key = String::from_utf8(key)
        .map_err(|_| std::io::Error::new(ErrorKind::InvalidData, "key is not utf-8"))?;
    Ok((op[0], key, value))
}

fn reply(s: &mut TcpStream, status: u8, payload: &[u8]) -> std::io::Result<()> {
    let mut out = Vec::with_capacity(5 + payload.len());
    out.push(status);
    push_field(&mut out, payload);
    s.write_all(&out)
}

/// Serve one client until it disconnects or breaks the protocol. The first
/// request must be a JOIN that claims a rank not yet joined.
fn serve(mut s: TcpStream, state: Arc<Mutex<StoreState>>) {
    let mut joined = false;
    while let Ok((op, key, value)) = read_frame(&mut s) {
        let lock = || state.lock().unwrap_or_else(|p| p.into_inner());
        let res = match op {
            OP_JOIN if !joined && value.len() == 8 + SECRET_LEN => {
                let rank = u32::from_le_bytes([value[0], value[1], value[2], value[3]]) as usize;
                let world = u32::from_le_bytes([value[4], value[5], value[6], value[7]]) as usize;
                let mut st = lock();
                if !st.secret.matches(&value[8..]) {
                    let msg = "the launch secret does not match: this store serves another job \
                               (its MASTER_ADDR/MASTER_PORT were reused by another launch), or the \
                               peer is not part of this job";
                    reply(&mut s, ST_REFUSED, msg.as_bytes())
                } else if world != st.world {
                    let msg = format!("this store serves a world of {}, not {world}", st.world);
                    reply(&mut s, ST_REFUSED, msg.as_bytes())
                } else if rank >= world {
                    let msg = format!("rank {rank} is outside 0..{world}");
                    reply(&mut s, ST_REFUSED, msg.as_bytes())
                } else if st.joined[rank] {
                    let msg = format!(
                        "rank {rank} already joined this store: it belongs to another launch that \
                         is still running at this address, or two processes claim rank {rank}"
                    );
                    reply(&mut s, ST_REFUSED, msg.as_bytes())
                } else {
                    st.joined[rank] = true;
                    joined = true;
                    reply(&mut s, ST_OK, &[])
                }
            }
            _ if !joined => reply(
                &mut s,
                ST_REFUSED,
                b"the first request must be a valid JOIN",
            ),
            OP_SET => {
                lock().values.insert(key, value);
                reply(&mut s, ST_OK, &[])
            }
            OP_GET => {
                let v = lock().values.get(&key).cloned();
                match v {
                    Some(v) => reply(&mut s, ST_OK, &v),
                    None => reply(&mut s, ST_MISSING, &[]),
                }
            }
            OP_ADD if value.len() == 8 => {
                let delta = i64::from_le_bytes([
                    value[0], value[1], value[2], value[3], value[4], value[5], value[6], value[7],
                ]);
                let mut st = lock();
                let cur = st
                    .values
                    .get(&key)
                    .filter(|v| v.len() == 8)
                    .map(|v| i64::from_le_bytes([v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]]))
                    .unwrap_or(0);
                let new = cur.wrapping_add(delta).to_le_bytes();
                st.values.insert(key, new.to_vec());
                drop(st);
                reply(&mut s, ST_OK, &new)
            }
            _ => reply(&mut s, ST_REFUSED, b"unknown or malformed request"),
        };
        if res.is_err() {
            return;
        }
    }
}

/// Bytes of a [`LaunchSecret`].
pub(super) const SECRET_LEN: usize = 32;

/// What a rank presents to join a store: SHA-256 of the launch's job id,
/// which every rank of one launch knows from its launcher (torchrun's run
/// id, SLURM's job and step) and a process of another job does not
/// present. It keeps other launches (and stray connections) out of a store
/// that listens on every interface; it is not a defence against a user who
/// can read the job's environment.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LaunchSecret([u8; SECRET_LEN]);

impl LaunchSecret {
    /// The secret of the launch whose job id is `job_id`.
    pub fn of_job(job_id: &str) -> Self {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"mamba-store-secret-v1\n");
        h.update(job_id.as_bytes());
        LaunchSecret(h.finalize().into())
    }

    /// The bytes sent in a JOIN.
    pub fn bytes(&self) -> &[u8; SECRET_LEN] {
        &self.0
    }

    /// Whether `presented` is this secret (in time independent of where
    /// they differ).
    fn matches(&self, presented: &[u8]) -> bool {
        presented.len() == SECRET_LEN
            && self
                .0
                .iter()
                .zip(presented)
                .fold(0u8, |acc, (a, b)| acc | (a ^ b))
                == 0
    }
}

impl std::fmt::Debug for LaunchSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LaunchSecret(..)")
    }
}

/// Where rank 0's store listens for `MASTER_ADDR` = `host` (resolved to
/// `addrs`): on loopback only when `host` itself says local-only
/// (`localhost` or a loopback address literal); otherwise on every
/// interface of the address family, since peers on other nodes connect to
/// whatever `host` resolves to *there*. (Ubuntu resolves a host's own name
/// to 127.0.1.1 on that host: binding what it resolves to locally would
/// shut the other nodes out.)
pub fn bind_address(host: &str, addrs: &[SocketAddr]) -> SocketAddr {
    let port = addrs.first().map_or(0, |a| a.port());
    let literal: Option<IpAddr> = host.trim_matches(['[', ']']).parse().ok();
    let local_only =
        host.eq_ignore_ascii_case("localhost") || literal.is_some_and(|ip| ip.is_loopback());
    if local_only {
        if let Some(a) = addrs.iter().find(|a| a.ip().is_loopback()) {
            return *a;
        }
    }
    match addrs.first().map(|a| a.ip()) {
        Some(IpAddr::V6(_)) => SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), port),
        _ => SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), port),
    }
}

#[cfg(test)]
mod bind_tests {
    use super::*;

    fn a(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    #[test]
    fn only_an_explicitly_local_host_binds_loopback() {
        assert_eq!(
            bind_address("127.0.0.1", &[a("127.0.0.1:29500")]),
            a("127.0.0.1:29500")
        );
        assert_eq!(
            bind_address("localhost", &[a("127.0.0.1:7")]),
            a("127.0.0.1:7")
        );
        assert_eq!(bind_address("::1", &[a("[::1]:7")]), a("[::1]:7"));
        // A host name resolving to Ubuntu's 127.0.1.1 is another node's
        // MASTER_ADDR too: every interface.
        assert_eq!(
            bind_address("node0", &[a("127.0.1.1:29500")]),
            a("0.0.0.0:29500")
        );
        assert_eq!(bind_address("10.0.0.5", &[a("10.0.0.5:9")]), a("0.0.0.0:9"));
        assert_eq!(bind_address("node0", &[a("[fe80::1]:9")]), a("[::]:9"));
    }

    #[test]
    fn secrets_differ_by_job_and_compare_exactly() {
        let (s1, s2) = (LaunchSecret::of_job("job-1"), LaunchSecret::of_job("job-2"));
        assert_ne!(s1, s2);
        assert!(s1.matches(s1.bytes()));
        assert!(!s1.matches(s2.bytes()));
        assert!(!s1.matches(&s1.bytes()[..31]));
        assert_eq!(s1, LaunchSecret::of_job("job-1"));
    }
}
