//! [`NcclComm`]: the core, on a CUDA device, behind the
//! [`Transport`] interface.
//!
//! Over 450 lines (480): the `Transport` implementation over the core is
//! one impl block whose methods share the window/watchdog discipline; the
//! windows themselves already live in `window.rs`. The next split is the
//! byte-movement methods (send/recv/broadcast) into their own file.

use std::ops::Range;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use nccl_sys_min::ncclRedOp_t;

use super::api::{NcclApi, RealNccl};
use super::checks;
use super::completion::StreamCompletion;
use super::core::{CommCore, Place};
use super::cuda::{cuda_error, device_ptr, open_device, raw_stream};
use super::op::{NcclElement, Op};
use super::{check_version, library, unique_id, NcclOptions, NcclVersion};
use crate::flight::{CallKind, FlightRecorder};
use crate::transport::Group;
use crate::{CommError, Rendezvous, Result, Transport};

/// Set while an [`NcclComm`] exists in this process (one per process).
static COMM_LIVE: AtomicBool = AtomicBool::new(false);

/// This process's claim on its one communicator; released on drop.
struct ProcessSlot;

impl ProcessSlot {
    fn claim() -> Result<Self> {
        COMM_LIVE
            .compare_exchange(false, true, Ordering::SeqCst, Ordering::SeqCst)
            .map(|_| ProcessSlot)
            .map_err(|_| {
                CommError::config(
                    "another NcclComm is live in this process; one communicator per process \
                     (shut the first down, or drop it, before creating another)",
                )
            })
    }
}

impl Drop for ProcessSlot {
    fn drop(&mut self) {
        COMM_LIVE.store(false, Ordering::SeqCst);
    }
}

/// One rank of an NCCL world on one GPU.
///
/// Ownership: the communicator owns its NCCL handle (inside the core), a
/// stream of its own, and a reference on the CUDA context it was created in.
/// Fields drop in declaration order, so a live communicator is aborted while
/// its stream and context still exist. Buffers (`CudaSlice<f32>`) belong to
/// the caller and may come from other streams of the same context: every
/// operation takes the device pointer through cudarc's event tracking, so
/// the communicator's stream waits for their last writes.
///
/// Every operation is host-synchronous: it returns once the stream has
/// completed it (a group returns once the whole group has completed), so
/// results are ready for any stream when a call returns. The one exception
/// is a group inside [`NcclComm::window`], which the window's end waits
/// for ([`Window::group`](super::Window::group)).
///
/// Buffers used by a group are lent to it: [`Transport::group`] (and
/// [`NcclComm::window`]) borrow them for the whole call and the body names
/// them by index, because NCCL reads and writes a group's memory only when
/// the group closes (a window's, until the window's final wait). A buffer
/// made or dropped inside a body cannot reach the group, so the
/// use-after-free of a buffer freed on its stream before NCCL's kernel is
/// enqueued cannot be written (see [`Group`]).
///
/// After any error the communicator may have been aborted; callers tear the
/// world down (see [`Transport`]).
pub struct NcclComm {
    pub(super) core: CommCore,
    pub(super) stream: Arc<CudaStream>,
    ctx: Arc<CudaContext>,
    version: NcclVersion,
    options: NcclOptions,
    /// This rank's flight recorder (see [`crate::flight`]).
    pub(super) flight: FlightRecorder,
    /// The recorder's entry of the open group or window: operations
    /// inside count into it.
    pub(super) flight_open: Option<u64>,
    _slot: ProcessSlot,
}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclComm")
            .field("core", &self.core)
            .field("device", &self.ctx.ordinal())
            .field("version", &self.version)
            .finish()
    }
}

