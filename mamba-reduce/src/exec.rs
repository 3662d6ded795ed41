//! The live executor: runs one rank's [`RankPlan`] over any
//! [`Transport`] with any [`FoldOps`].
//!
//! Per step: one `Transport::group` with every send issued before every
//! receive (the host transport's sends never block, so this order makes
//! every group complete; NCCL matches the group as a unit anyway), then the
//! step's fold operations. Messages between a pair of ranks are issued in
//! plan order on both sides, which is how NCCL and the host transport match
//! them.

use mamba_comm::{CommError, Transport};

use crate::fold::FoldOps;
use crate::plan::{BufId, CommOp, ComputeOp, RankPlan};
use crate::{ReduceError, Result};

/// Run `plan` on this rank: `locals` are the caller's `L/P` arenas (logical
/// ranks `rank*B .. rank*B + B`, ascending), `scratch` holds at least
/// `plan.scratch_len()` elements. Afterwards `locals[0]` holds the mean on
/// every rank; the other locals are unchanged; scratch holds garbage.
pub(crate) fn execute<T, F>(
    plan: &RankPlan,
    transport: &mut T,
    fold: &mut F,
    locals: &mut [T::Buffer],
    scratch: &mut T::Buffer,
) -> Result<()>
where
    T: Transport,
    F: FoldOps<T::Buffer>,
{
    check_buffers::<T>(plan, locals, scratch)?;
    for step in &plan.steps {
        if !step.comm.is_empty() {
            transport.group(|t| {
                for op in step
                    .comm
                    .iter()
                    .filter(|op| matches!(op, CommOp::Send { .. }))
                {
                    if let CommOp::Send { buf, range, peer } = op {
                        t.send(
                            buf_ref(locals, scratch, *buf).map_err(comm_bug)?,
                            range.clone(),
                            *peer,
                        )?;
                    }
                }
                for op in &step.comm {
                    if let CommOp::Recv { buf, range, peer } = op {
                        t.recv(
                            buf_mut(locals, scratch, *buf).map_err(comm_bug)?,
                            range.clone(),
                            *peer,
                        )?;
                    }
                }
                Ok(())
            })?;
        }
        for op in &step.compute {
            apply(fold, op, locals, scratch)?;
        }
    }
    fold.finish()
}

/// Every local arena has the plan's length, there are `L/P` of them, and
/// the scratch is large enough.
pub(crate) fn check_buffers<T: Transport>(
    plan: &RankPlan,
    locals: &[T::Buffer],
    scratch: &T::Buffer,
) -> Result<()> {
    if locals.len() != plan.blocks() {
        return Err(ReduceError::config(format!(
            "rank {} passed {} local arenas; with logical world {} over {} processes each \
             process passes {} (its contiguous block of logical ranks, ascending)",
            plan.rank(),
            locals.len(),
            plan.logical_world(),
            plan.world(),
            plan.blocks()
        )));
    }
    if let Some((j, b)) = locals
        .iter()
        .enumerate()
        .find(|(_, b)| T::buffer_len(b) != plan.len())
    {
        return Err(ReduceError::config(format!(
            "local arena {j} of rank {} has {} elements, expected {} like local arena 0",
            plan.rank(),
            T::buffer_len(b),
            plan.len()
        )));
    }
    if T::buffer_len(scratch) < plan.scratch_len() {
        return Err(ReduceError::invariant(format!(
            "scratch of {} elements, the plan needs {}",
            T::buffer_len(scratch),
            plan.scratch_len()
        )));
    }
    Ok(())
}

fn comm_bug(e: ReduceError) -> CommError {
    CommError::config(e.to_string())
}

fn buf_ref<'a, B>(locals: &'a [B], scratch: &'a B, id: BufId) -> Result<&'a B> {
    match id {
        BufId::Scratch => Ok(scratch),
        BufId::Local(j) => locals.get(j).ok_or_else(|| {
            ReduceError::invariant(format!("plan names local arena {j} of {}", locals.len()))
        }),
    }
}

fn buf_mut<'a, B>(locals: &'a mut [B], scratch: &'a mut B, id: BufId) -> Result<&'a mut B> {
    let n = locals.len();
    match id {
        BufId::Scratch => Ok(scratch),
        BufId::Local(j) => locals
            .get_mut(j)
            .ok_or_else(|| ReduceError::invariant(format!("plan names local arena {j} of {n}"))),
    }
}

/// A shared reference to `read` and a mutable one to `write`, which must be
/// different buffers (plans never fold a buffer into itself).
fn read_write<'a, B>(
    locals: &'a mut [B],
    scratch: &'a mut B,
    read: BufId,
    write: BufId,
) -> Result<(&'a B, &'a mut B)> {
    let n = locals.len();
    let missing = |j: usize| ReduceError::invariant(format!("plan names local arena {j} of {n}"));
    match (read, write) {
        (BufId::Scratch, BufId::Local(j)) => {
            Ok((&*scratch, locals.get_mut(j).ok_or_else(|| missing(j))?))
        }
        (BufId::Local(i), BufId::Scratch) => {
            Ok((locals.get(i).ok_or_else(|| missing(i))?, scratch))
        }
        (BufId::Local(i), BufId::Local(j)) if i != j => {
            if i.max(j) >= n {
                return Err(missing(i.max(j)));
            }
            if i < j {
                let (lo, hi) = locals.split_at_mut(j);
                Ok((&lo[i], &mut hi[0]))
            } else {
                let (lo, hi) = locals.split_at_mut(i);
                Ok((&hi[0], &mut lo[j]))
            }
        }
        _ => Err(ReduceError::invariant(format!(
            "fold reads and writes the same buffer {read:?}"
        ))),
    }
}

/// Apply one fold operation to this rank's buffers.
pub(crate) fn apply<B, F: FoldOps<B>>(
    fold: &mut F,
    op: &ComputeOp,
    locals: &mut [B],
    scratch: &mut B,
) -> Result<()> {
    match *op {
        ComputeOp::Sum {
            slots,
            slots_off,
            n_slots,
            stride,
            len,
            out,
            out_off,
        } => {
            let (s, o) = read_write(locals, scratch, slots, out)?;
            fold.sum_slots(s, slots_off, n_slots, stride, len, o, out_off)
        }
        ComputeOp::Accumulate {
            acc,
            acc_off,
            slots,
            slots_off,
            n_slots,
            stride,
            len,
        } => {
            let (s, a) = read_write(locals, scratch, slots, acc)?;
            fold.accumulate(a, acc_off, s, slots_off, n_slots, stride, len)
        }
        ComputeOp::Copy {
            src,
            src_off,
            dst,
            dst_off,
            len,
        } => {
            let (s, d) = read_write(locals, scratch, src, dst)?;
            fold.copy(s, src_off, d, dst_off, len)
        }
        ComputeOp::Scale {
            buf,
            off,
            len,
            factor,
        } => fold.scale(buf_mut(locals, scratch, buf)?, off, len, factor),
    }
}
