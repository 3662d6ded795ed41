//! The reducer over NCCL on device memory.

use mamba_comm::nccl::NcclComm;

use crate::device::KernelFold;
use crate::reducer::{ReducerOptions, TransportReducer};
use crate::Result;

/// The reducer of GPU worlds: [`NcclComm`] moves the bytes (send/recv
/// groups under `FixedOrder`; its f32 all-reduce under `NcclSum`),
/// [`KernelFold`] folds and scales on the communicator's stream. Both
/// contracts; under `FixedOrder` its bits equal the host reducer's and the
/// [`EmulatedWorld`](crate::EmulatedWorld)'s.
///
/// Streams: under `FixedOrder` the groups run on [`NcclComm::stream`] and
/// the folds on a second stream of the same context, all queued in one
/// [`NcclComm::window`] (see [`KernelFold`]); under `NcclSum` everything
/// runs on the communicator's stream. Buffers are taken through cudarc's
/// event tracking first, so gradients written on another stream of the
/// same context are waited for. `reduce_mean` returns when the mean is
/// complete on the device (one host wait, under the watchdog).
pub type NcclReducer = TransportReducer<NcclComm, KernelFold>;

impl TransportReducer<NcclComm, KernelFold> {
    /// A reducer over `comm`, loading the fold and scale kernels into its
    /// context (fails with the kernels crate's "how to get kernels" error
    /// in a build without nvcc).
    pub fn new(comm: NcclComm, opts: ReducerOptions) -> Result<Self> {
        let fold = KernelFold::load(comm.stream())?;
        Ok(TransportReducer::with_fold(comm, fold, opts))
    }
}