impl NcclComm {
    /// Create rank `rank` of a `world`-rank communicator on CUDA device
    /// `device`, meeting the other ranks through `rdv`.
    ///
    /// Rank 0 creates the unique id and publishes it under
    /// [`UNIQUE_ID_KEY`](super::UNIQUE_ID_KEY); the others fetch exactly
    /// [`UNIQUE_ID_BYTES`](super::UNIQUE_ID_BYTES) bytes.
    /// The whole call (id exchange and NCCL's init) is bounded by
    /// `opts.init_timeout`: a rank that never arrives is an error after it,
    /// never an eternal wait, and the half-made communicator is aborted.
    pub fn init(
        rank: usize,
        world: usize,
        device: usize,
        rdv: &dyn Rendezvous,
        opts: NcclOptions,
    ) -> Result<NcclComm> {
        let started = Instant::now();
        let deadline = started + opts.init_timeout;
        if world == 0 || rank >= world {
            return Err(CommError::config(format!(
                "NcclComm::init: rank {rank} is outside a world of {world}; expected 0 <= rank < world"
            )));
        }
        if rdv.rank() != rank || rdv.world() != world {
            return Err(CommError::config(format!(
                "NcclComm::init: asked for rank {rank} of {world} but the rendezvous is for rank {} of {}",
                rdv.rank(),
                rdv.world()
            )));
        }
        let slot = ProcessSlot::claim()?;
        let lib = library()?;
        let version = check_version(lib.version(), lib.path())?;
        let api: Arc<dyn NcclApi> = Arc::new(RealNccl { lib });
        let (ctx, stream) = open_device(device)?;

        let id = unique_id::exchange(&*api, rank, rdv, deadline)?;

        ctx.bind_to_thread().map_err(cuda_error("init"))?;
        let mut core = CommCore::init(
            api,
            &id,
            Place { rank, world },
            opts.init_timeout,
            deadline,
            opts.collective_timeout,
        )?;
        if usize::try_from(core.device()).ok() != Some(device) {
            let got = core.device();
            return Err(core.fail(
                "init",
                format!("NCCL placed this rank on CUDA device {got}; expected device {device}"),
            ));
        }
        let flight = FlightRecorder::from_env(rank, world, rdv.shared_dir())?;
        Ok(NcclComm {
            core,
            stream,
            ctx,
            version,
            options: opts,
            flight,
            flight_open: None,
            _slot: slot,
        })
    }

    /// The CUDA context the communicator was created in (and retains).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The communicator's own stream: every NCCL operation is enqueued here.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The NCCL library's version.
    pub fn version(&self) -> NcclVersion {
        self.version
    }

    /// The deadlines this communicator runs under.
    pub fn options(&self) -> NcclOptions {
        self.options
    }

    /// End every later wait of this communicator as soon as `watch` has
    /// seen another rank's posted failure ([`crate::world_abort`]): the
    /// operation then fails with [`CommError::PeerFailed`] naming that rank
    /// (and aborts this communicator, as any failure does) instead of
    /// waiting for the collective timeout. Replaces an earlier watch.
    pub fn watch_aborts(&mut self, watch: crate::world_abort::AbortWatch) {
        self.core.set_abort_watch(watch);
    }

    /// True once the communicator has been aborted (after a failed or
    /// timed-out operation); every later operation fails at once.
    pub fn is_aborted(&self) -> bool {
        self.core.is_aborted()
    }

    /// Orderly teardown: finalize (polled to completion under the collective
    /// timeout) then destroy. A failed finalize aborts instead; a failed
    /// destroy is reported and not followed by an abort. On an aborted
    /// communicator there is nothing left to release and this returns
    /// `Ok(())`. Consumes the communicator; its `Drop` then does nothing.
    pub fn shutdown(mut self) -> Result<()> {
        self.bind("shutdown")?;
        self.core.shutdown()
    }

    /// Make the communicator's context current on the calling thread (the
    /// communicator may have moved threads since the last call).
    pub(super) fn bind(&self, op: &'static str) -> Result<()> {
        self.ctx.bind_to_thread().map_err(cuda_error(op))
    }

    /// Surface errors cudarc recorded while tracking buffer events.
    pub(super) fn check_cuda(&mut self, op: &'static str) -> Result<()> {
        match self.ctx.check_err() {
            Ok(()) => Ok(()),
            Err(e) => Err(self
                .core
                .fail(op, format!("CUDA reported {e} around the operation"))),
        }
    }

    /// Open a group, run `body` over the lent `buffers`, close the group
    /// (always, also when `body` fails or panics) and, outside a window,
    /// wait for it. A panicking body is treated as a failed one (the
    /// communicator is aborted if it had enqueued anything, so NCCL no
    /// longer uses the buffers the unwinding drops), then the panic
    /// continues.
    pub(super) fn run_group<R>(
        &mut self,
        buffers: &mut [&mut CudaSlice<f32>],
        body: impl FnOnce(&mut Group<'_, '_, Self>) -> Result<R>,
    ) -> Result<R> {
        self.bind("group")?;
        self.core.group_begin()?;
        // Inside a window, the window's entry counts the group's operations.
        let own = self.flight_open.is_none();
        let seq = self.flight.begin_if(own, CallKind::Group);
        if own {
            self.flight_open = Some(seq);
        }
        let result = catch_unwind(AssertUnwindSafe(|| body(&mut Group::new(self, buffers))));
        let completion = StreamCompletion {
            stream: &self.stream,
        };
        let res = match result {
            Ok(result) => self.core.group_finish(&completion, result),
            Err(panic) => {
                let failed = Err(CommError::config("the group body panicked"));
                let _ = self.core.group_finish::<R>(&completion, failed);
                if own {
                    self.flight_open = None;
                    self.flight.finish(seq, false);
                }
                resume_unwind(panic)
            }
        };
        if own {
            self.flight_open = None;
            self.flight.finish(seq, res.is_ok());
        }
        self.note_failure(res)
    }

