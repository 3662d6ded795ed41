//! The selective scan's extents ([`ScanShape`]) and the launch geometry
//! both scan directions derive from them: chunks, time segments, lanes per
//! channel, channels per block and the backward's channel groups.

use cudarc::driver::LaunchConfig;

use super::check::{self, grid};
use crate::error::KernelError;

/// Time steps per chunk (`kChunk` in the `.cu` file): the forward pass keeps
/// the state every chunk enters with, the backward pass recomputes one chunk
/// at a time from it.
pub const SCAN_CHUNK: usize = 16;
/// Chunks per time segment: a sequence of more chunks is walked as several
/// segments in parallel (see the `.cu` file), so one segment is up to 1024
/// steps and shorter sequences keep the unsegmented walk. A constant, so
/// the scan's association depends on the sequence length alone.
pub const SEGMENT_CHUNKS: usize = 64;
/// Threads per block of both scan kernels (`kScanThreads`).
pub(super) const BLOCK: usize = 128;
/// States one thread holds in registers (`kLaneStates`).
pub(super) const LANE_STATES: usize = 4;
/// Largest state size: at most 32 lanes per channel, one warp's butterfly.
pub const MAX_D_STATE: usize = 32 * LANE_STATES;
/// Per-channel columns staged per chunk (`kCols`: dt, u and z or dy).
const STAGED_COLS: usize = 3;
/// The backward's d B / d C stage: steps per cross-channel sum (`kStage`).
pub(super) const RED_STEPS: usize = 4;
/// Threads per block of the d B / d C group reduction.
pub(super) const FLAT: u32 = 256;
/// Most channel groups the backward pass writes d B / d C partials for (the
/// partial buffer is `groups * rows * 2 * d_state` floats).
const MAX_GROUPS: usize = 64;

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
    /// Elements of the chunk entry states (`[batch][chunks][d_inner][d_state]`):
    /// the length of `hin`.
    pub fn state_len(&self) -> usize {
        self.batch * self.chunks() * self.d_inner * self.d_state
    }
    /// Time segments per sequence: `ceil(chunks / SEGMENT_CHUNKS)` (1 for
    /// sequences of at most `16 * SEGMENT_CHUNKS` steps).
    pub fn segments(&self) -> usize {
        self.chunks().div_ceil(SEGMENT_CHUNKS).max(1)
    }
    /// Elements of the backward pass's d A partials
    /// (`[batch][segments][d_inner][d_state]`).
    pub fn da_partial_len(&self) -> usize {
        self.batch * self.segments() * self.d_inner * self.d_state
    }
    /// Elements of the per-segment scratch both directions use when there
    /// are several segments (`2 x [batch][segments][d_inner][d_state]`: the
    /// first pass's end states or carries, and decay products); 0 for one.
    pub fn segment_scratch_len(&self) -> usize {
        match self.segments() {
            1 => 0,
            n => 2 * self.batch * n * self.d_inner * self.d_state,
        }
    }
    /// Lanes per channel: `ceil(d_state / 4)` rounded up to a power of two
    /// (each lane holds 4 consecutive states).
    pub fn lanes(&self) -> usize {
        self.d_state.div_ceil(LANE_STATES).next_power_of_two()
    }
    /// Channels one block covers: `128 / lanes`.
    pub fn channels_per_block(&self) -> usize {
        BLOCK / self.lanes()
    }
    /// Channel sets one backward block walks in turn, so that at most 64
    /// groups of d B / d C partials are written: a function of `d_inner` and
    /// `d_state` only, so the summation order never depends on the device
    /// or the batch.
    pub fn rounds(&self) -> usize {
        let sets = self.d_inner.div_ceil(self.channels_per_block());
        sets.div_ceil(MAX_GROUPS).max(1)
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

    /// Floats of one chunk staging buffer (`Lanes::stage` in the `.cu`
    /// file): the chunk's B|C rows, each padded to `lanes * 4` states, and
    /// the block's staged columns.
    fn stage_floats(&self) -> usize {
        let padded = self.lanes() * LANE_STATES;
        SCAN_CHUNK * (2 * padded + STAGED_COLS * self.channels_per_block())
    }
    /// Floats of `values` per-channel results per step of one chunk
    /// (`Lanes::fin` in the `.cu` file).
    fn fin_floats(&self, values: usize) -> usize {
        SCAN_CHUNK * values * self.channels_per_block()
    }
    /// Dynamic shared memory of the forward kernel: two chunk staging
    /// buffers, then the chunk's `y` sums (one per step and channel).
    pub(super) fn fwd_smem_bytes(&self) -> usize {
        (2 * self.stage_floats() + self.fin_floats(1)) * 4
    }
    /// Row stride of the backward's d B / d C stage (`Lanes::red_row` in the
    /// `.cu` file): a column per thread, padded by `min(lanes, 8)` floats so
    /// the channel sums read 32 distinct banks.
    pub(super) fn red_row(&self) -> usize {
        BLOCK + self.lanes().min(8)
    }
    /// Dynamic shared memory of the backward kernel: the chunk's recomputed
    /// states, the d B / d C stage, the two staging buffers, then the
    /// chunk's d dt and d u sums.
    pub(super) fn bwd_smem_bytes(&self) -> usize {
        let states = SCAN_CHUNK * LANE_STATES * BLOCK;
        let red = RED_STEPS * 2 * LANE_STATES * self.red_row();
        (states + red + 2 * self.stage_floats() + self.fin_floats(2)) * 4
    }
    /// The most dynamic shared memory any valid state size needs, per
    /// direction (forward, backward): what the kernels are allowed at load.
    pub(super) fn max_smem_bytes() -> (usize, usize) {
        (1..=MAX_D_STATE)
            .map(|n| {
                let s = ScanShape {
                    batch: 1,
                    seq_len: 1,
                    d_inner: 1,
                    d_state: n,
                };
                (s.fwd_smem_bytes(), s.bwd_smem_bytes())
            })
            .fold((0, 0), |(f, b), (f2, b2)| (f.max(f2), b.max(b2)))
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
        if self.batch > check::MAX_GRID_YZ {
            return Err(KernelError::invalid(
                kernel,
                format!(
                    "batch {}: at most {} sequences per launch",
                    self.batch,
                    check::MAX_GRID_YZ
                ),
            ));
        }
        check::int(kernel, "seq_len", self.seq_len)?;
        check::int(kernel, "d_inner", self.d_inner)?;
        check::long(kernel, "state elements", self.state_len())?;
        check::long(kernel, "rows", self.rows())?;
        Ok(())
    }

    /// The grids and kernel integers both scan directions launch with.
    /// Call only after [`Self::validate`] (which bounds `seq_len`, `d_inner`
    /// and the state count, so the casts below cannot truncate) and on a
    /// non-empty shape (else a grid extent is 0 and this refuses).
    pub(super) fn launch(&self, kernel: &'static str) -> Result<ScanLaunch, KernelError> {
        let d = self.d_inner;
        let (sets, segs) = (d.div_ceil(self.channels_per_block()), self.segments());
        let mut fwd_grid = grid(kernel, (sets, self.batch, segs), BLOCK as u32)?;
        fwd_grid.shared_mem_bytes = self.fwd_smem_bytes() as u32;
        let mut bwd_grid = grid(kernel, (self.groups(), self.batch, segs), BLOCK as u32)?;
        bwd_grid.shared_mem_bytes = self.bwd_smem_bytes() as u32;
        // The first passes of a segmented scan: every segment but one.
        let seg_grid = if segs > 1 {
            let mut g = grid(kernel, (sets, self.batch, segs - 1), BLOCK as u32)?;
            g.shared_mem_bytes = self.fwd_smem_bytes() as u32;
            Some(g)
        } else {
            None
        };
        Ok(ScanLaunch {
            fwd_grid,
            bwd_grid,
            seg_grid,
            seg: SEGMENT_CHUNKS as i32,
            t: self.seq_len as i32,
            di: d as i32,
            ni: self.d_state as i32,
            sp: self.lanes() as i32,
            rounds: self.rounds() as i32,
            groups: self.groups() as i32,
        })
    }

    pub(super) fn is_empty(&self) -> bool {
        self.batch == 0 || self.seq_len == 0 || self.d_inner == 0
    }
}

