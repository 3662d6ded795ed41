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
/// Streams: everything the reducer does runs on [`NcclComm::stream`], and
/// every operation takes buffers through cudarc's event tracking, so
/// gradients written on another stream of the same context are waited
/// for. `reduce_mean` returns when the mean is complete on the device.
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
