//! The fold seam on device memory: `kernels::FoldKernel` for the folds, a
//! device copy, and a scale kernel, all enqueued on one stream (the
//! communicator's), so they are ordered with the NCCL groups around them.

use std::sync::Arc;

use cudarc::driver::{
    CudaFunction, CudaModule, CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr,
    PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use kernels::{FoldKernel, LaunchShape};

use crate::emulated::EmulatorMemory;
use crate::fold::FoldOps;
use crate::{ReduceError, Result};

/// `scale.ptx`: `buf[i] = buf[i] * factor` as one `mul.rn.f32` per element
/// (IEEE round-to-nearest, subnormals kept: no `.ftz`), grid-stride with
/// 64-bit indices; a float4 variant for 16-byte aligned views. Hand-written
/// PTX so that the multiply is exactly the host's `x * factor` whatever the
/// compiler flags; the driver JIT-compiles it once per context.
const SCALE_PTX: &str = include_str!("scale.ptx");
const SCALE_SYMBOL: &str = "mamba_reduce_scale_f32";
const SCALE4_SYMBOL: &str = "mamba_reduce_scale_f32x4";

/// [`FoldOps`] on `CudaSlice<f32>`: the fold kernels of `kernels` plus a
/// device copy and a scale kernel, all on `stream`.
///
/// Holds the loaded modules (and through them the context) alive. Every
/// operation is asynchronous on `stream`; [`FoldOps::finish`] synchronises
/// it. Use the communicator's stream, so that the NCCL groups of the
/// dataflow and these operations are ordered by the stream alone.
pub struct KernelFold {
    kernel: FoldKernel,
    stream: Arc<CudaStream>,
    _scale_module: Arc<CudaModule>,
    scale: CudaFunction,
    scale4: CudaFunction,
    shape: LaunchShape,
}

impl std::fmt::Debug for KernelFold {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelFold")
            .field("device", &self.stream.context().ordinal())
            .field("shape", &self.shape)
            .finish()
    }
}

impl KernelFold {
    /// Load the fold and scale kernels into `stream`'s context.
    pub fn load(stream: &Arc<CudaStream>) -> Result<Self> {
        let ctx = stream.context();
        let kernel = FoldKernel::load(ctx)?;
        let module = ctx
            .load_module(Ptx::from_src(SCALE_PTX))
            .map_err(|e| ReduceError::device("loading the scale kernel (PTX JIT)", e))?;
        let function = |symbol: &str| {
            module
                .load_function(symbol)
                .map_err(|e| ReduceError::device(format!("looking up {symbol}"), e))
        };
        let scale = function(SCALE_SYMBOL)?;
        let scale4 = function(SCALE4_SYMBOL)?;
        let shape = kernel.shape();
        Ok(KernelFold {
            kernel,
            stream: stream.clone(),
            _scale_module: module,
            scale,
            scale4,
            shape,
        })
    }

    /// The stream every operation is enqueued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The fold kernels.
    pub fn kernel(&self) -> &FoldKernel {
        &self.kernel
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
        let aligned = {
            let v = view_mut(buf, off, len, "scale")?;
            let (ptr, _record) = v.device_ptr(&self.stream);
            ptr % 16 == 0
        };
        // Vector body over whole float4s when aligned, scalar tail (or the
        // whole view when not aligned). Same multiply either way.
        let n4 = if aligned { len / 4 } else { 0 };
        if n4 > 0 {
            let mut body = view_mut(buf, off, n4 * 4, "scale body")?;
            let n4_arg = n4 as u64;
            let cfg = self.shape.config(n4_arg);
            let mut launch = self.stream.launch_builder(&self.scale4);
            launch.arg(&mut body).arg(&n4_arg).arg(&factor);
            // SAFETY: mamba_reduce_scale_f32x4(float* buf, u64 n4, f32
            // factor) reads and writes buf[0 .. 4*n4), which is exactly the
            // view; the view's address is 16-byte aligned (checked above).
            unsafe { launch.launch(cfg) }
                .map_err(|e| ReduceError::device("launching scale (float4)", e))?;
        }
        let tail = len - n4 * 4;
        if tail > 0 {
            let mut rest = view_mut(buf, off + n4 * 4, tail, "scale tail")?;
            let tail_arg = tail as u64;
            let cfg = self.shape.config(tail_arg);
            let mut launch = self.stream.launch_builder(&self.scale);
            launch.arg(&mut rest).arg(&tail_arg).arg(&factor);
            // SAFETY: mamba_reduce_scale_f32(float* buf, u64 len, f32
            // factor) touches buf[0 .. len), exactly the view.
            unsafe { launch.launch(cfg) }.map_err(|e| ReduceError::device("launching scale", e))?;
        }
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
