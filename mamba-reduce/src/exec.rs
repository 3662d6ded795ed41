//! The live executor: runs one rank's [`RankPlan`] over any
//! [`Transport`] with any [`FoldOps`].
//!
//! Per step: one `Transport::group` with every send issued before every
//! receive (the host transport's sends never block, so this order makes
//! every group complete; NCCL matches the group as a unit anyway), then the
//! step's fold operations. Messages between a pair of ranks are issued in
//! plan order on both sides, which is how NCCL and the host transport match
//! them.

use mamba_comm::transport::Group;
use mamba_comm::{CommError, Transport};

use crate::fold::{ChainTerm, FoldOps};
use crate::plan::{BufId, CommOp, ComputeOp, Dataflow, RankPlan, Step};
use crate::{ReduceError, Result};

/// Run `plan` on this rank, step by step (the plan's sequential meaning):
/// `locals` are the caller's [`RankPlan::local_arenas`] arenas (fixed
/// order: the `L/P` arenas of logical ranks `rank*B .. rank*B + B`,
/// ascending; fixed tree: the block's subtree sum), `scratch` holds at
/// least `plan.scratch_len()` elements.
/// Afterwards `locals[0]` holds the mean on every rank; the other locals are
/// unchanged; scratch holds garbage. Every group is waited for before the
/// step's fold operations (host transports, and the device path's serial
/// mode).
pub fn execute<T, F>(
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
        run_group(transport, step, locals, scratch)?;
        for op in &step.compute {
            apply(fold, op, locals, scratch)?;
        }
    }
    fold.finish()
}

/// The step's messages as one `Transport::group` (nothing when it has
/// none), every send issued before every receive.
fn run_group<T: Transport>(
    transport: &mut T,
    step: &Step,
    locals: &mut [T::Buffer],
    scratch: &mut T::Buffer,
) -> Result<()> {
    if step.comm.is_empty() {
        return Ok(());
    }
    let n = locals.len();
    transport.group(&mut lend(locals, scratch), |g| step_messages(g, step, n))?;
    Ok(())
}

/// The buffers a plan names, lent to a group in [`lent_index`] order:
/// the local arenas, then the scratch.
pub(crate) fn lend<'a, B>(locals: &'a mut [B], scratch: &'a mut B) -> Vec<&'a mut B> {
    locals.iter_mut().chain(std::iter::once(scratch)).collect()
}

/// Where [`lend`] puts the buffer `id` of a plan with `locals` local
/// arenas (a local arena the plan should not name is an error, never the
/// scratch's index).
fn lent_index(id: BufId, locals: usize) -> mamba_comm::Result<usize> {
    match id {
        BufId::Local(j) if j < locals => Ok(j),
        BufId::Local(j) => Err(CommError::config(format!(
            "plan names local arena {j} of {locals} (a bug in mamba-reduce)"
        ))),
        BufId::Scratch => Ok(locals),
    }
}

/// Issue the step's messages in `g` (over buffers lent by [`lend`] from
/// `locals` local arenas and the scratch): every send, then every receive.
pub(crate) fn step_messages<T: Transport>(
    g: &mut Group<'_, '_, T>,
    step: &Step,
    locals: usize,
) -> mamba_comm::Result<()> {
    for op in &step.comm {
        if let CommOp::Send { buf, range, peer } = op {
            g.send(lent_index(*buf, locals)?, range.clone(), *peer)?;
        }
    }
    for op in &step.comm {
        if let CommOp::Recv { buf, range, peer } = op {
            g.recv(lent_index(*buf, locals)?, range.clone(), *peer)?;
        }
    }
    Ok(())
}

/// Every local arena has the plan's length, there are `L/P` of them, and
/// the scratch is large enough.
pub(crate) fn check_buffers<T: Transport>(
    plan: &RankPlan,
    locals: &[T::Buffer],
    scratch: &T::Buffer,
) -> Result<()> {
    if locals.len() != plan.local_arenas() {
        let what = if plan.dataflow() == Dataflow::Tree {
            "under the fixed-tree contract every process passes 1 (its block's subtree sum)"
                .to_string()
        } else {
            format!(
                "with logical world {} over {} processes each process passes {} (its \
                 contiguous block of logical ranks, ascending)",
                plan.logical_world(),
                plan.world(),
                plan.blocks()
            )
        };
        return Err(ReduceError::config(format!(
            "rank {} passed {} local arenas; {what}",
            plan.rank(),
            locals.len(),
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

/// Every buffer but a chain's output, shared.
struct Others<'a, B> {
    /// Locals below the output (all of them when the output is scratch).
    before: &'a [B],
    /// Locals above the output.
    after: &'a [B],
    /// Index of the output among the locals, if it is one.
    out: Option<usize>,
    scratch: Option<&'a B>,
}

impl<'a, B> Others<'a, B> {
    fn get(&self, id: BufId) -> Option<&'a B> {
        match (id, self.out) {
            (BufId::Scratch, _) => self.scratch,
            (BufId::Local(i), None) => self.before.get(i),
            (BufId::Local(i), Some(j)) if i < j => self.before.get(i),
            (BufId::Local(i), Some(j)) if i > j => self.after.get(i - j - 1),
            (BufId::Local(_), Some(_)) => None,
        }
    }
}

/// The output buffer `dst` mutably, and every other buffer shared (a
/// chain's terms never name their own output buffer: plans are validated
/// for it).
fn split_out<'a, B>(
    locals: &'a mut [B],
    scratch: &'a mut B,
    dst: BufId,
) -> Result<(&'a mut B, Others<'a, B>)> {
    let n = locals.len();
    match dst {
        BufId::Scratch => Ok((
            scratch,
            Others {
                before: locals,
                after: &[],
                out: None,
                scratch: None,
            },
        )),
        BufId::Local(j) => {
            let (before, rest) = locals.split_at_mut(j.min(n));
            let (out, after) = rest.split_first_mut().ok_or_else(|| {
                ReduceError::invariant(format!("plan names local arena {j} of {n}"))
            })?;
            Ok((
                out,
                Others {
                    before,
                    after,
                    out: Some(j),
                    scratch: Some(scratch),
                },
            ))
        }
    }
}

/// Apply one fold operation to this rank's buffers.
pub(crate) fn apply<B, F: FoldOps<B>>(
    fold: &mut F,
    op: &ComputeOp,
    locals: &mut [B],
    scratch: &mut B,
) -> Result<()> {
    match op {
        ComputeOp::Chain {
            dst,
            dst_off,
            terms,
            len,
            factor,
        } => {
            let (out, others) = split_out(locals, scratch, *dst)?;
            let terms = terms
                .iter()
                .map(|t| match *t {
                    ChainTerm::Dst => Ok(ChainTerm::Dst),
                    ChainTerm::Buf(id, off) => others
                        .get(id)
                        .map(|b| ChainTerm::Buf(b, off))
                        .ok_or_else(|| {
                            ReduceError::invariant(format!(
                                "chain term {id:?} is missing or is its own output {dst:?}"
                            ))
                        }),
                })
                .collect::<Result<Vec<_>>>()?;
            fold.chain(out, *dst_off, &terms, *len, *factor)
        }
        ComputeOp::Copy {
            src,
            src_off,
            dst,
            dst_off,
            len,
        } => {
            let (s, d) = read_write(locals, scratch, *src, *dst)?;
            fold.copy(s, *src_off, d, *dst_off, *len)
        }
    }
}
