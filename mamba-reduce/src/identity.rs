//! The first-reduction agreement check: every rank shows every other rank
//! what it is about to reduce, and every rank compares.
//!
//! The exchange has the same shape whatever the identities hold (a fixed
//! number of values per rank, all-gathered by point-to-point messages), so
//! ranks that disagree still complete it, and every rank then reaches the
//! same verdict from the same table: a mismatch is the same clear error on
//! every rank, never a hang and never an error on one rank while the others
//! wait.

use mamba_comm::Transport;

use crate::contract::ReduceContract;
use crate::{ReduceError, Result};

/// What a rank is about to reduce. Every rank of a run must present the
/// same identity before its first reduction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RunIdentity {
    /// Elements in each gradient arena.
    pub arena_len: u64,
    /// The reduction contract.
    pub contract: ReduceContract,
    /// `L`, the number of logical ranks.
    pub logical_world: u64,
    /// A fingerprint of the model and training configuration (for instance
    /// [`RunIdentity::fingerprint_of`] of the config's canonical JSON);
    /// 0 when the caller has none.
    pub fingerprint: u64,
    /// The reducer's own choices that decide message sizes: the chunk
    /// length in elements (0: the default chosen from the arena length,
    /// the same on every rank). A reducer fills it in before the exchange
    /// ([`crate::TransportReducer`] does), so ranks built with different
    /// chunkings fail the check instead of pairing messages of different
    /// sizes (a hang until the watchdog on NCCL).
    pub chunk_elems: u64,
}

impl RunIdentity {
    /// An identity from its parts.
    pub fn new(
        arena_len: usize,
        contract: ReduceContract,
        logical_world: usize,
        fingerprint: u64,
    ) -> Self {
        RunIdentity {
            arena_len: arena_len as u64,
            contract,
            logical_world: logical_world as u64,
            fingerprint,
            chunk_elems: 0,
        }
    }

    /// The [`RunIdentity::chunk_elems`] of the peer fold
    /// ([`crate::PeerReducer`]), which sends no messages: a rank on the peer
    /// fold and a rank on the message dataflow then fail the check by name.
    pub const PEER_FOLD: u64 = u64::MAX;

    /// This identity with the reducer's chunk length (`None`: the default).
    pub fn with_chunk(self, chunk_elems: Option<usize>) -> Self {
        RunIdentity {
            chunk_elems: chunk_elems.map_or(0, |c| c as u64),
            ..self
        }
    }

    /// FNV-1a (64-bit) of `bytes`: a stable, dependency-free fingerprint
    /// for configuration text. Not cryptographic; it detects mistakes, not
    /// adversaries.
    pub fn fingerprint_of(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    }
}

/// "MAMBRED2": marks an identity record of this layout.
const MAGIC: u64 = 0x4d41_4d42_5245_4432;
/// u64 words per rank: magic, rank, world, arena_len, contract, logical
/// world, fingerprint, chunk length, local status.
const WORDS: usize = 9;
/// f32 values per rank on the wire: each word as four 16-bit halves, so
/// every value is a small integer that any transport carries exactly.
pub(crate) const VALUES: usize = WORDS * 4;

/// A record as exchanged.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Record {
    pub(crate) rank: u64,
    pub(crate) world: u64,
    pub(crate) id: RunIdentity,
    /// The rank saw a problem of its own before the exchange (its own error
    /// says which); every rank then fails.
    pub(crate) local_problem: bool,
}

pub(crate) fn encode(rec: &Record) -> Vec<f32> {
    let words = [
        MAGIC,
        rec.rank,
        rec.world,
        rec.id.arena_len,
        rec.id.contract.code(),
        rec.id.logical_world,
        rec.id.fingerprint,
        rec.id.chunk_elems,
        u64::from(rec.local_problem),
    ];
    words
        .iter()
        .flat_map(|w| (0..4).map(move |k| ((w >> (16 * k)) & 0xffff) as f32))
        .collect()
}

/// Decode one rank's values; `Err` names what is malformed.
pub(crate) fn decode(values: &[f32]) -> std::result::Result<(Record, u64), String> {
    if values.len() != VALUES {
        return Err(format!("{} values, expected {VALUES}", values.len()));
    }
    let mut words = [0u64; WORDS];
    for (w, quad) in words.iter_mut().zip(values.chunks_exact(4)) {
        for (k, v) in quad.iter().enumerate() {
            if !(0.0..=65535.0).contains(v) || v.fract() != 0.0 {
                return Err(format!("value {v} is not a 16-bit half-word"));
            }
            *w |= (*v as u64) << (16 * k);
        }
    }
    if words[0] != MAGIC {
        return Err(format!(
            "magic {:#x}, expected {MAGIC:#x} (another mamba-reduce version?)",
            words[0]
        ));
    }
    let contract = ReduceContract::from_code(words[4]);
    let rec = Record {
        rank: words[1],
        world: words[2],
        id: RunIdentity {
            arena_len: words[3],
            contract: contract.unwrap_or_default(),
            logical_world: words[5],
            fingerprint: words[6],
            chunk_elems: words[7],
        },
        local_problem: words[8] != 0,
    };
    Ok((rec, words[4]))
}

