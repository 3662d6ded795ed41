//! The reducer over NCCL on device memory.

use mamba_comm::nccl::NcclComm;

use crate::device::DeviceFold;
use crate::transport_reducer::{ReducerOptions, TransportReducer};
use crate::Result;

/// The reducer of GPU worlds: [`NcclComm`] moves the bytes (send/recv
/// groups under `FixedOrder`; its f32 all-reduce under `NcclSum`),
/// [`DeviceFold`] folds and scales. Both contracts; under `FixedOrder` its
/// bits equal the host reducer's and the
/// [`EmulatedWorld`](crate::EmulatedWorld)'s.
///
/// Streams (the fold is loaded on [`NcclComm::stream`]):
/// - `FixedOrder`, default ([`DeviceFold::set_overlap`]`(true)`): the
///   groups run on the communicator's stream and the folds on a second
///   stream of the same context, ordered by events, all queued in one
///   [`NcclComm::window`];
/// - `FixedOrder` with `set_overlap(false)`: groups and folds step by step,
///   all on the communicator's stream;
/// - `NcclSum`: the block folds, the all-reduce and the scale, all on the
///   communicator's stream.
///
/// Buffers are taken through cudarc's event tracking first, so gradients
/// written on another stream of the same context are waited for.
/// `reduce_mean` returns when the mean is complete on the device (one host
/// wait, under the watchdog).
pub type NcclReducer = TransportReducer<NcclComm, DeviceFold>;

impl TransportReducer<NcclComm, DeviceFold> {
    /// A reducer over `comm`, loading the fold and scale kernels into its
    /// context (fails with the kernels crate's "how to get kernels" error
    /// in a build without nvcc).
    pub fn new(comm: NcclComm, opts: ReducerOptions) -> Result<Self> {
        let fold = DeviceFold::load(comm.stream())?;
        Ok(TransportReducer::with_fold(comm, fold, opts))
    }
}
