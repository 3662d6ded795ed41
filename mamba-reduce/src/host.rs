//! The reducer over host memory: CPU worlds of threads or processes.

use mamba_comm::host::HostTransport;
use mamba_comm::Transport;

use crate::fold::HostFold;
use crate::transport_reducer::{ReducerOptions, TransportReducer};

/// The reducer of CPU worlds: [`HostTransport`] moves the bytes (threads
/// linked by channels, or processes over loopback TCP), [`HostFold`] adds.
/// Both contracts; under `FixedOrder` its bits equal the
/// [`EmulatedWorld`](crate::EmulatedWorld)'s and the NCCL reducer's.
pub type HostReducer = TransportReducer<HostTransport, HostFold>;

impl<T: Transport<Buffer = Vec<f32>>> TransportReducer<T, HostFold> {
    /// A reducer over a host-memory transport.
    pub fn new(transport: T, opts: ReducerOptions) -> Self {
        TransportReducer::with_fold(transport, HostFold, opts)
    }
}
