//! How the ranks of one launch meet: a small key/value exchange with
//! deadlines, over a private per-job directory or over TCP.
//!
//! The NCCL communicator uses it for exactly one thing: rank 0 publishes the
//! 128-byte unique id and every other rank fetches it. The host transport
//! uses it to exchange listening addresses.

use std::path::Path;
use std::time::Duration;

use crate::Result;

mod barrier;
mod dir;
pub mod file;
mod memory;
mod open;
mod store;
pub mod tcp;

pub use file::FileRendezvous;
pub use memory::MemoryRendezvous;
pub use open::open;
pub use store::{bind_address, LaunchSecret};
pub use tcp::TcpRendezvous;

/// A rendezvous for the ranks of one launch.
///
/// Invariant: values published by an earlier launch that reused the same job
/// id are never returned by [`Rendezvous::fetch`] (implementations scope keys
/// to a per-launch identity).
pub trait Rendezvous: Send + Sync {
    /// This rank.
    fn rank(&self) -> usize;
    /// Number of ranks that meet here.
    fn world(&self) -> usize;
    /// Publish `value` under `key`, atomically: a reader sees all of it or
    /// nothing.
    fn publish(&self, key: &str, value: &[u8]) -> Result<()>;
    /// Wait until `key` holds exactly `len` bytes and return them, or fail
    /// with [`CommError::Rendezvous`](crate::CommError::Rendezvous) naming
    /// this rank, the location and the timeout.
    fn fetch(&self, key: &str, len: usize, timeout: Duration) -> Result<Vec<u8>>;
    /// What `key` holds now, whatever its length, without waiting: `None`
    /// when nothing was published under it. This is how the
    /// [world abort](crate::world_abort) is watched; an error means the
    /// rendezvous itself is unreachable (its files or rank 0's store gone).
    fn peek(&self, key: &str) -> Result<Option<Vec<u8>>>;
    /// Return once all `world()` ranks have reached the barrier `name`.
    fn barrier(&self, name: &str, timeout: Duration) -> Result<()>;
    /// The directory this launch's ranks and its supervisor share, if
    /// there is one (a file rendezvous's launch directory): where the
    /// [flight recorder](crate::flight) keeps its ring. `None` by default.
    fn shared_dir(&self) -> Option<&Path> {
        None
    }
}
