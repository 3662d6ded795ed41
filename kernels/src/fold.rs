//! The fixed-order fold kernels of `kernels/cuda/fold.cu`.
//!
//! Per element `i`, with slot `k` starting at `k * slot_stride`:
//! - [`FoldKernel::det_sum_ranks`]: `out[i] = ((s0[i] + s1[i]) + s2[i]) + ...`
//! - [`FoldKernel::det_accumulate_ranks`]: `acc[i] = ((acc[i] + s0[i]) + s1[i]) + ...`
//!
//! Each addition is one f32 add rounded to nearest, never contracted or
//! reordered; one thread owns each element and walks the slots in ascending
//! order. So the bits equal a serial host loop `acc = acc + s_k[i]` in the
//! same order, whatever the GPU, grid, alignment or length. Note the sum
//! starts from `s0[i]`, not from `0.0` (`0.0 + -0.0` is `+0.0`, so starting
//! from zero would change the sign of an all-negative-zero column).

use std::sync::Arc;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, CudaView, CudaViewMut, PushKernelArg,
};

use crate::device::load_module;
use crate::error::KernelError;
use crate::launch::LaunchShape;

/// Threads per block of both fold kernels.
const THREADS: u32 = 256;
/// Grid cap in blocks per multiprocessor; past it threads loop.
const BLOCKS_PER_SM: u32 = 16;

/// The loaded fold module of one context, ready to launch on its streams.
///
/// Holds the module (and through it the context) alive; cheap to clone and
/// to share between threads (launches go through the caller's stream).
#[derive(Debug, Clone)]
pub struct FoldKernel {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
    sum: CudaFunction,
    accumulate: CudaFunction,
    shape: LaunchShape,
}

impl FoldKernel {
    /// The module name (`kernels/cuda/fold.cu`).
    pub const MODULE: &'static str = "fold";
    /// Kernel symbol of [`Self::det_sum_ranks`].
    pub const SUM_SYMBOL: &'static str = "det_sum_ranks_f32";
    /// Kernel symbol of [`Self::det_accumulate_ranks`].
    pub const ACCUMULATE_SYMBOL: &'static str = "det_accumulate_ranks_f32";

