//! The library table: the NCCL calls the communicator makes, behind a small
//! trait so the deadline, watchdog and teardown logic in [`super::core`] runs
//! unchanged against the real library ([`RealNccl`]) or, in tests, against a
//! fake with scripted hangs and failures.
//!
//! The table is raw on purpose: the methods hand back NCCL's codes as NCCL
//! returns them (the fake scripts any code), and callers classify them in
//! [`super::result`]. Where a call returns a value as well, the table
//! already applies [`super::result::completed`] to the code and
//! returns `Result<value, NcclError>`.
//!
//! The unsafe boundary: every method that takes a communicator handle or a
//! device pointer is `unsafe` with NCCL's contract, stated once here:
//! - `comm` is a handle returned by [`NcclApi::init_rank_config`] that has
//!   been neither destroyed nor aborted (the communicator keeps that
//!   invariant with [`HandleSlot`](super::handle::HandleSlot), which
//!   releases the handle before a destroy or an abort);
//! - device pointers address `count` elements of the given type in memory of
//!   the communicator's device, stay alive until the stream has completed the
//!   operation, and `stream` is a stream of the communicator's context.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use nccl_sys_min::{
    cudaStream_t, ncclComm_t, ncclConfig_t, ncclDataType_t, ncclRedOp_t, ncclResult_t,
    ncclUniqueId, Nccl,
};

use super::result::{completed, NcclError};

/// The NCCL entry points the communicator uses.
pub(crate) trait NcclApi: Send + Sync {
    /// `ncclGetUniqueId`.
    fn unique_id(&self) -> Result<[u8; 128], NcclError>;
    /// `ncclCommInitRankConfig`: the returned handle may be non-null even
    /// when the code is `ncclInProgress` (nonblocking init) or an error.
    fn init_rank_config(
        &self,
        world: c_int,
        id: &[u8; 128],
        rank: c_int,
        config: &mut ncclConfig_t,
    ) -> (ncclResult_t, ncclComm_t);
    /// `ncclGetErrorString`.
    fn error_string(&self, code: ncclResult_t) -> String;
    /// `ncclSystemError (unhandled system error)`: the code's name and
    /// NCCL's text for it, as error messages show a failed call.
    fn describe(&self, e: NcclError) -> String {
        format!("{} ({})", e.name(), self.error_string(e.0))
    }
    /// `ncclGroupStart` (thread-local group state in NCCL).
    fn group_start(&self) -> ncclResult_t;
    /// `ncclGroupEnd`.
    fn group_end(&self) -> ncclResult_t;

    /// `ncclCommGetAsyncError`: `Ok(state)` where `state` is `ncclSuccess`,
    /// `ncclInProgress` or the error the communicator hit; `Err` when the
    /// query itself failed.
    ///
    /// # Safety
    /// See the module docs (`comm` live).
    unsafe fn async_error(&self, comm: ncclComm_t) -> Result<ncclResult_t, NcclError>;
    /// `ncclGetLastError` (call before the handle is released).
    ///
    /// # Safety
    /// `comm` null or live.
    unsafe fn last_error(&self, comm: ncclComm_t) -> String;
    /// `ncclCommFinalize`.
    ///
    /// # Safety
    /// `comm` live.
    unsafe fn finalize(&self, comm: ncclComm_t) -> ncclResult_t;
    /// `ncclCommDestroy`: afterwards `comm` is gone whatever the code says.
    ///
    /// # Safety
    /// `comm` live.
    unsafe fn destroy(&self, comm: ncclComm_t) -> ncclResult_t;
    /// `ncclCommAbort`: afterwards `comm` is gone whatever the code says.
    ///
    /// # Safety
    /// `comm` live.
    unsafe fn abort(&self, comm: ncclComm_t) -> ncclResult_t;
    /// `ncclCommCount`, `ncclCommUserRank`, `ncclCommCuDevice`, in that
    /// order.
    ///
    /// # Safety
    /// `comm` live and initialised.
    unsafe fn identity(&self, comm: ncclComm_t) -> Result<(c_int, c_int, c_int), NcclError>;

