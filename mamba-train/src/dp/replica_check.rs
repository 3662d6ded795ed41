//! The replica check: every rank shows every other rank the SHA-256 of its
//! weights and its step, through the reducer's host all-gather, and every
//! rank compares the same table.
//!
//! The exchange has the same shape on every rank whatever the digests are,
//! so ranks that disagree still complete it and all reach the same verdict:
//! a divergence is the same [`CommError::ReplicaDivergence`] on every rank,
//! never one rank failing while the others wait.
//!
//! Wire format: each 16-bit half-word of the step (4 halves) and of the
//! 32-byte digest (16 halves) travels as an f32 holding a small integer,
//! which every transport carries exactly (no NaN payloads, no rounding).

use mamba_comm::CommError;

use crate::error::{Result, TrainError};

/// f32 values per rank: 4 for the step, 16 for the digest.
pub const VALUES: usize = 4 + 16;

/// What one rank holds at a check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaState {
    /// Steps completed.
    pub step: u64,
    /// Hex SHA-256 of the weight arena (64 lowercase hex digits).
    pub digest: String,
}

/// The wire values of `state`.
pub fn encode(state: &ReplicaState) -> Result<Vec<f32>> {
    let bytes = hex::decode(&state.digest)
        .ok()
        .filter(|b| b.len() == 32)
        .ok_or_else(|| {
            TrainError::Config(format!(
                "weights digest {:?} is not 64 hex digits (a SHA-256)",
                state.digest
            ))
        })?;
    let mut out: Vec<f32> = (0..4)
        .map(|k| ((state.step >> (16 * k)) & 0xffff) as f32)
        .collect();
    out.extend(
        bytes
            .chunks_exact(2)
            .map(|p| u16::from_le_bytes([p[0], p[1]]) as f32),
    );
    Ok(out)
}

/// Decode one rank's values; `None` when they are not half-words.
pub fn decode(values: &[f32]) -> Option<ReplicaState> {
    if values.len() != VALUES {
        return None;
    }
    let half = |v: f32| -> Option<u16> {
        ((0.0..=65535.0).contains(&v) && v.fract() == 0.0).then_some(v as u16)
    };
    let mut step = 0u64;
    for (k, &v) in values[..4].iter().enumerate() {
        step |= u64::from(half(v)?) << (16 * k);
    }
    let mut bytes = Vec::with_capacity(32);
    for &v in &values[4..] {
        bytes.extend_from_slice(&half(v)?.to_le_bytes());
    }
    Some(ReplicaState {
        step,
        digest: hex::encode(bytes),
    })
}