    /// In-place i32 max of host values (the i32 all-reduce behind
    /// `all_reduce_max_i32` and `barrier`).
    fn max_i32(&mut self, op: &'static str, values: &mut [i32]) -> Result<()> {
        self.core.refuse_host_wait(op)?;
        if values.is_empty() {
            return Ok(());
        }
        self.bind(op)?;
        let mut dev = self.stream.clone_htod(values).map_err(cuda_error(op))?;
        self.launch(
            op,
            Op::AllReduce {
                buf: dev.slice_mut(..),
                reduce: ncclRedOp_t::ncclMax,
            },
        )?;
        self.stream
            .memcpy_dtoh(&dev, values)
            .map_err(cuda_error(op))?;
        self.stream.synchronize().map_err(cuda_error(op))?;
        self.check_cuda(op)
    }

    /// The one wrapper of every NCCL operation: take the view's device
    /// pointer through cudarc's event tracking (so this stream waits for
    /// the buffer's last writes, and later users wait for this operation),
    /// run the operation as a core window (or group member), then surface
    /// CUDA errors. The element count and type come from the view, so they
    /// always match the memory NCCL is given. An empty view makes no call.
    fn launch<T: NcclElement>(&mut self, name: &'static str, op: Op<'_, T>) -> Result<()> {
        let (n, _) = op.shape();
        if n == 0 {
            return Ok(());
        }
        let bytes = (n * std::mem::size_of::<T>()) as u64;
        let peer = match &op {
            Op::Send { peer, .. } | Op::Recv { peer, .. } => Some(*peer),
            Op::Broadcast { root, .. } => Some(*root),
            Op::AllReduce { .. } => None,
        };
        let seq = match self.flight_open {
            Some(open) => {
                self.flight.add(open, bytes, peer);
                None
            }
            None => Some(self.flight.begin(call_kind(name), bytes, peer)),
        };
        let res = self.enqueue(name, op);
        if let Some(s) = seq {
            self.flight.finish(s, res.is_ok());
        }
        self.note_failure(res)
    }

    /// Dump the flight recorder when `res` is an error that aborted the
    /// communicator (a watchdog expiry, a peer's failure, any abort).
    pub(super) fn note_failure<R>(&mut self, res: Result<R>) -> Result<R> {
        if let Err(e) = &res {
            if self.core.is_aborted() {
                self.flight.dump(&e.to_string());
            }
        }
        res
    }

    /// [`NcclComm::launch`] without the recorder.
    fn enqueue<T: NcclElement>(&mut self, name: &'static str, mut op: Op<'_, T>) -> Result<()> {
        let (n, kind) = op.shape();
        self.bind(name)?;
        let (ptr, record) = match &mut op {
            Op::Send { src, .. } => src.device_ptr(&self.stream),
            Op::Recv { dst: buf, .. } | Op::Broadcast { buf, .. } | Op::AllReduce { buf, .. } => {
                buf.device_ptr_mut(&self.stream)
            }
        };
        let (p, stream, dtype) = (device_ptr(ptr), raw_stream(&self.stream), T::DTYPE);
        let completion = StreamCompletion {
            stream: &self.stream,
        };
        self.core.run(name, &completion, |api, comm| {
            // SAFETY: `p` addresses the view's `n` elements of `T` (`dtype`)
            // on this communicator's device; the view is borrowed until this
            // call returns, which outside a group is after the stream
            // completed the operation (inside a group or window the caller
            // keeps the buffer alive until the group or window returns: see
            // the type docs). `comm` is live (given by the core), `stream`
            // is this communicator's.
            unsafe { kind.enqueue(api, p, n, dtype, comm, stream) }
        })?;
        drop(record);
        self.check_cuda(name)
    }
}

impl Transport for NcclComm {
    type Buffer = CudaSlice<f32>;

