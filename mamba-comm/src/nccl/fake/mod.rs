//! A fake NCCL for the CPU tests: fake handles, a call log, a checker for
//! use-after-free and unbalanced groups, and scripted behaviour (hangs,
//! async errors, failed finalize or destroy). Ranks of one fake world run on
//! threads of one test and meet by unique id, like real ones.
//!
//! The fake's model of progress:
//! - init completes (async state `ncclSuccess`) once every rank of the world
//!   has called init with the same id;
//! - every launch (an operation outside a group, or a closed group with
//!   operations) is a numbered window; a rank's window `k` completes once
//!   every rank of its world has launched at least `k` windows. A rank that
//!   withholds its half leaves its peers' windows pending forever.
//!
//! (One file of ~455 lines: the state and the `NcclApi` impl are one model
//! of progress, read together; the script and call log live in `script`.)
//!
//! Over 450 lines on purpose: the fake's state machine (handles, the call
//! log, the group and use-after-free checker, the scripts) is one concept
//! whose parts share private state; split, each part would need it public.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;

use nccl_sys_min::{
    cudaStream_t, ncclComm, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
    NCCL_CONFIG_MAGIC,
};

mod script;

pub(crate) use script::{Call, FinalizeMode, InitMode, Script, StreamMode};

use super::api::NcclApi;
use super::completion::Completion;
use super::result::NcclError;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Live,
    Destroyed,
    Aborted,
}

struct FakeComm {
    rank: i32,
    world: i32,
    id: [u8; 128],
    status: Status,
    launches: u64,
    async_state: Option<ncclResult_t>,
    finalizing: bool,
}

#[derive(Default)]
struct State {
    script: Script,
    comms: HashMap<usize, FakeComm>,
    log: Vec<Call>,
    violations: Vec<String>,
    depth: HashMap<ThreadId, usize>,
    /// Handles with operations queued in each thread's open group.
    queued: HashMap<ThreadId, Vec<usize>>,
    flags: HashMap<usize, Arc<AtomicBool>>,
    next_id: u8,
}

/// The fake library (shared by every rank of a test through `Arc`).
#[derive(Default)]
pub(crate) struct FakeNccl {
    state: Mutex<State>,
}

const BASE: usize = 0x1000;

fn handle_of(id: usize) -> ncclComm_t {
    std::ptr::without_provenance_mut::<ncclComm>(BASE + id * 8)
}

fn id_of(h: ncclComm_t) -> usize {
    (h.addr().wrapping_sub(BASE)) / 8
}

impl FakeNccl {
    pub(crate) fn new(script: Script) -> Arc<Self> {
        let fake = FakeNccl::default();
        fake.lock().script = script;
        Arc::new(fake)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panicking test thread must not hide the log from the others.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The calls so far.
    pub(crate) fn log(&self) -> Vec<Call> {
        self.lock().log.clone()
    }

    /// Misuse the fake detected (calls on freed handles, unbalanced groups).
    pub(crate) fn violations(&self) -> Vec<String> {
        self.lock().violations.clone()
    }

    /// Number of open group levels on the calling thread.
    pub(crate) fn open_groups(&self) -> usize {
        let tid = std::thread::current().id();
        self.lock().depth.get(&tid).copied().unwrap_or(0)
    }

    /// Record `flag`'s value whenever `comm` is aborted.
    pub(crate) fn watch_flag(&self, comm: ncclComm_t, flag: Arc<AtomicBool>) {
        self.lock().flags.insert(id_of(comm), flag);
    }

    /// A fresh 128-byte id (distinct per call).
    pub(crate) fn new_id(&self) -> [u8; 128] {
        let mut s = self.lock();
        s.next_id = s.next_id.wrapping_add(1);
        let n = s.next_id;
        std::array::from_fn(|i| if i == 0 { n } else { (i as u8) ^ 0x5a })
    }

    /// The completion seam of `comm`'s stream.
    pub(crate) fn stream(self: &Arc<Self>, comm: ncclComm_t) -> FakeStream {
        FakeStream {
            fake: Arc::clone(self),
            comm: id_of(comm),
        }
    }

    /// Count of calls matching `pred`.
    pub(crate) fn count(&self, pred: impl Fn(&Call) -> bool) -> usize {
        self.lock().log.iter().filter(|c| pred(c)).count()
    }
}

impl State {
    /// Check that `h` is live for `what`; record a violation otherwise.
    fn live(&mut self, h: ncclComm_t, what: &str) -> bool {
        let id = id_of(h);
        let status = self.comms.get(&id).map(|c| c.status);
        match status {
            Some(Status::Live) => true,
            other => {
                self.violations
                    .push(format!("{what} on handle {id} in state {other:?}"));
                false
            }
        }
    }

