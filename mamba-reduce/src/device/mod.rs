//! The fold seam on device memory: `kernels::FoldKernel` for the folds and
//! the scale, plus device copies.
//!
//! Two ways to run a plan (see [`KernelFold::set_overlap`]):
//! - **two lanes** (the default, `run`): the whole plan is queued in one
//!   [`NcclComm::window`](mamba_comm::nccl::NcclComm::window) — groups on
//!   the communicator's stream, folds on a second stream of the same
//!   context, ordered by events exactly where the plan's lane dependencies
//!   say — and waited for once, under the communicator's watchdog;
//! - **serial**: step by step on the communicator's stream, every group
//!   waited for before its folds (the generic executor; a reference point
//!   for benchmarks).
//!
//! As a [`FoldOps`] (the emulated world, the library-sum contract) every
//! operation is enqueued on the one stream given to [`KernelFold::load`].

mod run;

use std::sync::Arc;

use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, CudaView, CudaViewMut};
use kernels::FoldKernel;

use crate::emulated::EmulatorMemory;
use crate::fold::{check_terms, ChainTerm, FoldOps};
use crate::{ReduceError, Result};

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
pub struct KernelFold {
    kernel: FoldKernel,
    stream: Arc<CudaStream>,
    /// The compute lane of the two-lane executor.
    lane: Option<Arc<CudaStream>>,
    events: Vec<CudaEvent>,
    overlap: bool,
}

impl std::fmt::Debug for KernelFold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelFold")
            .field("device", &self.stream.context().ordinal())
            .field("shape", &self.kernel.shape())
            .field("overlap", &self.overlap)
            .finish()
    }
}

impl KernelFold {
    /// Load the fold kernels into `stream`'s context.
    pub fn load(stream: &Arc<CudaStream>) -> Result<Self> {
        let kernel = FoldKernel::load(stream.context())?;
        Ok(KernelFold {
            kernel,
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

    /// See [`KernelFold::set_overlap`].
    pub fn overlap(&self) -> bool {
        self.overlap
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

/// Elements spanned by `n_slots` slots of `len` at `stride`.
fn span(n_slots: usize, stride: usize, len: usize) -> Result<usize> {
    if n_slots == 0 {
        return Ok(0);
    }
    (n_slots - 1)
        .checked_mul(stride)
        .and_then(|s| s.checked_add(len))
        .ok_or_else(|| ReduceError::invariant("slot span overflows usize"))
}

impl FoldOps<CudaSlice<f32>> for KernelFold {
    fn sum_slots(
        &mut self,
        slots: &CudaSlice<f32>,
        slots_off: usize,
        n_slots: usize,
        stride: usize,
        len: usize,
        out: &mut CudaSlice<f32>,
        out_off: usize,
    ) -> Result<()> {
        let s = view(
            slots,
            slots_off,
            span(n_slots, stride, len)?,
            "sum_slots slots",
        )?;
        let mut o = view_mut(out, out_off, len, "sum_slots output")?;
        self.kernel
            .det_sum_ranks(&self.stream, &s, n_slots, stride, len, &mut o)?;
        Ok(())
    }

    fn accumulate(
        &mut self,
        acc: &mut CudaSlice<f32>,
        acc_off: usize,
        slots: &CudaSlice<f32>,
        slots_off: usize,
        n_slots: usize,
        stride: usize,
        len: usize,
    ) -> Result<()> {
        let s = view(
            slots,
            slots_off,
            span(n_slots, stride, len)?,
            "accumulate slots",
        )?;
        let mut a = view_mut(acc, acc_off, len, "accumulator")?;
        self.kernel
            .det_accumulate_ranks(&self.stream, &mut a, &s, n_slots, stride, len)?;
        Ok(())
    }

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
        terms: &[ChainTerm<'_, CudaSlice<f32>>],
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

impl EmulatorMemory<CudaSlice<f32>> for KernelFold {
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