/// Launch geometry of one scan (from [`ScanShape::launch`]).
pub(super) struct ScanLaunch {
    pub(super) fwd_grid: LaunchConfig,
    pub(super) bwd_grid: LaunchConfig,
    /// The first passes' grid, when there are several segments.
    pub(super) seg_grid: Option<LaunchConfig>,
    /// Chunks per segment (`SEGMENT_CHUNKS`).
    pub(super) seg: i32,
    pub(super) t: i32,
    pub(super) di: i32,
    pub(super) ni: i32,
    pub(super) sp: i32,
    pub(super) rounds: i32,
    pub(super) groups: i32,
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
        assert_eq!(s.da_partial_len(), 2 * 5 * 16);
        assert_eq!(shape(1, 16, 1, 1).chunks(), 1);
        assert_eq!(shape(1, 17, 1, 1).chunks(), 2);
    }

    #[test]
    fn lanes_cover_the_state_and_a_block_covers_whole_channels() {
        for (n, lanes, cpb) in [
            (1, 1, 128),
            (4, 1, 128),
            (7, 2, 64),
            (9, 4, 32),
            (16, 4, 32),
            (33, 16, 8),
            (64, 16, 8),
            (128, 32, 4),
        ] {
            let s = shape(1, 1, 10, n);
            assert_eq!((s.lanes(), s.channels_per_block()), (lanes, cpb), "N = {n}");
            assert!(s.lanes() * LANE_STATES >= n && s.lanes() <= 32, "N = {n}");
        }
    }

    #[test]
    fn backward_groups_cover_every_channel_exactly_once() {
        for d in [1, 5, 64, 127, 128, 1536, 3000, 8192] {
            for n in [1, 16, 64, 128] {
                let s = shape(1, 1, d, n);
                let covered = s.groups() * s.rounds() * s.channels_per_block();
                assert!(covered >= d, "d {d} n {n}");
                // No group lies wholly beyond the channels.
                assert!(
                    (s.groups() - 1) * s.rounds() * s.channels_per_block() < d,
                    "d {d} n {n}"
                );
                assert!(s.groups() <= MAX_GROUPS, "d {d} n {n}");
            }
        }
        // The 130m shape: 1536 channels, N 16 -> 32 channels a block, 48 groups of one set.
        let s = shape(8, 1024, 1536, 16);
        assert_eq!((s.rounds(), s.groups()), (1, 48));
        // The groups depend on the channels and states only, never the batch.
        assert_eq!(shape(1, 1024, 1536, 16).groups(), s.groups());
    }

    #[test]
    fn long_sequences_are_cut_into_segments_of_the_constant_length() {
        // Up to 64 chunks (1024 steps) is one segment: the unsegmented walk.
        for t in [1, 16, 1000, 1024] {
            let s = shape(8, t, 1536, 16);
            assert_eq!((s.segments(), s.segment_scratch_len()), (1, 0), "T {t}");
            assert_eq!(s.da_partial_len(), 8 * 1536 * 16, "T {t}");
        }
        let s = shape(1, 8192, 1536, 16);
        assert_eq!(s.segments(), 8);
        assert_eq!(s.segment_scratch_len(), 2 * 8 * 1536 * 16);
        assert_eq!(s.da_partial_len(), 8 * 1536 * 16);
        assert_eq!(shape(2, 1025, 4, 16).segments(), 2);
        assert_eq!(shape(2, 2100, 4, 16).segments(), 3);
        // The segments depend on the length alone, never the batch.
        assert_eq!(
            shape(7, 5000, 4, 3).segments(),
            shape(1, 5000, 900, 128).segments()
        );
        // The first passes' grid exists exactly when there are several.
        assert!(shape(1, 1024, 8, 16)
            .launch("k")
            .unwrap()
            .seg_grid
            .is_none());
        let lp = shape(1, 8192, 1536, 16).launch("k").unwrap();
        assert_eq!(lp.seg_grid.map(|g| g.grid_dim), Some((48, 1, 7)));
        assert_eq!(lp.fwd_grid.grid_dim, (48, 1, 8));
        assert_eq!(lp.bwd_grid.grid_dim, (48, 1, 8));
    }

    #[test]
    fn shared_memory_fits_an_sm_at_every_state_size() {
        let (f, b) = ScanShape::max_smem_bytes();
        // An sm_80 / sm_90 block may opt in to up to 163 / 227 KiB.
        assert!(f <= 160 * 1024 && b <= 160 * 1024, "{f} {b}");
        // The 130m shape: 18 KiB forward, 68.5 KiB backward (the d B / d C
        // stage rows padded to 128 + 4 floats at 4 lanes; three backward
        // blocks fit an H200 SM's 228 KiB, as the 384-block grid needs).
        let s = shape(8, 1024, 1536, 16);
        assert_eq!(s.fwd_smem_bytes(), (2 * 16 * (32 + 3 * 32) + 16 * 32) * 4);
        assert_eq!(
            s.bwd_smem_bytes(),
            (16 * 4 * 128 + 4 * 2 * 4 * 132 + 2 * 16 * (32 + 3 * 32) + 16 * 2 * 32) * 4
        );
        assert!(3 * (s.bwd_smem_bytes() + 1024) <= 228 * 1024);
    }

    #[test]
    fn shapes_the_kernels_cannot_run_are_refused() {
        assert!(shape(1, 1, 1, 0).validate("k").is_err());
        let e = shape(1, 1, 1, 129).validate("k").unwrap_err().to_string();
        assert!(e.contains("1..=128"), "{e}");
        assert!(shape(65_536, 1, 1, 1).validate("k").is_err());
        assert!(shape(1, 16 * 65_535 + 1, 1, 1).validate("k").is_ok());
        assert!(shape(1, 16 * 65_535, 1, 16).validate("k").is_ok());
    }
}
