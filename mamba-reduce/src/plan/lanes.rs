//! The two-lane meaning of a plan: which waits between a comm lane and a
//! compute lane keep every result of the sequential meaning.
//!
//! Each lane runs its half of the steps in step order (a CUDA stream each:
//! the communicator's for the groups, a second one for the folds). Two
//! operations of different lanes *conflict* when they touch overlapping
//! elements of the same buffer and at least one of them writes. For every
//! conflicting pair the sequential meaning fixes an order (a step's group
//! before its folds, a step's folds before later groups); the lanes keep it
//! by waiting for the *latest* conflicting step of the other lane, which,
//! lanes being in order, also covers every earlier one. Non-conflicting
//! operations commute, so any schedule of the two lanes that respects these
//! waits computes bit for bit what the sequential one does; the emulated
//! world checks that with random schedules.

use std::ops::Range;

use super::ops::{overlaps, BufId, CommOp, ComputeOp, Step};
use crate::fold::ChainTerm;

/// The waits of one step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct LaneDeps {
    /// Before this step's group: the compute lane must have finished the
    /// fold operations of this (earlier) step.
    pub(crate) comm_after: Option<usize>,
    /// Before this step's fold operations: the comm lane must have finished
    /// the group of this (earlier or same) step.
    pub(crate) compute_after: Option<usize>,
}

/// One buffer region an operation reads or writes.
#[derive(Clone, Debug)]
struct Access {
    buf: BufId,
    range: Range<usize>,
    write: bool,
}

fn comm_accesses(step: &Step) -> Vec<Access> {
    step.comm
        .iter()
        .map(|op| match op {
            CommOp::Send { buf, range, .. } => Access {
                buf: *buf,
                range: range.clone(),
                write: false,
            },
            CommOp::Recv { buf, range, .. } => Access {
                buf: *buf,
                range: range.clone(),
                write: true,
            },
        })
        .collect()
}

fn compute_accesses(step: &Step) -> Vec<Access> {
    let mut out = Vec::new();
    for op in &step.compute {
        match op {
            ComputeOp::Chain {
                dst,
                dst_off,
                terms,
                len,
                ..
            } => {
                out.push(Access {
                    buf: *dst,
                    range: *dst_off..dst_off + len,
                    write: true,
                });
                out.extend(terms.iter().filter_map(|t| match t {
                    ChainTerm::Dst => None,
                    ChainTerm::Buf(b, off) => Some(Access {
                        buf: *b,
                        range: *off..off + len,
                        write: false,
                    }),
                }));
            }
            ComputeOp::Copy {
                src,
                src_off,
                dst,
                dst_off,
                len,
            } => {
                out.push(Access {
                    buf: *src,
                    range: *src_off..src_off + len,
                    write: false,
                });
                out.push(Access {
                    buf: *dst,
                    range: *dst_off..dst_off + len,
                    write: true,
                });
            }
        }
    }
    out
}

fn conflict(a: &[Access], b: &[Access]) -> bool {
    a.iter().any(|x| {
        b.iter()
            .any(|y| x.buf == y.buf && (x.write || y.write) && overlaps(&x.range, &y.range))
    })
}

/// The waits of every step of a plan's `steps` (see the module docs).
pub(crate) fn lane_deps(steps: &[Step]) -> Vec<LaneDeps> {
    let comm: Vec<Vec<Access>> = steps.iter().map(comm_accesses).collect();
    let compute: Vec<Vec<Access>> = steps.iter().map(compute_accesses).collect();
    (0..steps.len())
        .map(|t| LaneDeps {
            comm_after: if comm[t].is_empty() {
                None
            } else {
                (0..t).rev().find(|&s| conflict(&compute[s], &comm[t]))
            },
            compute_after: if compute[t].is_empty() {
                None
            } else {
                (0..=t).rev().find(|&u| conflict(&comm[u], &compute[t]))
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    // The plans whose waits these tests check (test-only: lanes itself
    // knows only steps).
    use crate::plan::RankPlan;

    #[test]
    fn sharded_folds_wait_for_their_scatter_and_gathers_for_their_fold() {
        // Four chunks on two ranks: fold t waits for group t; group t (the
        // scatter of t and the gather of t - 2) waits for fold t - 2 only,
        // so fold t - 1 may run during group t.
        let p = RankPlan::new(1, 2, 2, 4096, Some(1024)).unwrap();
        let deps: Vec<(Option<usize>, Option<usize>)> = p
            .lanes
            .iter()
            .map(|d| (d.comm_after, d.compute_after))
            .collect();
        assert_eq!(
            deps,
            vec![
                (None, Some(0)),
                (None, Some(1)),
                (Some(0), Some(2)),
                (Some(1), Some(3)),
                (Some(2), None),
                (Some(3), None),
            ]
        );
    }

    #[test]
    fn a_one_chunk_plan_is_sequential() {
        let p = RankPlan::new(0, 2, 2, 1000, None).unwrap();
        let deps: Vec<(Option<usize>, Option<usize>)> = p
            .lanes
            .iter()
            .map(|d| (d.comm_after, d.compute_after))
            .collect();
        assert_eq!(deps, vec![(None, Some(0)), (Some(0), None)]);
    }

    #[test]
    fn pipeline_ranks_overlap_the_next_fold_with_the_transfer() {
        // P = 2, L = 4, 4 chunks. Rank 0 folds chunk a at step a (nothing to
        // wait for) and sends it at a + 1 (after that fold only). Rank 1
        // receives chunk a at a + 1, folds it there, relays it at a + 3.
        let p0 = RankPlan::new(0, 2, 4, 4096, Some(1024)).unwrap();
        let p1 = RankPlan::new(1, 2, 4, 4096, Some(1024)).unwrap();
        for a in 0..4 {
            assert_eq!(p0.lanes[a].compute_after, None, "rank 0 fold {a}");
            assert_eq!(p0.lanes[a + 1].comm_after, Some(a), "rank 0 send {a}");
            assert_eq!(
                p1.lanes[a + 1].compute_after,
                Some(a + 1),
                "rank 1 fold {a}"
            );
            assert_eq!(p1.lanes[a + 3].comm_after, Some(a + 1), "rank 1 relay {a}");
        }
    }

    #[test]
    fn conflicts_need_a_write_and_an_overlap() {
        let r = |buf, range: Range<usize>, write| Access { buf, range, write };
        let l0 = BufId::Local(0);
        assert!(!conflict(&[r(l0, 0..4, false)], &[r(l0, 2..6, false)]));
        assert!(conflict(&[r(l0, 0..4, true)], &[r(l0, 3..6, false)]));
        assert!(!conflict(&[r(l0, 0..4, true)], &[r(l0, 4..6, true)]));
        assert!(!conflict(
            &[r(l0, 0..4, true)],
            &[r(BufId::Scratch, 0..4, true)]
        ));
    }
}
