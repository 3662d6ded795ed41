//! The [`Transport`] operations of a [`HostTransport`], written on the
//! engine's primitives (post, take, the star all-reduce).

use std::ops::Range;
use std::time::Instant;

use super::engine::HostTransport;
use super::fault::Fault;
use super::message::{Msg, OpCode, Payload, Wire};
use crate::flight::CallKind;
use crate::transport::Group;
use crate::{CommError, Result, Transport};

/// Typed receives and the collectives, on the engine's `post` and `take`.
impl HostTransport {
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
        let msg = self.take(peer, op, code, len, deadline)?;
        match T::values(msg.payload) {
            Ok(v) if v.len() == len => Ok(v),
            Ok(v) => Err(self.size_mismatch(peer, op, T::KIND, len, &T::payload(v))),
            Err(other) => Err(self.size_mismatch(peer, op, T::KIND, len, &other)),
        }
    }

    /// The star all-reduce of both reductions (nothing to do in a world
    /// of one): every follower sends its `values` to rank 0 as `gather`; rank 0
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
        if self.world == 1 {
            return Ok(());
        }
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
        Fault::transport(
            op,
            format!(
                "rank {} expected {len} {kind} values from rank {peer} but received {got}: \
                     the ranks passed different sizes",
                self.rank
            ),
            peer,
        )
    }

    fn take_token(
        &mut self,
        peer: usize,
        op: &str,
        code: OpCode,
        deadline: Instant,
    ) -> Result<(), Fault> {
        let msg = self.take(peer, op, code, 0, deadline)?;
        match msg.payload {
            Payload::Empty => Ok(()),
            other => Err(self.size_mismatch(peer, op, "no", 0, &other)),
        }
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
    fn group<R>(
        &mut self,
        buffers: &mut [&mut Vec<f32>],
        body: impl FnOnce(&mut Group<'_, '_, Self>) -> Result<R>,
    ) -> Result<R> {
        self.ensure_usable("group")?;
        let seq = self.flight.begin(CallKind::Group, 0, None);
        self.group_call = Some(seq);
        let res = body(&mut Group::new(self, buffers));
        self.group_call = None;
        self.flight.finish(seq, res.is_ok());
        res
    }

    fn send(&mut self, buf: &Vec<f32>, range: Range<usize>, peer: usize) -> Result<()> {
        let call = (CallKind::Send, range.len() * 4, Some(peer));
        self.op("send", call, |t| {
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
        let call = (CallKind::Recv, range.len() * 4, Some(peer));
        self.op("recv", call, |t| {
            t.check_peer(peer, "recv from")?;
            t.check_range("recv", &range, buf.len())?;
            let deadline = t.deadline(Instant::now());
            let v = t.take_values::<f32>(peer, "recv", OpCode::P2p, range.len(), deadline)?;
            buf[range].copy_from_slice(&v);
            Ok(())
        })
    }

    fn broadcast(&mut self, buf: &mut Vec<f32>, range: Range<usize>, root: usize) -> Result<()> {
        let call = (CallKind::Broadcast, range.len() * 4, Some(root));
        self.op("broadcast", call, |t| {
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
        let call = (CallKind::AllReduceSum, range.len() * 4, None);
        self.op(OP, call, |t| {
            t.check_range(OP, &range, buf.len())?;
            t.star_all_reduce(
                OP,
                Instant::now(),
                &mut buf[range],
                (OpCode::SumGather, OpCode::SumResult),
                |a, x| *a += x,
            )
        })
    }

    fn all_reduce_max_i32(&mut self, values: &mut [i32]) -> Result<()> {
        const OP: &str = "all_reduce_max_i32";
        let call = (CallKind::AllReduceMax, values.len() * 4, None);
        self.op(OP, call, |t| {
            t.star_all_reduce(
                OP,
                Instant::now(),
                values,
                (OpCode::MaxGather, OpCode::MaxResult),
                |a, x| *a = (*a).max(x),
            )
        })
    }

    fn barrier(&mut self) -> Result<()> {
        const OP: &str = "barrier";
        self.op(OP, (CallKind::Barrier, 0, None), |t| {
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
