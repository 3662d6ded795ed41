//! Device memory shared between the processes of one node: what a reducer
//! needs to read its peers' gradient arenas directly (over NVLink, or on
//! the same GPU) instead of through NCCL's transfers.
//!
//! CUDA's legacy IPC (`cuIpcGetMemHandle`) cannot share memory of the
//! stream-ordered allocator, which is where every cudarc allocation comes
//! from. So sharing goes through a memory pool created with POSIX file
//! descriptor handles:
//!
//! - [`SharedPool::install`] creates that pool on a device and makes it the
//!   device's current pool, so that every later `cuMemAllocAsync` of the
//!   process on that device (every `CudaSlice` cudarc makes) is exportable.
//!   Once per device per process; the pool then stays for the process's
//!   life (destroying it under live allocations would gain nothing).
//! - The pool travels to the peers as a file descriptor
//!   ([`SharedPool::export_fd`], then [`FdListener`] / [`fetch_fd`] over
//!   Linux abstract Unix sockets, each connection checked against the pid
//!   the peer announced), and each allocation as 64 bytes of export data
//!   ([`SharedPool::export_pointer`]) that any channel can carry.
//! - A peer imports the pool ([`ImportedPool::import`]) and then pointers
//!   ([`ImportedPool::import_pointer`]): an [`ImportedPointer`] addresses
//!   the exporter's memory from the importer's context until it drops.
//!
//! The driver keeps shared memory alive while any process still maps it:
//! an exporter that dies leaves its importers' mappings valid (a peer's
//! death is then seen as a missed deadline, never as a fault).
//!
//! All of this works only between processes of one boot of one machine
//! that share a network and a pid namespace: [`NodeIdentity`] says which a
//! process runs in, and [`one_node`] checks a world's before anything is
//! exchanged.
//!
//! Ownership and order: an [`ImportedPointer`] holds its pool, so pointers
//! are freed before the pool is destroyed; the exporter must not free an
//! allocation while peers still use it (the reducer's barriers ensure no
//! peer touches it outside a reduction, and its arenas live as long as the
//! reducer's registration).

mod fd_pass;
mod node;
mod pool;

pub use fd_pass::{fetch_fd, FdListener};
pub use node::{one_node, NodeIdentity};
pub use pool::{ExportedPointer, ImportedPointer, ImportedPool, SharedPool};
