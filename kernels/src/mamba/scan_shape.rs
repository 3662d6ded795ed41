//! The selective scan's extents ([`ScanShape`]) and the launch geometry
//! both scan directions derive from them: chunks, lanes per channel,
//! channels per block and the backward's channel groups.

use cudarc::driver::LaunchConfig;

use super::check::{self, grid};
use crate::error::KernelError;

/// Time steps per chunk (`kChunk` in the `.cu` file).
pub const SCAN_CHUNK: usize = 16;
/// Threads per block of the per-chunk kernels (`kThreads`).
pub(super) const BLOCK: usize = 128;
/// Largest state size: one channel's lanes must fit a block.
pub const MAX_D_STATE: usize = BLOCK;
/// Threads per block of the serial-combine and reduction kernels.
pub(super) const FLAT: u32 = 256;

/// The extents of one scan.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScanShape {
    /// Sequences.
    pub batch: usize,
    /// Time steps per sequence.
    pub seq_len: usize,
    /// Channels (`d_inner`).
    pub d_inner: usize,
    /// State size `N` (`d_state`), 1..=[`MAX_D_STATE`].
    pub d_state: usize,
}

impl ScanShape {
    /// Rows of the activations: `batch * seq_len`.
    pub fn rows(&self) -> usize {
        self.batch * self.seq_len
    }
    /// Chunks per sequence: `ceil(seq_len / SCAN_CHUNK)`.
    pub fn chunks(&self) -> usize {
        self.seq_len.div_ceil(SCAN_CHUNK)
    }
    /// Elements of one chunk-state array (`[batch][chunks][d_inner][d_state]`):
    /// the length of `hin` and of each scan scratch buffer.
    pub fn state_len(&self) -> usize {
        self.batch * self.chunks() * self.d_inner * self.d_state
    }
    /// Lanes per channel: `d_state` rounded up to a power of two.
    pub fn lanes(&self) -> usize {
        self.d_state.next_power_of_two()
    }
    /// Channels one block covers: `128 / lanes`.
    pub fn channels_per_block(&self) -> usize {
        BLOCK / self.lanes()
    }
    /// Channel sets one backward block walks in turn (so that its d B / d C
    /// partial covers more channels): a function of the shape only, so the
    /// summation order never depends on the device.
    pub fn rounds(&self) -> usize {
        let sets = self.d_inner.div_ceil(self.channels_per_block());
        (sets / 16).clamp(1, 8)
    }
    /// Channel groups of the backward pass (its grid's x extent, and the
    /// number of d B / d C partials summed per element).
    pub fn groups(&self) -> usize {
        self.d_inner
            .div_ceil(self.channels_per_block())
            .div_ceil(self.rounds())
    }
    /// Length of the d B / d C partial buffer of [`MambaKernels::scan_backward`](super::MambaKernels::scan_backward).
    pub fn dbc_partial_len(&self) -> usize {
        self.groups() * self.rows() * 2 * self.d_state
    }

    pub(super) fn validate(&self, kernel: &'static str) -> Result<(), KernelError> {
        if self.d_state == 0 || self.d_state > MAX_D_STATE {
            return Err(KernelError::invalid(
                kernel,
                format!(
                    "d_state {}; the scan handles 1..={MAX_D_STATE}",
                    self.d_state
                ),
            ));
        }
        if self.batch > check::MAX_GRID_YZ || self.chunks() > check::MAX_GRID_YZ {
            return Err(KernelError::invalid(
                kernel,
                format!(
                    "batch {} and {} chunks of {SCAN_CHUNK} steps: each must be at most {}",
                    self.batch,
                    self.chunks(),
                    check::MAX_GRID_YZ
                ),
            ));
        }
        check::int(kernel, "seq_len", self.seq_len)?;
        check::int(kernel, "d_inner", self.d_inner)?;
        check::long(kernel, "state elements", self.state_len())?;
        Ok(())
    }