    /// Load the fold module into `ctx` and size the grid for its device
    /// (256 threads per block, at most 16 blocks per multiprocessor).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<FoldKernel, KernelError> {
        let module = load_module(ctx, Self::MODULE)?;
        let function = |symbol: &str| {
            module.load_function(symbol).map_err(|e| {
                KernelError::driver(format!("looking up kernel {symbol} in module fold"), e)
            })
        };
        let sum = function(Self::SUM_SYMBOL)?;
        let accumulate = function(Self::ACCUMULATE_SYMBOL)?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| KernelError::driver("querying the multiprocessor count", e))?;
        let shape =
            LaunchShape::for_device(THREADS, u32::try_from(sms).unwrap_or(1), BLOCKS_PER_SM)?;
        Ok(FoldKernel {
            ctx: ctx.clone(),
            module,
            sum,
            accumulate,
            shape,
        })
    }

    /// The same kernels with another launch shape (tuning, or tests that need
    /// a grid much smaller than the data so threads loop). Results do not
    /// depend on the shape.
    pub fn with_shape(mut self, shape: LaunchShape) -> FoldKernel {
        self.shape = shape;
        self
    }

    pub fn shape(&self) -> LaunchShape {
        self.shape
    }

    /// The context the module lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The loaded module (for callers that want the raw functions).
    pub fn module(&self) -> &Arc<CudaModule> {
        &self.module
    }

    /// `out[i] = ((slot0[i] + slot1[i]) + ...) + slot{n_slots-1}[i]` for
    /// `i < len`, slot `k` being `slots[k*slot_stride ..][..len]`; enqueued on
    /// `stream` (asynchronous, cudarc orders it after prior uses of the
    /// buffers). `out[len..]` is left alone.
    ///
    /// Refused with [`KernelError::InvalidArgument`] before any launch when:
    /// `n_slots == 0`; `n_slots > 1` and `slot_stride < len` (slots would
    /// overlap); `slots.len() < (n_slots-1)*slot_stride + len`;
    /// `out.len() < len`; `stream` belongs to another context. `len == 0`
    /// launches nothing.
    pub fn det_sum_ranks(
        &self,
        stream: &Arc<CudaStream>,
        slots: &CudaView<f32>,
        n_slots: usize,
        slot_stride: usize,
        len: usize,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), KernelError> {
        const NAME: &str = "det_sum_ranks";
        check_fold(NAME, 1, slots.len(), n_slots, slot_stride, len, out.len())?;
        self.check_stream(NAME, stream)?;
        if len == 0 {
            return Ok(());
        }
        let (n, stride, l) = (n_slots as u64, slot_stride as u64, len as u64);
        let cfg = self.shape.config(work_items(stride, l));
        let mut launch = stream.launch_builder(&self.sum);
        launch.arg(out).arg(slots).arg(&n).arg(&stride).arg(&l);
        // SAFETY: the argument list matches `det_sum_ranks_f32(float* out,
        // const float* slots, u64 n_slots, u64 slot_stride, u64 len)`;
        // check_fold proved every index the kernel touches is in bounds
        // (reads below (n_slots-1)*slot_stride + len <= slots.len(), writes
        // below len <= out.len()), and `out` is borrowed mutably so it does
        // not alias `slots`.
        unsafe { launch.launch(cfg) }.map_err(|e| {
            KernelError::driver(format!("launching {NAME} ({n_slots} slots x {len})"), e)
        })?;
        Ok(())
    }

    /// `acc[i] = ((acc[i] + slot0[i]) + slot1[i]) + ...` for `i < len`: the
    /// running-prefix step of the logical-world pipeline (the prefix arrives
    /// in `acc`, this process's block of ranks is added in ascending order).
    /// `n_slots == 0` is allowed and changes nothing. Same other checks as
    /// [`Self::det_sum_ranks`], with `acc` in the place of `out`.
    pub fn det_accumulate_ranks(
        &self,
        stream: &Arc<CudaStream>,
        acc: &mut CudaViewMut<f32>,
        slots: &CudaView<f32>,
        n_slots: usize,
        slot_stride: usize,
        len: usize,
    ) -> Result<(), KernelError> {
        const NAME: &str = "det_accumulate_ranks";
        check_fold(NAME, 0, slots.len(), n_slots, slot_stride, len, acc.len())?;
        self.check_stream(NAME, stream)?;
        if len == 0 || n_slots == 0 {
            return Ok(());
        }
        let (n, stride, l) = (n_slots as u64, slot_stride as u64, len as u64);
        let cfg = self.shape.config(work_items(stride, l));
        let mut launch = stream.launch_builder(&self.accumulate);
        launch.arg(acc).arg(slots).arg(&n).arg(&stride).arg(&l);
        // SAFETY: as in det_sum_ranks, for `det_accumulate_ranks_f32(float*
        // acc, const float* slots, u64, u64, u64)`; `acc` is read and written
        // only below len <= acc.len().
        unsafe { launch.launch(cfg) }.map_err(|e| {
            KernelError::driver(format!("launching {NAME} ({n_slots} slots x {len})"), e)
        })?;
        Ok(())
    }

    fn check_stream(
        &self,
        kernel: &'static str,
        stream: &Arc<CudaStream>,
    ) -> Result<(), KernelError> {
        if stream.context().cu_ctx() == self.ctx.cu_ctx() {
            Ok(())
        } else {
            Err(KernelError::invalid(
                kernel,
                format!(
                    "stream belongs to the context of device {}, but the fold module was loaded \
                     into device {}'s; load a FoldKernel per context",
                    stream.context().ordinal(),
                    self.ctx.ordinal()
                ),
            ))
        }
    }
}

/// Items the grid is sized for: float4 groups when the kernel may take its
/// vector path (stride a multiple of 4), elements otherwise. Only the grid
/// size depends on it; the kernel checks alignment itself.
fn work_items(stride: u64, len: u64) -> u64 {
    if stride % 4 == 0 {
        len.div_ceil(4)
    } else {
        len
    }
}