    /// `ncclAllReduce`.
    ///
    /// # Safety
    /// See the module docs.
    #[allow(clippy::too_many_arguments)]
    unsafe fn all_reduce(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t;
    /// `ncclBroadcast`.
    ///
    /// # Safety
    /// See the module docs.
    #[allow(clippy::too_many_arguments)]
    unsafe fn broadcast(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t;
    /// `ncclSend`.
    ///
    /// # Safety
    /// See the module docs.
    unsafe fn send(
        &self,
        buf: *const c_void,
        count: usize,
        dtype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t;
    /// `ncclRecv`.
    ///
    /// # Safety
    /// See the module docs.
    unsafe fn recv(
        &self,
        buf: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t;
}

/// The real library, opened once per process (see [`super::library`]).
pub(crate) struct RealNccl {
    pub(crate) lib: Arc<Nccl>,
}

impl NcclApi for RealNccl {
    fn unique_id(&self) -> Result<[u8; 128], NcclError> {
        self.lib
            .unique_id()
            .map(|id| id.to_bytes())
            .map_err(NcclError)
    }

    fn init_rank_config(
        &self,
        world: c_int,
        id: &[u8; 128],
        rank: c_int,
        config: &mut ncclConfig_t,
    ) -> (ncclResult_t, ncclComm_t) {
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are ours; the id is passed by value.
        let rc = unsafe {
            self.lib.api().ncclCommInitRankConfig(
                &mut comm,
                world,
                ncclUniqueId::from_bytes(id),
                rank,
                config,
            )
        };
        (rc, comm)
    }

    fn error_string(&self, code: ncclResult_t) -> String {
        self.lib.error_string(code)
    }

    fn group_start(&self) -> ncclResult_t {
        // SAFETY: no arguments; group state is thread-local in NCCL.
        unsafe { self.lib.api().ncclGroupStart() }
    }

    fn group_end(&self) -> ncclResult_t {
        // SAFETY: as for group_start.
        unsafe { self.lib.api().ncclGroupEnd() }
    }

    unsafe fn async_error(&self, comm: ncclComm_t) -> Result<ncclResult_t, NcclError> {
        let mut state = ncclResult_t::ncclSuccess;
        completed(self.lib.api().ncclCommGetAsyncError(comm, &mut state))?;
        Ok(state)
    }

    unsafe fn last_error(&self, comm: ncclComm_t) -> String {
        self.lib.last_error(comm)
    }

    unsafe fn finalize(&self, comm: ncclComm_t) -> ncclResult_t {
        self.lib.api().ncclCommFinalize(comm)
    }

    unsafe fn destroy(&self, comm: ncclComm_t) -> ncclResult_t {
        self.lib.api().ncclCommDestroy(comm)
    }

    unsafe fn abort(&self, comm: ncclComm_t) -> ncclResult_t {
        self.lib.api().ncclCommAbort(comm)
    }

    unsafe fn identity(&self, comm: ncclComm_t) -> Result<(c_int, c_int, c_int), NcclError> {
        let api = self.lib.api();
        let (mut count, mut rank, mut device) = (0, 0, 0);
        completed(api.ncclCommCount(comm, &mut count))?;
        completed(api.ncclCommUserRank(comm, &mut rank))?;
        completed(api.ncclCommCuDevice(comm, &mut device))?;
        Ok((count, rank, device))
    }

    unsafe fn all_reduce(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        op: ncclRedOp_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t {
        self.lib
            .api()
            .ncclAllReduce(send, recv, count, dtype, op, comm, stream)
    }

    unsafe fn broadcast(
        &self,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        root: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t {
        self.lib
            .api()
            .ncclBroadcast(send, recv, count, dtype, root, comm, stream)
    }

    unsafe fn send(
        &self,
        buf: *const c_void,
        count: usize,
        dtype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t {
        self.lib
            .api()
            .ncclSend(buf, count, dtype, peer, comm, stream)
    }

    unsafe fn recv(
        &self,
        buf: *mut c_void,
        count: usize,
        dtype: ncclDataType_t,
        peer: c_int,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t {
        self.lib
            .api()
            .ncclRecv(buf, count, dtype, peer, comm, stream)
    }
}
