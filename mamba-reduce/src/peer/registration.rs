//! The collective exchange that maps every rank's arenas and flags into
//! every other rank ([`register`]), over the control reducer's host
//! all-gather.
//!
//! Every step is collective and fails collectively: a rank that cannot do
//! its part (its arenas are not shareable, its socket name is taken, a
//! peer's pool will not import) still takes part in the next all-gather
//! with a failure status, so every rank returns an error in the same round
//! (the failing rank its own reason, the others one naming it) and no rank
//! is left waiting.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaContext;
use mamba_comm::ipc::{
    fetch_fd, one_node, ExportedPointer, FdListener, ImportedPointer, ImportedPool, NodeIdentity,
    SharedPool,
};

use crate::reducer::Reducer;
use crate::{ReduceError, Result};

/// Every rank's arenas and flag arrays as addresses of this process, and
/// what keeps the peers' mapped.
///
/// Invariant: `arenas[p][k]` addresses at least `len` f32 and `flags[p]` at
/// least `world` u64 of live device memory of this context for as long as
/// the registration lives (own memory: the caller's arenas, which it must
/// not free while registered; peers': the imports held here).
pub(crate) struct Registration {
    /// This rank's own arenas as registered (address, elements), to notice
    /// a caller that passes others later.
    pub(crate) own: Vec<(CUdeviceptr, usize)>,
    pub(crate) arenas: Vec<Vec<CUdeviceptr>>,
    pub(crate) flags: Vec<CUdeviceptr>,
    /// `flags` of the peers, for posting an abort (`None` at this rank).
    pub(crate) peer_flags: Vec<Option<ImportedPointer>>,
    _imports: Vec<ImportedPointer>,
    _pools: Vec<Arc<ImportedPool>>,
}

impl Registration {
    /// A world of one: nothing to map.
    pub(crate) fn local(own: &[(CUdeviceptr, usize)], flags: CUdeviceptr) -> Self {
        Registration {
            own: own.to_vec(),
            arenas: vec![own.iter().map(|a| a.0).collect()],
            flags: vec![flags],
            peer_flags: vec![None],
            _imports: Vec::new(),
            _pools: Vec::new(),
        }
    }
}

/// What this rank brings to the exchange.
pub(crate) struct Own<'a> {
    pub(crate) ctx: &'a Arc<CudaContext>,
    pub(crate) pool: &'a SharedPool,
    pub(crate) rank: usize,
    pub(crate) world: usize,
    pub(crate) len: usize,
    pub(crate) arenas: &'a [(CUdeviceptr, usize)],
    pub(crate) flags: CUdeviceptr,
    pub(crate) timeout: Duration,
}

/// Bytes as f32 values `0..=255` (any transport carries them exactly).
fn to_values(bytes: &[u8]) -> Vec<f32> {
    bytes.iter().map(|&b| f32::from(b)).collect()
}

fn to_bytes(values: &[f32]) -> Result<Vec<u8>> {
    values
        .iter()
        .map(|&v| {
            if (0.0..=255.0).contains(&v) && v.fract() == 0.0 {
                Ok(v as u8)
            } else {
                Err(ReduceError::invariant(format!(
                    "the peer registration exchange carried {v}, not a byte"
                )))
            }
        })
        .collect()
}

/// All-gather `record` (the same length on every rank) as bytes.
fn gather<R: Reducer>(control: &mut R, record: &[u8]) -> Result<Vec<Vec<u8>>> {
    let all = control.all_gather_host(&to_values(record))?;
    let bytes = to_bytes(&all)?;
    if bytes.len() != record.len() * control.world() {
        return Err(ReduceError::invariant(format!(
            "the peer registration exchange returned {} bytes for {} ranks of {}",
            bytes.len(),
            control.world(),
            record.len()
        )));
    }
    Ok(bytes
        .chunks(record.len().max(1))
        .map(<[u8]>::to_vec)
        .collect())
}

/// One round of "did every rank succeed": this rank's outcome in, and
/// every rank's error out if any failed (this rank's own reason first).
fn settle<R: Reducer, T>(control: &mut R, what: &str, outcome: Result<T>) -> Result<T> {
    let failed = u8::from(outcome.is_err());
    let all = gather(control, &[failed])?;
    let bad: Vec<usize> = (0..all.len()).filter(|&r| all[r][0] != 0).collect();
    match outcome {
        Err(e) => Err(e),
        Ok(_) if !bad.is_empty() => Err(ReduceError::config(format!(
            "peer registration failed on rank(s) {bad:?} while {what} (their logs say why); \
             every rank stops"
        ))),
        Ok(v) => Ok(v),
    }
}

fn nonce() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut h = RandomState::new().build_hasher();
    h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    h.write_u32(std::process::id());
    h.finish()
}

/// Where the node identity sits in a record.
const NODE_AT: usize = 1 + 4 + 8 + 8;
/// Fixed header bytes: status, pid, nonce, arena length, node identity.
const HEADER: usize = NODE_AT + NodeIdentity::BYTES;

