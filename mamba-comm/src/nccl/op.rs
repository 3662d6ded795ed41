//! The operations [`super::NcclComm`] hands to NCCL, typed so that the
//! element count and data type always come from the device view itself.

use std::ffi::{c_int, c_void};

use cudarc::driver::{CudaView, CudaViewMut, DeviceRepr};
use nccl_sys_min::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclResult_t};

use super::api::NcclApi;

/// An element type NCCL moves, and its NCCL data type.
pub(crate) trait NcclElement: DeviceRepr {
    const DTYPE: ncclDataType_t;
}

impl NcclElement for f32 {
    const DTYPE: ncclDataType_t = ncclDataType_t::ncclFloat32;
}

impl NcclElement for i32 {
    const DTYPE: ncclDataType_t = ncclDataType_t::ncclInt32;
}

/// One NCCL operation on a device view: sends only read their view, the
/// others write theirs in place. Peers and roots were checked to be ranks
/// of the world, which fits a C int (checked at init).
pub(crate) enum Op<'b, T> {
    Send {
        src: CudaView<'b, T>,
        peer: usize,
    },
    Recv {
        dst: CudaViewMut<'b, T>,
        peer: usize,
    },
    Broadcast {
        buf: CudaViewMut<'b, T>,
        root: usize,
    },
    AllReduce {
        buf: CudaViewMut<'b, T>,
        reduce: ncclRedOp_t,
    },
}

/// What NCCL is asked to do, without the view.
#[derive(Clone, Copy)]
pub(crate) enum Kind {
    Send(c_int),
    Recv(c_int),
    Broadcast(c_int),
    AllReduce(ncclRedOp_t),
}

impl<T> Op<'_, T> {
    /// The element count and the call.
    pub(crate) fn shape(&self) -> (usize, Kind) {
        let rank = |r: usize| r as c_int;
        match self {
            Op::Send { src, peer } => (src.len(), Kind::Send(rank(*peer))),
            Op::Recv { dst, peer } => (dst.len(), Kind::Recv(rank(*peer))),
            Op::Broadcast { buf, root } => (buf.len(), Kind::Broadcast(rank(*root))),
            Op::AllReduce { buf, reduce } => (buf.len(), Kind::AllReduce(*reduce)),
        }
    }
}

impl Kind {
    /// Enqueue the call on `n` elements of `dtype` at `p` (in place for
    /// broadcast and all-reduce).
    ///
    /// # Safety
    /// As [`NcclApi`]'s module docs: `p` addresses `n` elements of `dtype`
    /// on the communicator's device that stay alive until the stream has
    /// completed the operation, `comm` is live and `stream` is a stream of
    /// its context.
    pub(crate) unsafe fn enqueue(
        self,
        api: &dyn NcclApi,
        p: *mut c_void,
        n: usize,
        dtype: ncclDataType_t,
        comm: ncclComm_t,
        stream: cudaStream_t,
    ) -> ncclResult_t {
        // SAFETY: the caller's contract is each call's contract.
        unsafe {
            match self {
                Kind::Send(peer) => api.send(p, n, dtype, peer, comm, stream),
                Kind::Recv(peer) => api.recv(p, n, dtype, peer, comm, stream),
                Kind::Broadcast(root) => api.broadcast(p, p, n, dtype, root, comm, stream),
                Kind::AllReduce(reduce) => api.all_reduce(p, p, n, dtype, reduce, comm, stream),
            }
        }
    }
}