/// Renders one field of an identity for comparison and messages.
type Show = fn(&RunIdentity) -> String;

/// Compare every rank's record (`gathered` holds `world` records in rank
/// order) and return the verdict every rank reaches identically.
pub(crate) fn verdict(gathered: &[f32], world: usize) -> Result<RunIdentity> {
    let mut records = Vec::with_capacity(world);
    let mut problems = Vec::new();
    for (k, chunk) in gathered.chunks(VALUES).enumerate().take(world) {
        match decode(chunk) {
            Ok((rec, code)) => {
                if ReduceContract::from_code(code).is_none() {
                    problems.push(format!("rank {k} presents an unknown contract code {code}"));
                }
                if rec.rank != k as u64 || rec.world != world as u64 {
                    problems.push(format!(
                        "the record in slot {k} claims rank {} of {} (expected rank {k} of {world})",
                        rec.rank, rec.world
                    ));
                }
                if rec.local_problem {
                    problems.push(format!(
                        "rank {k} found a local problem before the check (its own log has the details)"
                    ));
                }
                records.push(rec);
            }
            Err(e) => problems.push(format!("rank {k} sent a malformed identity: {e}")),
        }
    }
    if records.len() != world {
        problems.push(format!(
            "{} identities decoded, expected {world}",
            records.len()
        ));
    }
    if let Some(first) = records.first() {
        let fields: [(&str, Show); 5] = [
            ("arena length", |i| i.arena_len.to_string()),
            ("contract", |i| i.contract.to_string()),
            ("logical world", |i| i.logical_world.to_string()),
            ("model/config fingerprint", |i| {
                format!("{:#018x}", i.fingerprint)
            }),
            ("reducer chunk length", |i| match i.chunk_elems {
                0 => "default".to_string(),
                RunIdentity::PEER_FOLD => "none (the peer fold)".to_string(),
                c => format!("{c} elements"),
            }),
        ];
        for (name, show) in fields {
            let differing: Vec<String> = records
                .iter()
                .enumerate()
                .filter(|(_, r)| show(&r.id) != show(&first.id))
                .map(|(k, r)| format!("rank {k} {}", show(&r.id)))
                .collect();
            if !differing.is_empty() {
                problems.push(format!(
                    "{name}: rank 0 {}, {}",
                    show(&first.id),
                    differing.join(", ")
                ));
            }
        }
    }
    if !problems.is_empty() {
        return Err(ReduceError::Disagreement {
            detail: format!(
                "{}; expected every rank to present the same arena length, contract, logical \
                 world, model/config fingerprint and reducer chunk length (same build, same \
                 config, same launch)",
                problems.join("; ")
            ),
        });
    }
    let id = records[0].id;
    crate::plan::check_world(world, id.logical_world as usize)?;
    id.contract.check_logical_world(id.logical_world as usize)?;
    Ok(id)
}

/// The agreement check over any transport, as every [`Reducer`] must run
/// it before its first reduction: every rank sends every other rank its
/// identity (a fixed number of values whatever the identity holds, so ranks
/// that disagree still complete the exchange) and every rank compares the
/// same table. Returns the identity every rank agreed on, or the same
/// [`ReduceError::Disagreement`] on every rank naming the ranks and values.
///
/// `local_problem` is a mistake this rank found on its own (e.g. its
/// reducer was built for another contract than `id` names): this rank
/// fails with that message and every other rank fails naming this rank, so
/// no rank fails alone while the others wait. `L % P != 0`, and under
/// [`ReduceContract::FixedTree`] an `L` that is not a power of two, fail
/// on every rank. `cache` keeps a transport buffer between calls (the one
/// [`all_gather`] uses).
///
/// [`Reducer`]: crate::Reducer
pub fn agree<T: Transport>(
    transport: &mut T,
    cache: &mut Option<T::Buffer>,
    id: &RunIdentity,
    local_problem: Option<String>,
) -> Result<RunIdentity> {
    let rec = Record {
        rank: transport.rank() as u64,
        world: transport.world() as u64,
        id: *id,
        local_problem: local_problem.is_some(),
    };
    let values = encode(&rec);
    debug_assert_eq!(values.len(), VALUES);
    let gathered = all_gather(transport, cache, &values)?;
    // A local problem outranks the shared verdict on the rank that has it:
    // its own error names what is wrong; the others name this rank.
    if let Some(p) = local_problem {
        return Err(ReduceError::config(p));
    }
    verdict(&gathered, transport.world())
}