    fn rank(&self) -> usize {
        self.core.rank()
    }

    fn world(&self) -> usize {
        self.core.world()
    }

    fn alloc(&mut self, len: usize) -> Result<CudaSlice<f32>> {
        self.bind("alloc")?;
        self.stream
            .alloc_zeros::<f32>(len)
            .map_err(cuda_error("alloc"))
    }

    fn buffer_len(buf: &CudaSlice<f32>) -> usize {
        buf.len()
    }

    fn upload(&mut self, src: &[f32], dst: &mut CudaSlice<f32>, offset: usize) -> Result<()> {
        self.core.refuse_host_wait("upload")?;
        let r = checks::span("upload", offset, src.len(), dst.len())?;
        if r.is_empty() {
            return Ok(());
        }
        self.bind("upload")?;
        self.stream
            .memcpy_htod(src, &mut dst.slice_mut(r))
            .map_err(cuda_error("upload"))
    }

    fn download(&mut self, src: &CudaSlice<f32>, offset: usize, dst: &mut [f32]) -> Result<()> {
        self.core.refuse_host_wait("download")?;
        let r = checks::span("download", offset, dst.len(), src.len())?;
        if r.is_empty() {
            return Ok(());
        }
        self.bind("download")?;
        self.stream
            .memcpy_dtoh(&src.slice(r), dst)
            .map_err(cuda_error("download"))?;
        // A copy into pageable memory already returns complete; the explicit
        // synchronise keeps that true for pinned (page-locked) `dst` too.
        self.stream.synchronize().map_err(cuda_error("download"))
    }

    /// Outside a window the group is waited for under the watchdog before
    /// this returns (inside one, see [`Window::group`](super::Window::group)).
    fn group<R>(
        &mut self,
        buffers: &mut [&mut CudaSlice<f32>],
        body: impl FnOnce(&mut Group<'_, '_, Self>) -> Result<R>,
    ) -> Result<R> {
        self.run_group(buffers, body)
    }

    /// An empty range sends nothing (and makes no NCCL call); its matching
    /// `recv` must be empty too.
    fn send(&mut self, buf: &CudaSlice<f32>, range: Range<usize>, peer: usize) -> Result<()> {
        checks::range("send", &range, buf.len())?;
        checks::peer("send", peer, self.rank(), self.world())?;
        let src = buf.slice(range);
        self.launch("send", Op::Send { src, peer })
    }

    /// An empty range receives nothing (and makes no NCCL call).
    fn recv(&mut self, buf: &mut CudaSlice<f32>, range: Range<usize>, peer: usize) -> Result<()> {
        checks::range("recv", &range, buf.len())?;
        checks::peer("recv", peer, self.rank(), self.world())?;
        let dst = buf.slice_mut(range);
        self.launch("recv", Op::Recv { dst, peer })
    }

    fn broadcast(
        &mut self,
        buf: &mut CudaSlice<f32>,
        range: Range<usize>,
        root: usize,
    ) -> Result<()> {
        checks::range("broadcast", &range, buf.len())?;
        checks::root("broadcast", root, self.world())?;
        let buf = buf.slice_mut(range);
        self.launch("broadcast", Op::Broadcast { buf, root })
    }

    fn all_reduce_sum_f32(&mut self, buf: &mut CudaSlice<f32>, range: Range<usize>) -> Result<()> {
        checks::range("all_reduce_sum_f32", &range, buf.len())?;
        let buf = buf.slice_mut(range);
        let reduce = ncclRedOp_t::ncclSum;
        self.launch("all_reduce_sum_f32", Op::AllReduce { buf, reduce })
    }

    fn all_reduce_max_i32(&mut self, values: &mut [i32]) -> Result<()> {
        self.max_i32("all_reduce_max_i32", values)
    }

    fn barrier(&mut self) -> Result<()> {
        let mut token = [0i32];
        self.max_i32("barrier", &mut token)
    }
}

impl Drop for NcclComm {
    /// Makes the context current so the core's abort of a still-live
    /// communicator runs on the right device; never panics.
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
    }
}

/// The recorder's kind of the operation `name` (as [`NcclComm::launch`]
/// is called).
fn call_kind(name: &str) -> CallKind {
    match name {
        "send" => CallKind::Send,
        "recv" => CallKind::Recv,
        "broadcast" => CallKind::Broadcast,
        "all_reduce_sum_f32" => CallKind::AllReduceSum,
        "barrier" => CallKind::Barrier,
        _ => CallKind::AllReduceMax,
    }
}
