//! The byte-movement interface shared by the NCCL communicator and the host
//! transport.
//!
//! Layers above (`mamba-reduce`) are written once against [`Transport`] and
//! run unchanged over NCCL on device memory or over host memory (threads or
//! loopback sockets). Everything here moves f32 values as opaque bits except
//! the two arithmetic collectives, which exist for the opt-in library-sum
//! tier (`all_reduce_sum_f32`) and for exact integer flags
//! (`all_reduce_max_i32`).
//!
//! Ranges are element ranges (not bytes) into the buffer; a range past the
//! buffer's end is a [`CommError::Config`](crate::CommError::Config).

use std::ops::Range;

use crate::Result;

/// A communicator over `world()` ranks that moves f32 buffers.
///
/// Invariants every implementation keeps:
/// - A send never blocks waiting for its matching receive. Inside
///   [`Transport::group`], issue the group's sends before its receives: NCCL
///   matches a group's operations as a unit in any order, but the host
///   transport runs the body eagerly (receives complete in program order), so
///   a group that receives before it sends is only portable in that order.
///   Written that way, a group of sends and receives between any set of peers
///   cannot deadlock on either transport.
/// - Every blocking wait has a deadline; a peer that stops answering is an
///   error naming the operation, never a hang.
/// - After any error the transport is unusable (it may have been aborted);
///   callers tear the world down.
pub trait Transport {
    /// f32 storage in the memory this transport moves (host `Vec<f32>` for
    /// the host transport, device memory for NCCL).
    type Buffer;

    /// This process's rank in `0..world()`.
    fn rank(&self) -> usize;
    /// Number of ranks.
    fn world(&self) -> usize;

    /// A zero-filled buffer of `len` elements.
    fn alloc(&mut self, len: usize) -> Result<Self::Buffer>;
    /// Number of elements in `buf`.
    fn buffer_len(buf: &Self::Buffer) -> usize;
    /// Copy host values into `dst[offset..offset + src.len()]`.
    fn upload(&mut self, src: &[f32], dst: &mut Self::Buffer, offset: usize) -> Result<()>;
    /// Copy `src[offset..offset + dst.len()]` into host memory.
    fn download(&mut self, src: &Self::Buffer, offset: usize, dst: &mut [f32]) -> Result<()>;

    /// Run `body` as one group: its point-to-point operations are matched as
    /// a unit and the group is complete (data delivered, deadline enforced)
    /// when this returns `Ok`. The group is closed even when `body` fails.
    fn group<R>(&mut self, body: impl FnOnce(&mut Self) -> Result<R>) -> Result<R>
    where
        Self: Sized;

    /// Send `buf[range]` to `peer`.
    fn send(&mut self, buf: &Self::Buffer, range: Range<usize>, peer: usize) -> Result<()>;
    /// Receive `range.len()` elements from `peer` into `buf[range]`.
    fn recv(&mut self, buf: &mut Self::Buffer, range: Range<usize>, peer: usize) -> Result<()>;
    /// Copy `buf[range]` of `root` into `buf[range]` of every rank.
    fn broadcast(&mut self, buf: &mut Self::Buffer, range: Range<usize>, root: usize)
        -> Result<()>;
    /// In-place sum all-reduce with the library's own (unspecified) order.
    fn all_reduce_sum_f32(&mut self, buf: &mut Self::Buffer, range: Range<usize>) -> Result<()>;
    /// In-place elementwise max of host `i32` values across ranks (exact).
    fn all_reduce_max_i32(&mut self, values: &mut [i32]) -> Result<()>;
    /// Return once every rank has entered the barrier (or fail at the
    /// deadline).
    fn barrier(&mut self) -> Result<()>;
}
