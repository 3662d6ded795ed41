//! The two-lane executor of fixed-order plans over NCCL.
//!
//! One reduction is one [`NcclComm::window`]: every group is queued on the
//! communicator's stream (the comm lane) and every fold on a second stream
//! of the same context (the compute lane), with an event wait wherever the
//! plan's lane dependencies put one (`crate::lanes`), and the host waits
//! once, at the window's end, under the communicator's watchdog. There is
//! no host round-trip between groups, and the fold of chunk `t` runs while
//! the groups of the next step move other chunks.
//!
//! Streams and buffers:
//! - The base addresses of the caller's arenas and of the scratch are taken
//!   once, through cudarc on the comm lane: that makes the comm lane wait
//!   for earlier writes (and, for the buffers this rank writes, reads) of
//!   those buffers on other streams. The compute lane starts after that
//!   point (a start event), so it is ordered after them too.
//! - The folds run on raw addresses (`det_chain_raw`), outside cudarc's
//!   per-allocation event tracking, which would otherwise order every fold
//!   after every group touching the same arena (and so serialise the
//!   lanes). Their ordering is exactly the lane waits, which keep every
//!   conflicting pair of the sequential meaning in order.
//! - The compute lane's last fold is joined into the comm lane before the
//!   window ends, so the window's wait covers both; `reduce_mean` returns
//!   only when everything has completed, which is also why the buffers'
//!   cudarc events need not describe this reduction's work.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::result::memcpy_dtod_async;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use kernels::FoldKernel;
use mamba_comm::nccl::NcclComm;

use super::DeviceFold;
use crate::exec::{check_buffers, execute, lend, step_messages};
use crate::fold::ChainTerm;
use crate::plan::{BufId, ComputeOp, RankPlan};
use crate::reducer::PlanRunner;
use crate::{ReduceError, Result};

/// How long a failed reduction waits for its queued folds (see
/// [`DeviceFold::settle`]).
const LANE_SETTLE: Duration = Duration::from_secs(10);

impl PlanRunner<NcclComm> for DeviceFold {
    fn run_plan(
        &mut self,
        plan: &RankPlan,
        comm: &mut NcclComm,
        locals: &mut [CudaSlice<f32>],
        scratch: &mut CudaSlice<f32>,
    ) -> Result<()> {
        if self.overlap {
            self.run_two_lanes(plan, comm, locals, scratch)
        } else {
            execute(plan, comm, self, locals, scratch)
        }
    }
}

/// Device addresses of this rank's buffers.
struct Bases {
    locals: Vec<u64>,
    scratch: u64,
}

impl Bases {
    /// Address of element `off` of `id`. In range for validated plans:
    /// `check_buffers` showed every buffer holds what the plan names.
    fn at(&self, id: BufId, off: usize) -> Result<u64> {
        let base = match id {
            BufId::Scratch => self.scratch,
            BufId::Local(j) => *self.locals.get(j).ok_or_else(|| {
                ReduceError::invariant(format!(
                    "plan names local arena {j} of {}",
                    self.locals.len()
                ))
            })?,
        };
        Ok(base + 4 * off as u64)
    }
}

/// Indices into the event pool: which step of which lane records one.
struct EventPlan {
    /// `comm[t]`: the event recorded after step `t`'s group, if a fold
    /// waits for it.
    comm: Vec<Option<usize>>,
    /// `compute[t]`: the event recorded after step `t`'s folds, if a group
    /// (or the final join) waits for it.
    compute: Vec<Option<usize>>,
    /// The event the compute lane starts after.
    start: usize,
    count: usize,
}

impl EventPlan {
    fn of(plan: &RankPlan) -> EventPlan {
        let n = plan.steps.len();
        let (mut comm_needed, mut compute_needed) = (vec![false; n], vec![false; n]);
        for d in &plan.lanes {
            if let Some(u) = d.compute_after {
                comm_needed[u] = true;
            }
            if let Some(s) = d.comm_after {
                compute_needed[s] = true;
            }
        }
        if let Some(last) = (0..n).rev().find(|&t| !plan.steps[t].compute.is_empty()) {
            compute_needed[last] = true;
        }
        let mut count = 1; // the start event
        let mut assign = |needed: Vec<bool>| {
            needed
                .into_iter()
                .map(|x| {
                    x.then(|| {
                        count += 1;
                        count - 1
                    })
                })
                .collect::<Vec<_>>()
        };
        let comm = assign(comm_needed);
        let compute = assign(compute_needed);
        EventPlan {
            comm,
            compute,
            start: 0,
            count,
        }
    }
}