/// Compare every rank's state (`gathered` holds [`VALUES`] per rank, in
/// rank order) and return the agreed state, or the divergence naming every
/// rank that differs from rank 0. `when` says where in the run the check
/// ran, for the message.
pub fn verdict(gathered: &[f32], world: usize, when: &str) -> Result<ReplicaState> {
    if gathered.len() != world * VALUES {
        return Err(CommError::ReplicaDivergence {
            detail: format!(
                "{when}: the replica check gathered {} values from {world} ranks, expected {}",
                gathered.len(),
                world * VALUES
            ),
        }
        .into());
    }
    let states: Vec<Option<ReplicaState>> = gathered.chunks(VALUES).map(decode).collect();
    if let Some(Some(first)) = states.first() {
        if states.iter().all(|s| s.as_ref() == Some(first)) {
            return Ok(first.clone());
        }
    }
    // Group the ranks by what they hold, largest group first (ties: the
    // group of the lower rank), so the message reads "which ranks left the
    // majority" whichever rank diverged.
    let mut groups: Vec<(Option<ReplicaState>, Vec<usize>)> = Vec::new();
    for (r, s) in states.into_iter().enumerate() {
        match groups.iter_mut().find(|(g, _)| *g == s) {
            Some((_, ranks)) => ranks.push(r),
            None => groups.push((s, vec![r])),
        }
    }
    groups.sort_by(|a, b| b.1.len().cmp(&a.1.len()).then(a.1[0].cmp(&b.1[0])));
    let show = |(s, ranks): &(Option<ReplicaState>, Vec<usize>)| {
        let who = ranks
            .iter()
            .map(|r| r.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        let what = match s {
            Some(s) => format!("step {} weights {}", s.step, s.digest),
            None => "an unreadable record".to_string(),
        };
        format!(
            "{} {who}: {what}",
            if ranks.len() == 1 { "rank" } else { "ranks" }
        )
    };
    let odd: Vec<String> = groups[1..]
        .iter()
        .flat_map(|(_, ranks)| ranks.iter().map(|r| r.to_string()))
        .collect();
    Err(CommError::ReplicaDivergence {
        detail: format!(
            "{when}: the ranks hold different weights ({}); rank{} {} differ{} from the largest \
             group. Every rank must hold identical weights after every step (same build, same \
             inputs, same reduced gradient); the run cannot continue: resume from the last \
             checkpoint, whose weights were checked",
            groups.iter().map(show).collect::<Vec<_>>().join("; "),
            if odd.len() == 1 { "" } else { "s" },
            odd.join(", "),
            if odd.len() == 1 { "s" } else { "" },
        ),
    }
    .into())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(step: u64, fill: u8) -> ReplicaState {
        ReplicaState {
            step,
            digest: hex::encode([fill; 32]),
        }
    }

    #[test]
    fn states_round_trip_through_the_wire_values() {
        for s in [state(0, 0), state(u64::MAX, 0xff), state(1 << 40, 0x5a)] {
            let v = encode(&s).unwrap();
            assert_eq!(v.len(), VALUES);
            assert!(v.iter().all(|x| x.is_finite() && x.fract() == 0.0));
            assert_eq!(decode(&v), Some(s));
        }
        assert!(encode(&ReplicaState {
            step: 1,
            digest: "abc".into()
        })
        .is_err());
        assert_eq!(decode(&[0.5; VALUES]), None);
    }

    fn b2() -> Vec<f32> {
        encode(&state(7, 2)).unwrap()
    }

    #[test]
    fn agreement_passes_and_every_differing_rank_is_named() {
        let a = encode(&state(7, 1)).unwrap();
        let b = encode(&state(7, 2)).unwrap();
        let c = encode(&state(8, 1)).unwrap();
        let same: Vec<f32> = [a.clone(), a.clone(), a.clone()].concat();
        assert_eq!(verdict(&same, 3, "after step 7").unwrap(), state(7, 1));
        let all: Vec<f32> = [a.clone(), b, a.clone(), c].concat();
        let e = verdict(&all, 4, "after step 7").unwrap_err();
        let text = e.to_string();
        assert!(matches!(
            e,
            TrainError::Comm(CommError::ReplicaDivergence { .. })
        ));
        assert!(text.contains("replica divergence: after step 7"), "{text}");
        assert!(text.contains(&format!(
            "ranks 0, 2: step 7 weights {}",
            hex::encode([1u8; 32])
        )));
        assert!(text.contains(&format!(
            "rank 1: step 7 weights {}",
            hex::encode([2u8; 32])
        )));
        assert!(text.contains("rank 3: step 8"), "{text}");
        assert!(
            text.contains("ranks 1, 3 differ from the largest group"),
            "{text}"
        );
        // Rank 0 alone off: named as the odd one.
        let e = verdict(&[b2(), a.clone(), a.clone()].concat(), 3, "at the end")
            .unwrap_err()
            .to_string();
        assert!(e.contains("rank 0 differs from the largest group"), "{e}");
        assert!(verdict(&a, 2, "x").is_err(), "short table");
        let mut garbled = same.clone();
        garbled[VALUES] = 0.5;
        let e = verdict(&garbled, 3, "x").unwrap_err().to_string();
        assert!(e.contains("rank 1: an unreadable record"), "{e}");
    }
}