/// Validate a fold's arguments against the buffer lengths; the only thing
/// between a caller and an out-of-bounds launch. `min_slots` is 1 for the
/// sum (it starts from slot 0) and 0 for the accumulation.
pub(crate) fn check_fold(
    kernel: &'static str,
    min_slots: usize,
    slots_len: usize,
    n_slots: usize,
    slot_stride: usize,
    len: usize,
    dst_len: usize,
) -> Result<(), KernelError> {
    if n_slots < min_slots {
        return Err(KernelError::invalid(
            kernel,
            format!(
                "n_slots = {n_slots}; expected at least {min_slots} (the first addend is slot 0)"
            ),
        ));
    }
    if n_slots > 1 && slot_stride < len {
        return Err(KernelError::invalid(
            kernel,
            format!(
                "slot_stride = {slot_stride} < len = {len} with {n_slots} slots: the slots would \
                 overlap; expected slot_stride >= len"
            ),
        ));
    }
    if dst_len < len {
        return Err(KernelError::invalid(
            kernel,
            format!("the output view holds {dst_len} elements; expected at least len = {len}"),
        ));
    }
    if n_slots == 0 || len == 0 {
        return Ok(());
    }
    let needed = (n_slots - 1)
        .checked_mul(slot_stride)
        .and_then(|start| start.checked_add(len))
        .ok_or_else(|| {
            KernelError::invalid(
                kernel,
                format!("(n_slots - 1) * slot_stride + len overflows: n_slots = {n_slots}, slot_stride = {slot_stride}, len = {len}"),
            )
        })?;
    if slots_len < needed {
        return Err(KernelError::invalid(
            kernel,
            format!(
                "the slots view holds {slots_len} elements; {n_slots} slots of {len} at stride \
                 {slot_stride} need (n_slots - 1) * slot_stride + len = {needed}"
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn message(r: Result<(), KernelError>) -> String {
        match r {
            Err(KernelError::InvalidArgument { message, .. }) => message,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn refuses_what_would_go_out_of_bounds() {
        let sum =
            |slots, n, stride, len, out| check_fold("det_sum_ranks", 1, slots, n, stride, len, out);
        assert!(message(sum(100, 0, 10, 10, 10)).contains("n_slots = 0"));
        assert!(message(sum(100, 3, 5, 10, 10)).contains("overlap"));
        assert!(message(sum(100, 3, 10, 10, 9)).contains("holds 9"));
        // 3 slots of 10 at stride 40 need 2*40 + 10 = 90 elements.
        assert!(message(sum(89, 3, 40, 10, 10)).contains("= 90"));
        assert!(sum(90, 3, 40, 10, 10).is_ok());
        assert!(message(sum(usize::MAX, 3, usize::MAX / 2 + 1, 1, 1)).contains("overflows"));
        // One slot: the stride does not matter, only len.
        assert!(sum(10, 1, 0, 10, 10).is_ok());
        assert!(message(sum(9, 1, 0, 10, 10)).contains("need"));
        // Zero length: nothing is touched, lengths need not cover anything.
        assert!(sum(0, 4, 0, 0, 0).is_ok());
    }

    #[test]
    fn accumulate_allows_zero_slots_but_checks_the_rest() {
        let acc = |slots, n, stride, len, dst| {
            check_fold("det_accumulate_ranks", 0, slots, n, stride, len, dst)
        };
        assert!(acc(0, 0, 0, 10, 10).is_ok());
        assert!(message(acc(0, 0, 0, 10, 5)).contains("holds 5"));
        assert!(message(acc(19, 2, 10, 10, 10)).contains("= 20"));
        assert!(acc(20, 2, 10, 10, 10).is_ok());
    }

    proptest! {
        /// Accepted arguments keep every index in bounds; a buffer one shorter
        /// than needed is refused (so the check is tight, not just lenient).
        #[test]
        fn accepted_means_in_bounds(n_slots in 0usize..40, extra in 0usize..50, len in 0usize..1000,
                                    slack in 0usize..3, min_slots in 0usize..2) {
            let stride = len + extra;
            let needed = if n_slots == 0 || len == 0 { 0 } else { (n_slots - 1) * stride + len };
            let ok = check_fold("k", min_slots, needed + slack, n_slots, stride, len, len).is_ok();
            prop_assert_eq!(ok, n_slots >= min_slots);
            if ok && n_slots > 0 && len > 0 {
                let max_read = (n_slots - 1) * stride + (len - 1);
                prop_assert!(max_read < needed + slack);
                prop_assert!(check_fold("k", min_slots, needed - 1, n_slots, stride, len, len).is_err());
                prop_assert!(check_fold("k", min_slots, needed, n_slots, stride, len, len - 1).is_err());
            }
        }
    }

    #[test]
    fn vector_grid_only_when_stride_allows() {
        assert_eq!(work_items(8, 10), 3);
        assert_eq!(work_items(0, 10), 3);
        assert_eq!(work_items(7, 10), 10);
        assert_eq!(work_items(8, 0), 0);
    }
}
