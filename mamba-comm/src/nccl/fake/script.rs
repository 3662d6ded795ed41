//! What the fake can be told to do ([`Script`]) and what it records
//! ([`Call`]).

use nccl_sys_min::ncclResult_t;

/// One NCCL call as the fake saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Call {
    Init {
        rank: i32,
        world: i32,
        blocking: i32,
    },
    AsyncError(usize),
    Finalize(usize),
    Destroy(usize),
    /// `flag_was_set`: the communicator's aborted flag (when registered with
    /// [`FakeNccl::watch_flag`]) at the moment abort was called.
    Abort {
        comm: usize,
        flag_was_set: Option<bool>,
    },
    GroupStart,
    GroupEnd,
    AllReduce {
        comm: usize,
        count: usize,
        dtype: u32,
        op: u32,
    },
    Broadcast {
        comm: usize,
        count: usize,
        root: i32,
    },
    Send {
        comm: usize,
        count: usize,
        peer: i32,
    },
    Recv {
        comm: usize,
        count: usize,
        peer: i32,
    },
}

/// How init behaves.
#[derive(Clone, Copy, Debug)]
pub(crate) enum InitMode {
    /// Complete when every rank has joined.
    Join,
    /// `ncclCommInitRankConfig` itself fails with this code, no handle.
    Immediate(ncclResult_t),
    /// The init call succeeds, then the async state turns into this error.
    Async(ncclResult_t),
}

/// How finalize behaves.
#[derive(Clone, Copy, Debug)]
pub(crate) enum FinalizeMode {
    Ok,
    /// Stays `ncclInProgress` forever.
    Hang,
    /// `ncclCommFinalize` returns this code.
    Immediate(ncclResult_t),
    /// The async state after finalize turns into this error.
    Async(ncclResult_t),
}

/// How streams complete.
#[derive(Clone, Debug)]
pub(crate) enum StreamMode {
    /// When every rank has launched the window.
    Match,
    /// Never.
    Never,
    /// The device reports this error.
    Error(String),
}

/// The scripted behaviour, fixed when the fake is made.
#[derive(Clone, Debug)]
pub(crate) struct Script {
    pub(crate) init: InitMode,
    pub(crate) last_error: String,
    /// Enqueue calls return this code (`ncclSuccess` normally).
    pub(crate) enqueue: ncclResult_t,
    /// After an enqueue that returned `ncclInProgress`, the async state
    /// stays `ncclInProgress` forever (a hang while enqueuing).
    pub(crate) enqueue_hangs: bool,
    /// After a launch, the communicator's async state turns into this error.
    pub(crate) async_after_launch: Option<ncclResult_t>,
    pub(crate) stream: StreamMode,
    pub(crate) finalize: FinalizeMode,
    pub(crate) destroy: ncclResult_t,
    pub(crate) abort: ncclResult_t,
    pub(crate) group_end: ncclResult_t,
    /// `identity` reports this world size instead of the real one.
    pub(crate) identity_world: Option<i32>,
}

impl Default for Script {
    fn default() -> Self {
        Script {
            init: InitMode::Join,
            last_error: "fake: no error".into(),
            enqueue: ncclResult_t::ncclSuccess,
            enqueue_hangs: false,
            async_after_launch: None,
            stream: StreamMode::Match,
            finalize: FinalizeMode::Ok,
            destroy: ncclResult_t::ncclSuccess,
            abort: ncclResult_t::ncclSuccess,
            group_end: ncclResult_t::ncclSuccess,
            identity_world: None,
        }
    }
}
