//! The pipeline dataflow (`L > P`): the running prefix travels rank to
//! rank, each adding its block of logical ranks in ascending order, the
//! last rank scales it and the result is relayed to every rank. See the
//! parent module docs.

use super::{BufId, ChainTerm, CommOp, ComputeOp, RankPlan, Step};

impl RankPlan {
    pub(super) fn build_pipeline(&mut self) {
        let (p_world, rank, blocks) = (self.world, self.rank, self.blocks());
        let n_chunks = self.chunks();
        if n_chunks == 0 {
            return;
        }
        let sets = n_chunks.min(2);
        let chunk_cap = self.chunk.min(self.len);
        if rank > 0 {
            self.scratch_len = sets * chunk_cap;
        }
        let n_steps = if p_world == 1 {
            n_chunks
        } else {
            n_chunks + 3 * p_world - 3
        };
        let mut steps = vec![Step::default(); n_steps];
        let last = p_world - 1;
        for a in 0..n_chunks {
            let r = self.chunk_range(a);
            let n = r.len();
            let set = (a % sets) * chunk_cap;
            // The step at which this rank folds chunk a (and, for p >= 1,
            // receives its prefix).
            let fold_at = if rank == 0 { a } else { a + 2 * rank - 1 };
            let mut terms = vec![ChainTerm::Dst];
            if rank > 0 {
                // prefix + g_{rank*B}, computed as g_{rank*B} + prefix.
                steps[fold_at].comm.push(CommOp::Recv {
                    buf: BufId::Scratch,
                    range: set..set + n,
                    peer: rank - 1,
                });
                terms.push(ChainTerm::Buf(BufId::Scratch, set));
            }
            terms.extend((1..blocks).map(|j| ChainTerm::Buf(BufId::Local(j), r.start)));
            steps[fold_at].compute.push(ComputeOp::Chain {
                dst: BufId::Local(0),
                dst_off: r.start,
                terms,
                len: n,
                factor: if rank == last { self.factor() } else { None },
            });
            if p_world == 1 {
                continue;
            }
            // Forward the prefix (rank 0 one step after its fold, which has
            // no incoming data to wait for; the others two steps after, so
            // the fold of the next chunk overlaps the transfer), or relay the
            // finished chunk from the last rank to rank 0.
            // (Under a reduce-scatter the relay carries only what the
            // ranks still ahead of it own: `delivered_to_all`; the prefix
            // travels whole.)
            let send_at = if rank == 0 { a + 1 } else { fold_at + 2 };
            let (to, out) = if rank == last {
                (0, self.delivered_to_all(0..last, r.clone()))
            } else {
                (rank + 1, r.clone())
            };
            if !out.is_empty() {
                steps[send_at].comm.push(CommOp::Send {
                    buf: BufId::Local(0),
                    range: out,
                    peer: to,
                });
            }
            // The relay 0 -> 1 -> ... -> P-2 of the finished chunk, one step
            // per hop, starting when rank 0 receives it from the last rank.
            if rank < last {
                let got_at = a + 2 * p_world - 1 + rank;
                let from = if rank == 0 { last } else { rank - 1 };
                let got = self.delivered_to_all(rank..last, r.clone());
                if !got.is_empty() {
                    steps[got_at].comm.push(CommOp::Recv {
                        buf: BufId::Local(0),
                        range: got,
                        peer: from,
                    });
                }
                let onward = self.delivered_to_all(rank + 1..last, r.clone());
                if rank + 2 < p_world && !onward.is_empty() {
                    steps[got_at + 1].comm.push(CommOp::Send {
                        buf: BufId::Local(0),
                        range: onward,
                        peer: rank + 1,
                    });
                }
            }
        }
        self.steps = steps;
    }
}