    /// The grids and kernel integers both scan directions launch with.
    /// Call only after [`Self::validate`] (which bounds `seq_len`, `d_inner`
    /// and the state count, so the casts below cannot truncate) and on a
    /// non-empty shape (else a grid extent is 0 and this refuses).
    pub(super) fn launch(&self, kernel: &'static str) -> Result<ScanLaunch, KernelError> {
        let (d, n) = (self.d_inner, self.d_state);
        let chunk_grid = grid(
            kernel,
            (
                d.div_ceil(self.channels_per_block()),
                self.chunks(),
                self.batch,
            ),
            BLOCK as u32,
        )?;
        let flat_grid = grid(
            kernel,
            ((self.batch * d * n).div_ceil(FLAT as usize), 1, 1),
            FLAT,
        )?;
        Ok(ScanLaunch {
            chunk_grid,
            flat_grid,
            t: self.seq_len as i32,
            di: d as i32,
            ni: n as i32,
            np: self.lanes() as i32,
            bi: self.batch as i32,
            nch: self.chunks() as i32,
            dn: (d * n) as i64,
        })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.batch == 0 || self.seq_len == 0 || self.d_inner == 0
    }
}

/// What [`ScanShape::launch`] computes for both scan directions.
pub(super) struct ScanLaunch {
    /// One block per (channel set, chunk, sequence): the per-chunk kernels.
    pub(super) chunk_grid: LaunchConfig,
    /// One thread per `(sequence, channel, state)`: the serial combines.
    pub(super) flat_grid: LaunchConfig,
    /// `seq_len`, `d_inner`, `d_state` and lanes per channel (`T, D, N, np`).
    pub(super) t: i32,
    pub(super) di: i32,
    pub(super) ni: i32,
    pub(super) np: i32,
    /// `batch`, chunks per sequence and `d_inner * d_state` (`B, nch, DN`).
    pub(super) bi: i32,
    pub(super) nch: i32,
    pub(super) dn: i64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(batch: usize, seq_len: usize, d_inner: usize, d_state: usize) -> ScanShape {
        ScanShape {
            batch,
            seq_len,
            d_inner,
            d_state,
        }
    }

    #[test]
    fn chunking_covers_ragged_sequences() {
        let s = shape(2, 37, 5, 16);
        assert_eq!(s.chunks(), 3);
        assert_eq!(s.state_len(), 2 * 3 * 5 * 16);
        assert_eq!(shape(1, 16, 1, 1).chunks(), 1);
        assert_eq!(shape(1, 17, 1, 1).chunks(), 2);
    }

    #[test]
    fn lanes_cover_the_state_and_a_block_covers_whole_channels() {
        for (n, lanes, cpb) in [
            (1, 1, 128),
            (7, 8, 16),
            (16, 16, 8),
            (33, 64, 2),
            (64, 64, 2),
            (128, 128, 1),
        ] {
            let s = shape(1, 1, 10, n);
            assert_eq!((s.lanes(), s.channels_per_block()), (lanes, cpb), "N = {n}");
        }
    }

    #[test]
    fn backward_groups_cover_every_channel_exactly_once() {
        for d in [1, 5, 64, 127, 128, 1536, 3000] {
            for n in [1, 16, 64] {
                let s = shape(1, 1, d, n);
                let covered = s.groups() * s.rounds() * s.channels_per_block();
                assert!(covered >= d, "d {d} n {n}");
                // No group lies wholly beyond the channels.
                assert!(
                    (s.groups() - 1) * s.rounds() * s.channels_per_block() < d,
                    "d {d} n {n}"
                );
                assert!((1..=8).contains(&s.rounds()));
            }
        }
        // The 130m shape: 1536 channels, N 16 -> 192 channel sets, 8 rounds, 24 groups.
        let s = shape(8, 1024, 1536, 16);
        assert_eq!((s.rounds(), s.groups()), (8, 24));
    }

    #[test]
    fn shapes_the_kernels_cannot_run_are_refused() {
        assert!(shape(1, 1, 1, 0).validate("k").is_err());
        let e = shape(1, 1, 1, 129).validate("k").unwrap_err().to_string();
        assert!(e.contains("1..=128"), "{e}");
        assert!(shape(65_536, 1, 1, 1).validate("k").is_err());
        assert!(shape(1, 16 * 65_535 + 1, 1, 1).validate("k").is_err());
        assert!(shape(1, 16 * 65_535, 1, 16).validate("k").is_ok());
    }
}