fn driver(op: &'static str) -> impl Fn(cudarc::driver::DriverError) -> ReduceError {
    move |e| ReduceError::device(op, e)
}

impl DeviceFold {
    /// The compute lane: a second stream in the communicator's context.
    fn lane(&mut self) -> Result<Arc<CudaStream>> {
        if let Some(l) = &self.lane {
            return Ok(l.clone());
        }
        let l = self
            .stream
            .context()
            .new_stream()
            .map_err(driver("creating the fold stream"))?;
        self.lane = Some(l.clone());
        Ok(l)
    }

    fn ensure_events(&mut self, n: usize) -> Result<()> {
        while self.events.len() < n {
            let e = self
                .stream
                .context()
                .new_event(None)
                .map_err(driver("creating an event"))?;
            self.events.push(e);
        }
        Ok(())
    }

    /// See the module docs.
    fn run_two_lanes(
        &mut self,
        plan: &RankPlan,
        comm: &mut NcclComm,
        locals: &mut [CudaSlice<f32>],
        scratch: &mut CudaSlice<f32>,
    ) -> Result<()> {
        check_buffers::<NcclComm>(plan, locals, scratch)?;
        if plan.steps.is_empty() {
            return Ok(());
        }
        let comm_stream = comm.stream().clone();
        if comm_stream.context().cu_ctx() != self.stream.context().cu_ctx() {
            return Err(ReduceError::config(format!(
                "the fold kernels were loaded on device {}, the communicator runs on device {}; \
                 load the DeviceFold on the communicator's stream",
                self.stream.context().ordinal(),
                comm_stream.context().ordinal()
            )));
        }
        let lane = self.lane()?;
        let events = EventPlan::of(plan);
        self.ensure_events(events.count)?;

        // Base addresses, taken on the comm lane (see the module docs). The
        // guards drop at once: their events mark this point of the comm
        // lane, and the reduction completes before reduce_mean returns.
        let mut bases = Bases {
            locals: Vec::with_capacity(locals.len()),
            scratch: scratch.device_ptr_mut(&comm_stream).0,
        };
        for (j, b) in locals.iter_mut().enumerate() {
            let p = if j == 0 {
                b.device_ptr_mut(&comm_stream).0
            } else {
                b.device_ptr(&comm_stream).0
            };
            bases.locals.push(p);
        }
        comm.context().check_err().map_err(driver(
            "ordering the reduction after earlier uses of the arenas",
        ))?;
        let start = &self.events[events.start];
        start
            .record(&comm_stream)
            .map_err(driver("recording the start event"))?;
        lane.wait(start)
            .map_err(driver("ordering the fold stream after the start"))?;

        let this = &*self;
        // Folds that run beside transfers take the overlap grid (see
        // FoldGrid); a one-chunk plan's fold has the GPU to itself.
        let kernel = if overlaps_transfers(plan) {
            &this.overlap_kernel
        } else {
            &this.kernel
        };
        let n_locals = locals.len();
        let result = comm.window(&mut lend(locals, scratch), |w| {
            // The latest step of the other lane each lane already waits for.
            let mut comm_waits: Option<usize> = None;
            let mut lane_waits: Option<usize> = None;
            let mut last_fold: Option<usize> = None;
            for (t, step) in plan.steps.iter().enumerate() {
                let deps = plan.lanes[t];
                if !step.comm.is_empty() {
                    if let Some(s) = deps.comm_after {
                        if comm_waits.is_none_or(|w| w < s) {
                            let e = this.event(events.compute[s])?;
                            comm_stream
                                .wait(e)
                                .map_err(driver("ordering a group after a fold"))?;
                            comm_waits = Some(s);
                        }
                    }
                    w.group(|g| step_messages(g, step, n_locals))?;
                    if let Some(i) = events.comm[t] {
                        this.events[i]
                            .record(&comm_stream)
                            .map_err(driver("recording a group's event"))?;
                    }
                }
                if !step.compute.is_empty() {
                    if let Some(u) = deps.compute_after {
                        if lane_waits.is_none_or(|w| w < u) {
                            let e = this.event(events.comm[u])?;
                            lane.wait(e)
                                .map_err(driver("ordering a fold after a group"))?;
                            lane_waits = Some(u);
                        }
                    }
                    for op in &step.compute {
                        launch(kernel, &lane, op, &bases)?;
                    }
                    if let Some(i) = events.compute[t] {
                        this.events[i]
                            .record(&lane)
                            .map_err(driver("recording a fold's event"))?;
                    }
                    last_fold = Some(t);
                }
            }
            // Join the compute lane into the comm lane: the window's wait
            // then covers every fold.
            if let Some(t) = last_fold {
                if comm_waits.is_none_or(|w| w < t) {
                    let e = this.event(events.compute[t])?;
                    comm_stream
                        .wait(e)
                        .map_err(driver("joining the fold stream"))?;
                }
            }
            Ok::<(), ReduceError>(())
        });
        if result.is_err() {
            self.settle(&lane, events.start);
        }
        result
    }

