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
//! buffer's end is a [`CommError::Config`].

use std::ops::Range;

use crate::{CommError, Result};

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
    ///
    /// `buffers` are lent to the group for the whole call; `body` names them
    /// by index ([`Group::send`], [`Group::recv`]). This is what makes a
    /// group sound on NCCL, which reads and writes the memory only when the
    /// group closes: a buffer created or dropped inside `body` cannot be
    /// handed to the group (the body has no way to name it), and a lent
    /// buffer cannot be dropped or moved before `group` returns (it is
    /// borrowed). The body cannot allocate, upload or download either: a
    /// [`Group`] offers only sends and receives.
    fn group<R>(
        &mut self,
        buffers: &mut [&mut Self::Buffer],
        body: impl FnOnce(&mut Group<'_, '_, Self>) -> Result<R>,
    ) -> Result<R>
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

/// The body's view of one [`Transport::group`]: the point-to-point
/// operations of the group, over the buffers lent to it.
///
/// Invariant: every buffer an operation names was lent to the group call
/// (or to the NCCL window the group runs in) and stays borrowed until that
/// call returns, so NCCL's deferred reads and writes always hit live memory.
/// The transport itself is not reachable through a `Group`, so nothing else
/// (allocation, host copies, nested groups, collectives) can run inside it.
///
/// Correct use (a ring exchange over the host transport):
///
/// ```
/// use std::time::Duration;
/// use mamba_comm::host::{HostOptions, HostTransport};
/// use mamba_comm::Transport;
///
/// let world = HostTransport::thread_world(2, HostOptions::with_timeout(Duration::from_secs(10)))?;
/// let handles: Vec<_> = world
///     .into_iter()
///     .map(|mut t| {
///         std::thread::spawn(move || {
///             let peer = 1 - t.rank();
///             let mut out = vec![t.rank() as f32; 4];
///             let mut inb = vec![0.0f32; 4];
///             t.group(&mut [&mut out, &mut inb], |g| {
///                 g.send(0, 0..4, peer)?;
///                 g.recv(1, 0..4, peer)
///             })?;
///             Ok::<_, mamba_comm::CommError>(inb)
///         })
///     })
///     .collect();
/// for (rank, h) in handles.into_iter().enumerate() {
///     assert_eq!(h.join().unwrap()?, vec![(1 - rank) as f32; 4]);
/// }
/// # Ok::<(), mamba_comm::CommError>(())
/// ```
///
/// The use-after-free this prevents does not compile: a lent buffer cannot
/// be dropped (or moved into the body) while the group runs,
///
/// ```compile_fail,E0505
/// use mamba_comm::Transport;
/// fn misuse<T: Transport>(t: &mut T) -> mamba_comm::Result<()> {
///     let mut b = t.alloc(4)?;
///     t.group(&mut [&mut b], |g| {
///         g.send(0, 0..4, 1)?;
///         drop(b); // freed before the group's kernel runs
///         Ok(())
///     })
/// }
/// ```
///
/// and a buffer made inside the body cannot be sent at all (operations
/// take the index of a lent buffer, and the body cannot reach the
/// transport to allocate):
///
/// ```compile_fail,E0499
/// use mamba_comm::Transport;
/// fn misuse<T: Transport>(t: &mut T) -> mamba_comm::Result<()> {
///     t.group(&mut [], |g| {
///         let fresh = t.alloc(4)?;
///         g.send(0, 0..4, 1)
///     })
/// }
/// ```
pub struct Group<'g, 'b, T: Transport> {
    transport: &'g mut T,
    buffers: &'g mut [&'b mut T::Buffer],
}

impl<T: Transport> std::fmt::Debug for Group<'_, '_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.transport.rank())
            .field("buffers", &self.buffers.len())
            .finish()
    }
}

impl<'g, 'b, T: Transport> Group<'g, 'b, T> {
    /// The handle an implementation of [`Transport::group`] gives its body,
    /// after opening the group on `transport`. Building one outside a group
    /// is harmless: its operations then run one by one, each complete when
    /// it returns.
    pub fn new(transport: &'g mut T, buffers: &'g mut [&'b mut T::Buffer]) -> Self {
        Group { transport, buffers }
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.transport.rank()
    }

    /// Number of ranks.
    pub fn world(&self) -> usize {
        self.transport.world()
    }

    /// Number of buffers lent to the group.
    pub fn buffers(&self) -> usize {
        self.buffers.len()
    }

    /// Number of elements of lent buffer `buf`.
    pub fn buffer_len(&self, buf: usize) -> Result<usize> {
        Ok(T::buffer_len(self.lent(buf)?))
    }

    /// Send `range` of lent buffer `buf` to `peer` (see
    /// [`Transport::send`]).
    pub fn send(&mut self, buf: usize, range: Range<usize>, peer: usize) -> Result<()> {
        let n = self.buffers.len();
        let b = self.buffers.get(buf).ok_or_else(|| not_lent(buf, n))?;
        self.transport.send(b, range, peer)
    }

    /// Receive `range.len()` elements from `peer` into `range` of lent
    /// buffer `buf` (see [`Transport::recv`]).
    pub fn recv(&mut self, buf: usize, range: Range<usize>, peer: usize) -> Result<()> {
        let n = self.buffers.len();
        let b = self.buffers.get_mut(buf).ok_or_else(|| not_lent(buf, n))?;
        self.transport.recv(b, range, peer)
    }

    fn lent(&self, buf: usize) -> Result<&T::Buffer> {
        self.buffers
            .get(buf)
            .map(|b| &**b)
            .ok_or_else(|| not_lent(buf, self.buffers.len()))
    }
}

fn not_lent(buf: usize, lent: usize) -> CommError {
    CommError::config(format!(
        "group operation names buffer {buf}, but {lent} buffer(s) were lent to the group \
         (pass every buffer the group uses to `group`, and name it by its index)"
    ))
}