/// All-gather `values` (the same length on every rank) over `t`: returns
/// `world * values.len()` values, rank `k`'s at `k * values.len()`. Values
/// travel as bits. `cache` keeps a transport buffer between calls.
/// Collective: every rank calls it with the same length.
pub fn all_gather<T: Transport>(
    t: &mut T,
    cache: &mut Option<T::Buffer>,
    values: &[f32],
) -> Result<Vec<f32>> {
    let (n, world, rank) = (values.len(), t.world(), t.rank());
    let total = n * world;
    if world == 1 || n == 0 {
        return Ok(values.to_vec());
    }
    let buf = match cache.take() {
        Some(b) if T::buffer_len(&b) >= total => b,
        _ => t.alloc(total)?,
    };
    let buf = cache.insert(buf);
    t.upload(values, buf, rank * n)?;
    t.group(&mut [&mut *buf], |g| {
        for peer in (0..world).filter(|&p| p != rank) {
            g.send(0, rank * n..(rank + 1) * n, peer)?;
        }
        for peer in (0..world).filter(|&p| p != rank) {
            g.recv(0, peer * n..(peer + 1) * n, peer)?;
        }
        Ok(())
    })?;
    let mut out = vec![0.0; total];
    t.download(buf, 0, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(rank: u64, world: u64, id: RunIdentity) -> Record {
        Record {
            rank,
            world,
            id,
            local_problem: false,
        }
    }

    #[test]
    fn encoding_round_trips_extreme_words() {
        let id = RunIdentity {
            arena_len: u64::MAX,
            contract: ReduceContract::NcclSum,
            logical_world: 1 << 40,
            fingerprint: 0x8000_0000_0000_0001,
            chunk_elems: u64::MAX - 1,
        };
        let r = rec(3, 7, id);
        let v = encode(&r);
        assert_eq!(v.len(), VALUES);
        assert_eq!(decode(&v).unwrap().0, r);
    }

    #[test]
    fn every_differing_field_is_named_with_both_values() {
        let base = RunIdentity::new(1024, ReduceContract::FixedOrder, 4, 7);
        let other = RunIdentity {
            arena_len: 1000,
            fingerprint: 9,
            ..base
        };
        let mut all = encode(&rec(0, 3, base));
        all.extend(encode(&rec(1, 3, base)));
        all.extend(encode(&rec(2, 3, other)));
        let err = verdict(&all, 3).unwrap_err().to_string();
        assert!(
            err.contains("arena length: rank 0 1024, rank 2 1000"),
            "{err}"
        );
        assert!(err.contains("rank 2 0x0000000000000009"), "{err}");
        assert!(!err.contains("contract:"), "{err}");
        // Agreement passes, and L % P is checked on the agreed identity.
        let mut same = encode(&rec(0, 2, base));
        same.extend(encode(&rec(1, 2, base)));
        assert_eq!(verdict(&same, 2).unwrap(), base);
        let odd = RunIdentity::new(8, ReduceContract::FixedOrder, 3, 0);
        let mut bad = encode(&rec(0, 2, odd));
        bad.extend(encode(&rec(1, 2, odd)));
        assert!(verdict(&bad, 2)
            .unwrap_err()
            .to_string()
            .contains("not a multiple"));
    }

    #[test]
    fn malformed_and_local_problems_fail() {
        let id = RunIdentity::new(8, ReduceContract::FixedOrder, 2, 0);
        let mut all = encode(&rec(0, 2, id));
        let mut r1 = rec(1, 2, id);
        r1.local_problem = true;
        all.extend(encode(&r1));
        assert!(verdict(&all, 2)
            .unwrap_err()
            .to_string()
            .contains("rank 1 found a local problem"));
        all[VALUES] = 0.5;
        assert!(verdict(&all, 2)
            .unwrap_err()
            .to_string()
            .contains("malformed"));
    }

    #[test]
    fn a_different_chunk_length_is_named() {
        let base = RunIdentity::new(1024, ReduceContract::FixedOrder, 2, 7);
        let mut all = encode(&rec(0, 2, base));
        all.extend(encode(&rec(1, 2, base.with_chunk(Some(4096)))));
        let err = verdict(&all, 2).unwrap_err().to_string();
        assert!(
            err.contains("reducer chunk length: rank 0 default, rank 1 4096 elements"),
            "{err}"
        );
    }

    #[test]
    fn the_peer_fold_against_the_message_dataflow_is_named() {
        let base = RunIdentity::new(1024, ReduceContract::FixedOrder, 2, 7);
        let peer = RunIdentity {
            chunk_elems: RunIdentity::PEER_FOLD,
            ..base
        };
        let mut all = encode(&rec(0, 2, peer));
        all.extend(encode(&rec(1, 2, base)));
        let err = verdict(&all, 2).unwrap_err().to_string();
        assert!(
            err.contains("reducer chunk length: rank 0 none (the peer fold), rank 1 default"),
            "{err}"
        );
        // Two ranks on the peer fold agree.
        let mut same = encode(&rec(0, 2, peer));
        same.extend(encode(&rec(1, 2, peer)));
        assert!(verdict(&same, 2).is_ok());
    }

    #[test]
    fn fingerprint_is_fnv1a() {
        assert_eq!(RunIdentity::fingerprint_of(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(RunIdentity::fingerprint_of(b"a"), 0xaf63_dc4c_8601_ec8c);
    }
}