    /// After a failed window: give the folds already queued on the compute
    /// lane a bounded time to finish (the communicator was aborted, which
    /// ends its kernels and so the lane's waits), so that buffers the caller
    /// drops next are not still in use there. Best effort: the error being
    /// returned already says to tear the world down.
    fn settle(&self, lane: &CudaStream, event: usize) {
        let Some(e) = self.events.get(event) else {
            return;
        };
        if e.record(lane).is_err() {
            return;
        }
        let until = Instant::now() + LANE_SETTLE;
        while Instant::now() < until {
            match e.try_is_complete() {
                Ok(false) => std::thread::sleep(Duration::from_micros(100)),
                _ => return,
            }
        }
    }

    fn event(&self, index: Option<usize>) -> Result<&cudarc::driver::CudaEvent> {
        index
            .and_then(|i| self.events.get(i))
            .ok_or_else(|| ReduceError::invariant("a lane waits for a step that records no event"))
    }
}

/// Whether some fold of `plan` runs while a group moves other elements:
/// two or more chunks over two or more processes. (One chunk: every group
/// waits for the fold or the fold for it. One process: no groups.)
pub(crate) fn overlaps_transfers(plan: &RankPlan) -> bool {
    plan.world() > 1 && plan.chunks() > 1
}

/// Enqueue one fold operation on the compute lane, on raw addresses, with
/// `kernel`'s launch shape.
fn launch(kernel: &FoldKernel, lane: &CudaStream, op: &ComputeOp, bases: &Bases) -> Result<()> {
    match op {
        ComputeOp::Chain {
            dst,
            dst_off,
            terms,
            len,
            factor,
        } => {
            let d = bases.at(*dst, *dst_off)?;
            let addends = terms
                .iter()
                .map(|t| match t {
                    ChainTerm::Dst => Ok(d),
                    ChainTerm::Buf(b, off) => bases.at(*b, *off),
                })
                .collect::<Result<Vec<u64>>>()?;
            // SAFETY: the plan is validated (every chain's output and
            // terms lie inside buffers of plan.len() / scratch_len()
            // elements, terms other than Dst in other buffers) and
            // check_buffers showed the buffers are at least that long;
            // they are borrowed for the whole window, whose end waits
            // for this launch; the lane waits order it against every
            // conflicting group, and the compute lane is in order.
            unsafe {
                kernel.det_chain_raw(lane, d, &addends, *len, *factor)?;
            }
        }
        ComputeOp::Copy {
            src,
            src_off,
            dst,
            dst_off,
            len,
        } => {
            if *len > 0 {
                let (s, d) = (bases.at(*src, *src_off)?, bases.at(*dst, *dst_off)?);
                // SAFETY: as for the chain: in-bounds regions of live
                // buffers (validated plan, checked lengths), in
                // different buffers, ordered by the lane waits.
                unsafe { memcpy_dtod_async(d, s, 4 * len, lane.cu_stream()) }
                    .map_err(driver("cuMemcpyDtoDAsync"))?;
            }
        }
    }
    Ok(())
}