/// Round 1's node check: every rank must run on this rank's node, in its
/// network and pid namespaces (abstract sockets and the pid check of the
/// descriptor exchange see nothing else). Every rank reads the same
/// records, so every rank fails here alike, before any socket is opened.
fn check_one_node(records: &[Vec<u8>]) -> Result<()> {
    let ids: Vec<NodeIdentity> = records
        .iter()
        .map(|r| {
            r.get(NODE_AT..HEADER)
                .and_then(NodeIdentity::from_bytes)
                .ok_or_else(|| ReduceError::invariant("a registration record without its node"))
        })
        .collect::<Result<_>>()?;
    one_node(&ids).map_err(|groups| {
        ReduceError::config(format!(
            "the peer fold maps device memory between the processes of one node, but this \
             world spans several (or several network / pid namespaces): {groups}; reduce \
             through the communicator (the NCCL dataflow) instead"
        ))
    })
}

/// Map every rank's arenas and flags into this one (collective).
pub(crate) fn register<R: Reducer>(control: &mut R, own: &Own<'_>) -> Result<Registration> {
    let blocks = own.arenas.len();
    let pointers = 1 + blocks;
    let record_len = HEADER + pointers * ExportedPointer::BYTES;

    // Round 1: pids, rank 0's nonce, every export. The pool's descriptor
    // first: the driver exports pointers only of a pool already shared.
    let fd = own.pool.export_fd();
    let node = NodeIdentity::of_this_process();
    let exported: Result<Vec<ExportedPointer>> = match &fd {
        Err(e) => Err(ReduceError::config(format!(
            "exporting the shared pool: {e}"
        ))),
        Ok(_) => std::iter::once((own.flags, own.world as u64 * 8))
            .chain(own.arenas.iter().map(|a| (a.0, a.1 as u64 * 4)))
            .map(|(p, bytes)| Ok(own.pool.export_pointer(own.ctx, p, bytes)?))
            .collect(),
    };
    let mut record = vec![0u8; record_len];
    record[1..5].copy_from_slice(&std::process::id().to_le_bytes());
    record[5..13].copy_from_slice(&nonce().to_le_bytes());
    record[13..21].copy_from_slice(&(own.len as u64).to_le_bytes());
    let exported = node
        .map_err(ReduceError::from)
        .and_then(|id| exported.map(|list| (id, list)));
    match &exported {
        Ok((id, list)) => {
            record[NODE_AT..HEADER].copy_from_slice(&id.to_bytes());
            for (k, e) in list.iter().enumerate() {
                let at = HEADER + k * ExportedPointer::BYTES;
                record[at..at + ExportedPointer::BYTES].copy_from_slice(&e.to_bytes());
            }
        }
        Err(_) => record[0] = 1,
    }
    let records = gather(control, &record)?;
    settle_records(&records, exported)?;
    check_one_node(&records)?;
    let fd = fd.map_err(ReduceError::from)?;
    let u32_at = |r: &[u8], at: usize| u32::from_le_bytes([r[at], r[at + 1], r[at + 2], r[at + 3]]);
    let u64_at = |r: &[u8], at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&r[at..at + 8]);
        u64::from_le_bytes(w)
    };
    let pids: Vec<u32> = records.iter().map(|r| u32_at(r, 1)).collect();
    if let Some(q) = (0..own.world).find(|&q| u64_at(&records[q], 13) != own.len as u64) {
        return Err(ReduceError::invariant(format!(
            "rank {q} registered arenas of {} elements, rank {} of {} after the agreement check",
            u64_at(&records[q], 13),
            own.rank,
            own.len
        )));
    }
    let tag = format!("mamba-peer-{}-{:016x}", pids[0], u64_at(&records[0], 5));

    // Round 2: every rank listens before anyone connects.
    let listener = FdListener::bind(&format!("{tag}-{}", own.rank)).map_err(ReduceError::from);
    let listener = settle(control, "opening its socket", listener)?;

    // Round 3: pool descriptors cross (serve and fetch at once), then every
    // rank imports every peer's pool and pointers.
    let deadline = Instant::now() + own.timeout;
    let imported = exchange_pools(own, &fd, &listener, &tag, &pids, deadline)
        .map_err(|e| {
            ReduceError::config(format!(
                "rank {} could not exchange memory pools with its peers ({e}); the peer fold \
                 needs every rank on one node, in one network namespace",
                own.rank
            ))
        })
        .and_then(|fds| import_all(own, &records, fds));
    drop(listener);
    settle(control, "exchanging and importing pools", imported)
}

/// Round 1's verdict: this rank's own export error, or one naming the
/// ranks whose exports failed.
fn settle_records<T>(records: &[Vec<u8>], own: Result<T>) -> Result<()> {
    let bad: Vec<usize> = (0..records.len()).filter(|&r| records[r][0] != 0).collect();
    match own {
        Err(e) => Err(e),
        Ok(_) if !bad.is_empty() => Err(ReduceError::config(format!(
            "rank(s) {bad:?} could not share their arenas with the peer fold (their logs say \
             why); every rank stops"
        ))),
        Ok(_) => Ok(()),
    }
}