    fn peers_joined(&self, c: &FakeComm) -> bool {
        let joined = self.comms.values().filter(|o| o.id == c.id).count();
        joined >= c.world as usize
    }

    fn launch(&mut self, id: usize) {
        let after = self.script.async_after_launch;
        if let Some(c) = self.comms.get_mut(&id) {
            c.launches += 1;
            if after.is_some() {
                c.async_state = after;
            }
        }
    }

    fn enqueue(&mut self, h: ncclComm_t, call: Call) -> ncclResult_t {
        self.log.push(call);
        if !self.live(h, "enqueue") {
            return ncclResult_t::ncclInvalidArgument;
        }
        let rc = self.script.enqueue;
        if rc == ncclResult_t::ncclInProgress && self.script.enqueue_hangs {
            if let Some(c) = self.comms.get_mut(&id_of(h)) {
                c.async_state = Some(ncclResult_t::ncclInProgress);
            }
            return rc;
        }
        if rc != ncclResult_t::ncclSuccess && rc != ncclResult_t::ncclInProgress {
            return rc;
        }
        let tid = std::thread::current().id();
        if self.depth.get(&tid).copied().unwrap_or(0) > 0 {
            let q = self.queued.entry(tid).or_default();
            if !q.contains(&id_of(h)) {
                q.push(id_of(h));
            }
        } else {
            self.launch(id_of(h));
        }
        rc
    }
}

impl NcclApi for FakeNccl {
    fn unique_id(&self) -> Result<[u8; 128], NcclError> {
        Ok(self.new_id())
    }

    fn init_rank_config(
        &self,
        world: c_int,
        id: &[u8; 128],
        rank: c_int,
        config: &mut ncclConfig_t,
    ) -> (ncclResult_t, ncclComm_t) {
        let mut s = self.lock();
        s.log.push(Call::Init {
            rank,
            world,
            blocking: config.blocking,
        });
        if config.magic != NCCL_CONFIG_MAGIC || config.size != std::mem::size_of::<ncclConfig_t>() {
            s.violations
                .push("init with a config not made by ncclConfig_t::initializer()".into());
        }
        if let InitMode::Immediate(rc) = s.script.init {
            return (rc, std::ptr::null_mut());
        }
        let key = s.comms.len() + 1;
        let async_state = match s.script.init {
            InitMode::Async(rc) => Some(rc),
            _ => None,
        };
        s.comms.insert(
            key,
            FakeComm {
                rank,
                world,
                id: *id,
                status: Status::Live,
                launches: 0,
                async_state,
                finalizing: false,
            },
        );
        (ncclResult_t::ncclInProgress, handle_of(key))
    }

    fn error_string(&self, code: ncclResult_t) -> String {
        format!("fake text for code {}", code.0)
    }

    fn group_start(&self) -> ncclResult_t {
        let mut s = self.lock();
        s.log.push(Call::GroupStart);
        *s.depth.entry(std::thread::current().id()).or_default() += 1;
        ncclResult_t::ncclSuccess
    }

    fn group_end(&self) -> ncclResult_t {
        let mut s = self.lock();
        s.log.push(Call::GroupEnd);
        let tid = std::thread::current().id();
        let depth = s.depth.entry(tid).or_default();
        if *depth == 0 {
            s.violations
                .push("ncclGroupEnd without ncclGroupStart".into());
            return ncclResult_t::ncclInvalidUsage;
        }
        *depth -= 1;
        if *depth == 0 {
            for id in s.queued.remove(&tid).unwrap_or_default() {
                if s.comms.get(&id).map(|c| c.status) == Some(Status::Live) {
                    s.launch(id);
                }
            }
        }
        s.script.group_end
    }

    unsafe fn async_error(&self, comm: ncclComm_t) -> Result<ncclResult_t, NcclError> {
        let mut s = self.lock();
        s.log.push(Call::AsyncError(id_of(comm)));
        if !s.live(comm, "ncclCommGetAsyncError") {
            return Err(NcclError(ncclResult_t::ncclInvalidArgument));
        }
        let finalize = s.script.finalize;
        let c = &s.comms[&id_of(comm)];
        if let Some(rc) = c.async_state {
            return Ok(rc);
        }
        if c.finalizing {
            return Ok(match finalize {
                FinalizeMode::Hang => ncclResult_t::ncclInProgress,
                FinalizeMode::Async(rc) => rc,
                _ => ncclResult_t::ncclSuccess,
            });
        }
        if !s.peers_joined(c) {
            return Ok(ncclResult_t::ncclInProgress);
        }
        Ok(ncclResult_t::ncclSuccess)
    }

