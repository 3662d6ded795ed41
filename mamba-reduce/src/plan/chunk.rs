//! The chunk model: how long the default chunks of a plan are.
//!
//! Chunks change speed and scratch memory, never bits.

/// Sustained NCCL point-to-point bandwidth the default chunks are sized
/// for: one direction of an NVLink pair of H200s (~360 GB/s measured).
pub const LINK_BYTES_PER_SEC: f64 = 360e9;
/// Cost of one point-to-point group in the chunk model: 100 us, the host
/// time measured to enqueue each group on 2x H200 (docs/PERFORMANCE.md,
/// "Every group costs ~100 us of host time": 70-120 us per group at 4 MiB
/// for 2, 4 and 8 chunks; the communicator is nonblocking and NCCL runs
/// every group from a thread of its own). It used to be 10 us, a guess at
/// the device-side cost, which the host cost dwarfs.
pub const GROUP_OVERHEAD_SEC: f64 = 100e-6;
/// Chunk lengths are rounded up to a multiple of this many elements (4 KiB),
/// so chunk and (for even `P`) shard boundaries keep 16-byte alignment.
pub(super) const CHUNK_ALIGN: usize = 1024;
/// Most chunks a default pipeline plan uses.
const MAX_PIPELINE_CHUNKS: usize = 64;

/// The default chunk length for `len`-element arenas reduced by `world`
/// processes over `logical_world` logical ranks (counts in the crate
/// docs):
/// - sharded (`P = L`): the whole arena, at every size. Chunking is meant
///   to hide each chunk's fold behind the next chunk's transfer, but on
///   2x H200 it never won (docs/PERFORMANCE.md, 2026-11-30: at 1 GiB one
///   chunk took 1.06x NCCL's all-reduce, two 1.13-1.19x, at any fold
///   grid): every extra group costs the host ~70-120 us (the communicator
///   is nonblocking, so NCCL launches each group from a thread of its
///   own), more than the fold it hides (~0.1 ms per 512 MiB). Chunked
///   plans stay available through an explicit chunk length;
/// - pipeline (`L > P`, `P >= 2`): `C = sqrt(F T / o)` chunks, which
///   minimises `T (C + F) / C + (C + F) o` — the link time `T` of the
///   arena at [`LINK_BYTES_PER_SEC`] stretched by the `F = 3P - 3`
///   steps of filling and draining, plus [`GROUP_OVERHEAD_SEC`] per
///   step. For two H200s: 1 GiB gives 9 chunks of ~114 MiB, 256 MiB 5,
///   64 MiB 2, 16 MiB and less 1 (with the former 10 us: 30, 15, 8, 4);
/// - one process (`P = 1`): the whole arena.
///
/// Rounded up to a multiple of 1024 elements; never changes bits.
pub(super) fn default_chunk(len: usize, world: usize, logical_world: usize) -> usize {
    let bytes = 4 * len;
    // One process, or the sharded dataflow (P = L): the whole arena.
    let chunks = if world <= 1 || logical_world == world {
        1
    } else {
        let fill = (3 * world - 3) as f64;
        let link = bytes as f64 / LINK_BYTES_PER_SEC;
        let c = (fill * link / GROUP_OVERHEAD_SEC).sqrt().round();
        (c as usize).clamp(1, MAX_PIPELINE_CHUNKS)
    };
    len.div_ceil(chunks).next_multiple_of(CHUNK_ALIGN).max(1)
}
