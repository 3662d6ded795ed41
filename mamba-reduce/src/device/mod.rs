//! The fold seam on device memory: `kernels::FoldKernel` for the folds and
//! the scale, plus device copies.
//!
//! Two ways to run a plan (see [`DeviceFold::set_overlap`]):
//! - **two lanes** (the default, `run`): the whole plan is queued in one
//!   [`NcclComm::window`](mamba_comm::nccl::NcclComm::window) — groups on
//!   the communicator's stream, folds on a second stream of the same
//!   context, ordered by events exactly where the plan's lane dependencies
//!   say — and waited for once, under the communicator's watchdog;
//! - **serial**: step by step on the communicator's stream, every group
//!   waited for before its folds (the generic executor; a reference point
//!   for benchmarks).
//!
//! In the two-lane mode, folds that run beside transfers (plans of two or
//! more chunks) launch in the [`FoldGrid`] shape so that NCCL's kernels
//! find free multiprocessors (see [`FoldGrid`] for why).
//!
//! As a [`FoldOps`] (the emulated world, the library-sum contract) every
//! operation is enqueued on the one stream given to [`DeviceFold::load`].

mod run;

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut};
use kernels::{FoldKernel, LaunchShape};

use crate::emulated::EmulatorMemory;
use crate::fold::{check_terms, ChainTerm, FoldOps};
use crate::{ReduceError, Result};

/// The grid of the folds that run while NCCL moves other chunks (the
/// two-lane executor with two or more chunks). Never changes bits (one
/// thread owns each element whatever the grid); only which multiprocessors
/// the fold occupies, and so whether NCCL's kernels can run beside it.
///
/// Why it matters: NCCL's send/receive kernel is one block per channel, and
/// a block starts only on a multiprocessor with room for all of it. The
/// kernels' own shape ([`FoldGrid::Full`]: 16 blocks of 256 threads per SM,
/// many more than fit at once) fills every SM, so the next chunk's transfer
/// waits until the fold drains, and then runs while the peer's fold still
/// holds the peer's SMs: no overlap, and each chunk pays the fold in full
/// (measured: two chunks slower than one at every size). With
/// [`FoldGrid::SmFraction`] the fold is one 1024-thread block (48-64
/// registers a thread, so no second block and no NCCL block fits beside
/// it) on `ceil(f * SMs)` multiprocessors, all resident at once, and the
/// rest of the GPU is free for NCCL whenever its kernel starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum FoldGrid {
    /// The kernels' default shape (every SM, full occupancy): the fastest
    /// fold alone; what a one-chunk plan (nothing to overlap) always uses.
    Full,
    /// One block of [`FoldGrid::THREADS`] threads on `ceil(f * SMs)`
    /// multiprocessors, `f` in `(0, 1]`.
    SmFraction(f64),
}

impl FoldGrid {
    /// Threads per block of [`FoldGrid::SmFraction`] (CUDA's maximum: one
    /// block holds a whole SM's worth of the fold's loads in flight).
    pub const THREADS: u32 = 1024;
    /// The default for overlapped folds: half the SMs. The fold must stream
    /// `(P+1)/P` of a chunk through HBM while the link moves `(P-1)/P` of
    /// one (at `P = 2`: three times the link rate, ~1 TB/s on H200), which
    /// half an H200's SMs do with room to spare, and NCCL's point-to-point
    /// kernel takes far fewer blocks than the other half.
    pub const DEFAULT: FoldGrid = FoldGrid::SmFraction(0.5);

    /// The launch shape on a device with `sms` multiprocessors, given the
    /// kernels' default shape for [`FoldGrid::Full`].
    pub fn shape(self, full: LaunchShape, sms: u32) -> Result<LaunchShape> {
        match self {
            FoldGrid::Full => Ok(full),
            FoldGrid::SmFraction(f) => Ok(LaunchShape::for_sm_fraction(Self::THREADS, sms, f)?),
        }
    }
}

impl std::fmt::Display for FoldGrid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FoldGrid::Full => write!(f, "full"),
            FoldGrid::SmFraction(x) => write!(f, "{x}"),
        }
    }
}

impl std::str::FromStr for FoldGrid {
    type Err = ReduceError;

    /// `full`, or a fraction of the SMs in `(0, 1]` such as `0.5`.
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        if t.eq_ignore_ascii_case("full") {
            return Ok(FoldGrid::Full);
        }
        match t.parse::<f64>() {
            Ok(f) if f > 0.0 && f <= 1.0 => Ok(FoldGrid::SmFraction(f)),
            _ => Err(ReduceError::config(format!(
                "fold grid {s:?}: expected `full` or a fraction of the SMs in (0, 1], e.g. 0.5"
            ))),
        }
    }
}