fn exchange_pools(
    own: &Own<'_>,
    fd: &std::os::fd::OwnedFd,
    listener: &FdListener,
    tag: &str,
    pids: &[u32],
    deadline: Instant,
) -> Result<Vec<Option<std::os::fd::OwnedFd>>> {
    let peers: Vec<u32> = (0..own.world)
        .filter(|&q| q != own.rank)
        .map(|q| pids[q])
        .collect();
    std::thread::scope(|s| {
        let server = s.spawn(|| {
            use std::os::fd::AsFd;
            listener.serve(fd.as_fd(), &peers, peers.len(), deadline)
        });
        let fetched: Result<Vec<_>> = (0..own.world)
            .map(|q| {
                if q == own.rank {
                    Ok(None)
                } else {
                    Ok(Some(fetch_fd(&format!("{tag}-{q}"), pids[q], deadline)?))
                }
            })
            .collect();
        let served = server
            .join()
            .map_err(|_| ReduceError::invariant("the descriptor server thread panicked"))?;
        served?;
        fetched
    })
}

fn import_all(
    own: &Own<'_>,
    records: &[Vec<u8>],
    fds: Vec<Option<std::os::fd::OwnedFd>>,
) -> Result<Registration> {
    let blocks = own.arenas.len();
    let mut reg = Registration {
        own: own.arenas.to_vec(),
        arenas: Vec::with_capacity(own.world),
        flags: Vec::with_capacity(own.world),
        peer_flags: Vec::with_capacity(own.world),
        _imports: Vec::new(),
        _pools: Vec::new(),
    };
    for (q, fd) in fds.into_iter().enumerate() {
        let Some(fd) = fd else {
            reg.flags.push(own.flags);
            reg.arenas.push(own.arenas.iter().map(|a| a.0).collect());
            reg.peer_flags.push(None);
            continue;
        };
        let pool = ImportedPool::import(own.ctx, fd)?;
        let export = |k: usize| {
            let at = HEADER + k * ExportedPointer::BYTES;
            ExportedPointer::from_bytes(&records[q][at..at + ExportedPointer::BYTES])
                .ok_or_else(|| ReduceError::invariant("a malformed exported pointer"))
        };
        let flags = pool.import_pointer(&export(0)?)?;
        if flags.len_bytes() < own.world as u64 * 8 {
            return Err(ReduceError::invariant(format!(
                "rank {q}'s flag array holds {} bytes, expected {}",
                flags.len_bytes(),
                own.world * 8
            )));
        }
        reg.flags.push(flags.address());
        let mut arenas = Vec::with_capacity(blocks);
        for k in 0..blocks {
            let a = pool.import_pointer(&export(1 + k)?)?;
            if a.len_bytes() < own.len as u64 * 4 {
                return Err(ReduceError::invariant(format!(
                    "rank {q}'s arena {k} holds {} bytes, expected {} elements",
                    a.len_bytes(),
                    own.len
                )));
            }
            arenas.push(a.address());
            reg._imports.push(a);
        }
        reg.arenas.push(arenas);
        reg.peer_flags.push(Some(flags));
        reg._pools.push(pool);
    }
    Ok(reg)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_cross_as_exact_small_values_and_nothing_else_decodes() {
        let all: Vec<u8> = (0..=255).collect();
        assert_eq!(to_bytes(&to_values(&all)).unwrap(), all);
        for bad in [256.0, -1.0, 0.5, f32::NAN] {
            assert!(to_bytes(&[bad]).is_err(), "{bad} decoded");
        }
    }

    fn record_on(id: &NodeIdentity) -> Vec<u8> {
        let mut r = vec![0u8; HEADER + ExportedPointer::BYTES];
        r[NODE_AT..HEADER].copy_from_slice(&id.to_bytes());
        r
    }

    #[test]
    fn a_world_across_nodes_is_refused_naming_the_ranks_of_each() {
        let here = NodeIdentity::of_this_process().expect("/proc");
        let there = NodeIdentity {
            boot: [0xab; 16],
            ..here
        };
        let one = [record_on(&here), record_on(&here)];
        check_one_node(&one).expect("one node");
        let two = [record_on(&here), record_on(&here), record_on(&there)];
        let text = check_one_node(&two).unwrap_err().to_string();
        assert!(text.contains("ranks [0, 1] on boot"), "{text}");
        assert!(text.contains("ranks [2] on boot abababab"), "{text}");
        assert!(text.contains("NCCL dataflow"), "{text}");
        assert!(check_one_node(&[vec![0u8; 3]]).is_err(), "a short record");
    }

    #[test]
    fn nonces_differ_between_registrations() {
        assert_ne!(nonce(), nonce());
    }
}