    unsafe fn last_error(&self, comm: ncclComm_t) -> String {
        let mut s = self.lock();
        if !comm.is_null() {
            s.live(comm, "ncclGetLastError");
        }
        s.script.last_error.clone()
    }

    unsafe fn finalize(&self, comm: ncclComm_t) -> ncclResult_t {
        let mut s = self.lock();
        s.log.push(Call::Finalize(id_of(comm)));
        if !s.live(comm, "ncclCommFinalize") {
            return ncclResult_t::ncclInvalidArgument;
        }
        if let FinalizeMode::Immediate(rc) = s.script.finalize {
            return rc;
        }
        if let Some(c) = s.comms.get_mut(&id_of(comm)) {
            c.finalizing = true;
        }
        ncclResult_t::ncclInProgress
    }

    unsafe fn destroy(&self, comm: ncclComm_t) -> ncclResult_t {
        let mut s = self.lock();
        s.log.push(Call::Destroy(id_of(comm)));
        if !s.live(comm, "ncclCommDestroy") {
            return ncclResult_t::ncclInvalidArgument;
        }
        if let Some(c) = s.comms.get_mut(&id_of(comm)) {
            c.status = Status::Destroyed;
        }
        s.script.destroy
    }

    unsafe fn abort(&self, comm: ncclComm_t) -> ncclResult_t {
        let mut s = self.lock();
        let id = id_of(comm);
        let flag_was_set = s.flags.get(&id).map(|f| f.load(Ordering::SeqCst));
        s.log.push(Call::Abort {
            comm: id,
            flag_was_set,
        });
        if !s.live(comm, "ncclCommAbort") {
            return ncclResult_t::ncclInvalidArgument;
        }
        if let Some(c) = s.comms.get_mut(&id) {
            c.status = Status::Aborted;
        }
        s.script.abort
    }

    unsafe fn identity(&self, comm: ncclComm_t) -> Result<(c_int, c_int, c_int), NcclError> {
        let mut s = self.lock();
        if !s.live(comm, "identity") {
            return Err(NcclError(ncclResult_t::ncclInvalidArgument));
        }
        let c = &s.comms[&id_of(comm)];
        Ok((s.script.identity_world.unwrap_or(c.world), c.rank, 0))
    }

    unsafe fn all_reduce(
        &self,
        _send: *const c_void,
        _recv: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        _stream: cudaStream_t,
    ) -> ncclResult_t {
        let call = Call::AllReduce {
            comm: id_of(comm),
            count,
            dtype: dtype.0,
            op: op.0,
        };
        self.lock().enqueue(comm, call)
    }

    unsafe fn broadcast(
        &self,
        _send: *const c_void,
        _recv: *mut c_void,
        count: usize,
        _dtype: ncclDataType_t,
        root: c_int,
        comm: ncclComm_t,
        _stream: cudaStream_t,
    ) -> ncclResult_t {
        self.lock().enqueue(
            comm,
            Call::Broadcast {
                comm: id_of(comm),
                count,
                root,
            },
        )
    }

    unsafe fn send(
        &self,
        _buf: *const c_void,
        count: usize,
        _dtype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        _stream: cudaStream_t,
    ) -> ncclResult_t {
        self.lock().enqueue(
            comm,
            Call::Send {
                comm: id_of(comm),
                count,
                peer,
            },
        )
    }

    unsafe fn recv(
        &self,
        _buf: *mut c_void,
        count: usize,
        _dtype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        _stream: cudaStream_t,
    ) -> ncclResult_t {
        self.lock().enqueue(
            comm,
            Call::Recv {
                comm: id_of(comm),
                count,
                peer,
            },
        )
    }
}

/// The fake stream of one communicator.
pub(crate) struct FakeStream {
    fake: Arc<FakeNccl>,
    comm: usize,
}

impl Completion for FakeStream {
    fn poll(&self) -> Result<bool, String> {
        let s = self.fake.lock();
        match &s.script.stream {
            StreamMode::Never => return Ok(false),
            StreamMode::Error(e) => return Err(e.clone()),
            StreamMode::Match => {}
        }
        let Some(me) = s.comms.get(&self.comm) else {
            return Err("fake stream of an unknown communicator".into());
        };
        let done = s
            .comms
            .values()
            .filter(|o| o.id == me.id)
            .all(|o| o.launches >= me.launches);
        Ok(done)
    }
}