/// [`FoldOps`] on `CudaSlice<f32>`: the fold kernels of `kernels` (the
/// scale is `det_scale`, or fused into `det_chain`) and device copies, all
/// on `stream`; and the two-lane executor of fixed-order plans over NCCL.
///
/// Holds the loaded module (and through it the context) alive, the second
/// stream of the two-lane executor (made on first use) and its events
/// (reused from call to call: a call returns only once all its work has
/// completed). Every [`FoldOps`] operation is asynchronous on `stream`;
/// [`FoldOps::finish`] synchronises it. Use the communicator's stream, so
/// that the NCCL groups and these operations are ordered by the stream
/// alone.
pub struct DeviceFold {
    kernel: FoldKernel,
    /// The same kernels in [`DeviceFold::overlap_grid`]'s shape: the folds
    /// of the two-lane executor when the plan has two or more chunks.
    overlap_kernel: FoldKernel,
    overlap_grid: FoldGrid,
    stream: Arc<CudaStream>,
    /// The compute lane of the two-lane executor.
    lane: Option<Arc<CudaStream>>,
    events: Vec<CudaEvent>,
    overlap: bool,
}

impl std::fmt::Debug for DeviceFold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceFold")
            .field("device", &self.stream.context().ordinal())
            .field("shape", &self.kernel.shape())
            .field("overlap", &self.overlap)
            .field("overlap_grid", &self.overlap_grid)
            .finish()
    }
}

impl DeviceFold {
    /// Load the fold kernels into `stream`'s context.
    pub fn load(stream: &Arc<CudaStream>) -> Result<Self> {
        let kernel = FoldKernel::load(stream.context())?;
        let grid = FoldGrid::DEFAULT;
        let overlap_kernel = kernel
            .clone()
            .with_shape(grid.shape(kernel.shape(), kernel.multiprocessors())?);
        Ok(DeviceFold {
            kernel,
            overlap_kernel,
            overlap_grid: grid,
            stream: stream.clone(),
            lane: None,
            events: Vec::new(),
            overlap: true,
        })
    }

    /// The stream every [`FoldOps`] operation is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The fold kernels.
    pub fn kernel(&self) -> &FoldKernel {
        &self.kernel
    }

    /// Whether fixed-order plans over NCCL run as two overlapping lanes in
    /// one window (`true`, the default) or step by step with a host wait
    /// per group (`false`). Never changes bits; only speed.
    pub fn set_overlap(&mut self, overlap: bool) {
        self.overlap = overlap;
    }

    /// See [`DeviceFold::set_overlap`].
    pub fn overlap(&self) -> bool {
        self.overlap
    }

    /// The grid of the folds the two-lane executor runs beside transfers
    /// (plans of two or more chunks; a one-chunk plan's single fold has
    /// nothing to overlap and always takes the full grid). Default
    /// [`FoldGrid::DEFAULT`]. Never changes bits; only speed.
    pub fn set_overlap_grid(&mut self, grid: FoldGrid) -> Result<()> {
        let shape = grid.shape(self.kernel.shape(), self.kernel.multiprocessors())?;
        self.overlap_kernel = self.kernel.clone().with_shape(shape);
        self.overlap_grid = grid;
        Ok(())
    }

    /// See [`DeviceFold::set_overlap_grid`].
    pub fn overlap_grid(&self) -> FoldGrid {
        self.overlap_grid
    }

    /// The fold kernels in the overlap grid's shape (what the two-lane
    /// executor launches for plans of two or more chunks).
    pub fn overlap_kernel(&self) -> &FoldKernel {
        &self.overlap_kernel
    }
}

fn view<'a>(
    buf: &'a CudaSlice<f32>,
    off: usize,
    len: usize,
    what: &str,
) -> Result<CudaView<'a, f32>> {
    off.checked_add(len)
        .and_then(|end| buf.try_slice(off..end))
        .ok_or_else(|| {
            ReduceError::invariant(format!(
                "{what}: elements {off}..{off}+{len} lie outside a device buffer of {}",
                buf.len()
            ))
        })
}

fn view_mut<'a>(
    buf: &'a mut CudaSlice<f32>,
    off: usize,
    len: usize,
    what: &str,
) -> Result<CudaViewMut<'a, f32>> {
    let n = buf.len();
    off.checked_add(len)
        .and_then(|end| buf.try_slice_mut(off..end))
        .ok_or_else(|| {
            ReduceError::invariant(format!(
                "{what}: elements {off}..{off}+{len} lie outside a device buffer of {n}"
            ))
        })
}

