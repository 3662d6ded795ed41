//! A plan's own invariants, checked when it is built.

use std::ops::Range;

use super::{overlaps, BufId, ChainTerm, CommOp, ComputeOp, RankPlan};
use crate::{ReduceError, Result};

impl RankPlan {
    /// Check the plan's own invariants: every range inside its buffer, no
    /// message to self, within a step no received region overlapping
    /// another received or a sent region of the same buffer (so delivery
    /// order cannot matter), and every fold operation in bounds with its
    /// output disjoint from its inputs except as the output's own term, at a
    /// position the kernel's first launch covers.
    pub fn validate(&self) -> Result<()> {
        let bad = |step: usize, what: String| {
            Err(ReduceError::invariant(format!(
                "rank {} step {step}: {what}",
                self.rank
            )))
        };
        let size = |b: BufId| match b {
            BufId::Local(j) if j < self.local_arenas() => Some(self.len),
            BufId::Local(_) => None,
            BufId::Scratch => Some(self.scratch_len),
        };
        let within =
            |b: BufId, r: &Range<usize>| size(b).is_some_and(|n| r.start <= r.end && r.end <= n);
        for (t, step) in self.steps.iter().enumerate() {
            let mut recvs: Vec<(BufId, Range<usize>)> = Vec::new();
            let mut sends: Vec<(BufId, Range<usize>)> = Vec::new();
            for op in &step.comm {
                let (buf, range, peer, list) = match op {
                    CommOp::Send { buf, range, peer } => (*buf, range, *peer, &mut sends),
                    CommOp::Recv { buf, range, peer } => (*buf, range, *peer, &mut recvs),
                };
                if peer == self.rank || peer >= self.world {
                    return bad(t, format!("message with peer {peer}"));
                }
                if !within(buf, range) || range.is_empty() {
                    return bad(t, format!("message range {range:?} invalid in {buf:?}"));
                }
                list.push((buf, range.clone()));
            }
            for (i, (b, r)) in recvs.iter().enumerate() {
                let clash = recvs[i + 1..].iter().chain(sends.iter());
                if clash.clone().any(|(b2, r2)| b2 == b && overlaps(r, r2)) {
                    return bad(
                        t,
                        format!("received region {b:?} {r:?} overlaps another message"),
                    );
                }
            }
            for op in &step.compute {
                let ok = match op {
                    ComputeOp::Chain {
                        dst,
                        dst_off,
                        terms,
                        len,
                        ..
                    } => {
                        let dsts = terms.iter().filter(|t| **t == ChainTerm::Dst).count();
                        let dst_pos = terms.iter().position(|t| *t == ChainTerm::Dst);
                        !terms.is_empty()
                            && dsts <= 1
                            && dst_pos.is_none_or(|k| {
                                terms.len() <= kernels::MAX_CHAIN_ADDENDS
                                    || k < kernels::MAX_CHAIN_ADDENDS
                            })
                            && within(*dst, &(*dst_off..dst_off + len))
                            && terms.iter().all(|t| match t {
                                ChainTerm::Dst => true,
                                ChainTerm::Buf(b, off) => {
                                    b != dst && within(*b, &(*off..off + len))
                                }
                            })
                    }
                    ComputeOp::Copy {
                        src,
                        src_off,
                        dst,
                        dst_off,
                        len,
                    } => {
                        src != dst
                            && within(*src, &(*src_off..src_off + len))
                            && within(*dst, &(*dst_off..dst_off + len))
                    }
                };
                if !ok {
                    return bad(
                        t,
                        format!("fold operation out of bounds or aliased: {op:?}"),
                    );
                }
            }
        }
        Ok(())
    }
}