impl FoldOps<CudaSlice<f32>> for DeviceFold {
    fn copy(
        &mut self,
        src: &CudaSlice<f32>,
        src_off: usize,
        dst: &mut CudaSlice<f32>,
        dst_off: usize,
        len: usize,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let s = view(src, src_off, len, "copy source")?;
        let mut d = view_mut(dst, dst_off, len, "copy destination")?;
        self.stream
            .memcpy_dtod(&s, &mut d)
            .map_err(|e| ReduceError::device("memcpy_dtod", e))
    }

    fn scale(
        &mut self,
        buf: &mut CudaSlice<f32>,
        off: usize,
        len: usize,
        factor: f32,
    ) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let mut v = view_mut(buf, off, len, "scale")?;
        self.kernel.det_scale(&self.stream, &mut v, len, factor)?;
        Ok(())
    }

    fn chain(
        &mut self,
        dst: &mut CudaSlice<f32>,
        dst_off: usize,
        terms: &[ChainTerm<&CudaSlice<f32>>],
        len: usize,
        factor: Option<f32>,
    ) -> Result<()> {
        check_terms(terms)?;
        let dst_at = terms.iter().position(|t| matches!(t, ChainTerm::Dst));
        let srcs = terms
            .iter()
            .filter_map(|t| match t {
                ChainTerm::Dst => None,
                ChainTerm::Buf(b, off) => Some(view(b, *off, len, "chain term")),
            })
            .collect::<Result<Vec<_>>>()?;
        let mut d = view_mut(dst, dst_off, len, "chain output")?;
        self.kernel
            .det_chain(&self.stream, &mut d, dst_at, &srcs, len, factor)?;
        Ok(())
    }

    fn finish(&mut self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| ReduceError::device("stream synchronize", e))
    }
}

impl EmulatorMemory<CudaSlice<f32>> for DeviceFold {
    fn load(&mut self, values: &[f32]) -> Result<CudaSlice<f32>> {
        let buf = if values.is_empty() {
            self.stream.null()
        } else {
            self.stream.clone_htod(values)
        };
        buf.map_err(|e| ReduceError::device("copying values to the device", e))
    }

    fn store(&mut self, buf: &CudaSlice<f32>) -> Result<Vec<f32>> {
        self.finish()?;
        if buf.is_empty() {
            return Ok(Vec::new());
        }
        let v = self
            .stream
            .clone_dtoh(buf)
            .map_err(|e| ReduceError::device("copying values from the device", e))?;
        self.finish()?;
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::run::overlaps_transfers;
    use super::*;
    use crate::plan::RankPlan;

    #[test]
    fn fold_grids_parse_print_and_shape() {
        assert_eq!("full".parse::<FoldGrid>().unwrap(), FoldGrid::Full);
        assert_eq!(" FULL ".parse::<FoldGrid>().unwrap(), FoldGrid::Full);
        assert_eq!(
            "0.5".parse::<FoldGrid>().unwrap(),
            FoldGrid::SmFraction(0.5)
        );
        assert_eq!("1".parse::<FoldGrid>().unwrap(), FoldGrid::SmFraction(1.0));
        for bad in ["0", "-0.25", "1.5", "half", "", "nan"] {
            let e = bad.parse::<FoldGrid>().unwrap_err().to_string();
            assert!(e.contains("(0, 1]"), "{bad:?}: {e}");
        }
        for g in [
            FoldGrid::Full,
            FoldGrid::SmFraction(0.25),
            FoldGrid::DEFAULT,
        ] {
            assert_eq!(g.to_string().parse::<FoldGrid>().unwrap(), g);
        }
        let full = LaunchShape::for_device(256, 132, 16).unwrap();
        assert_eq!(FoldGrid::Full.shape(full, 132).unwrap(), full);
        let half = FoldGrid::DEFAULT.shape(full, 132).unwrap();
        assert_eq!((half.threads_per_block(), half.max_blocks()), (1024, 66));
        // Half an H200 in 1024-thread blocks is far below the full grid.
        assert!(half.max_blocks() * 1024 < full.max_blocks() * 256 / 4);
        assert!(FoldGrid::SmFraction(0.0).shape(full, 132).is_err());
    }

    #[test]
    fn only_multi_chunk_multi_process_plans_overlap() {
        let len = 1 << 20;
        let plan = |world, logical, chunk| RankPlan::new(0, world, logical, len, chunk).unwrap();
        assert!(!overlaps_transfers(&plan(2, 2, None)));
        assert!(overlaps_transfers(&plan(2, 2, Some(len / 2))));
        assert!(overlaps_transfers(&plan(2, 4, Some(len / 4))));
        // A 4 MiB pipeline defaults to one chunk (100 us per group):
        // nothing runs beside its fold.
        assert!(!overlaps_transfers(&plan(2, 4, None)));
        // One process: a pipeline of folds with no transfer beside them.
        assert!(!overlaps_transfers(&plan(1, 4, Some(len / 8))));
    }
}
