//! The fixed-order fold kernels of `kernels/cuda/fold.cu`. Per element `i`:
//! - [`FoldKernel::det_chain`]: `dst[i] = (((a0[i] + a1[i]) + ...) * factor)`
//!   over a list of addends that may include `dst` itself at any position
//!   (the fixed-order reducer's whole fold, with the mean's `1/L` fused:
//!   the product is one more rounding of the finished f32 sum, so the bits
//!   equal a chain followed by [`FoldKernel::det_scale`]);
//! - [`FoldKernel::det_scale`]: `buf[i] = buf[i] * factor`.
//!
//! Each addition is one f32 add rounded to nearest, never contracted or
//! reordered; one thread owns each element and walks the addends in order.
//! So the bits equal a serial host loop `acc = acc + a_k[i]` in the same
//! order, whatever the GPU, grid, alignment or length. Note the sum starts
//! from `a0[i]`, not from `0.0` (`0.0 + -0.0` is `+0.0`, so starting
//! from zero would change the sign of an all-negative-zero column).

use std::sync::Arc;

use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaStream, CudaView, CudaViewMut, DevicePtr,
    DevicePtrMut, PushKernelArg,
};

use crate::device::load_module;
use crate::error::KernelError;
use crate::launch::LaunchShape;

/// Threads per block of the fold kernels' default shape.
const THREADS: u32 = 256;
/// Grid cap in blocks per multiprocessor; past it threads loop.
const BLOCKS_PER_SM: u32 = 16;

/// Most addends one `det_chain_f32` launch takes (the size of its by-value
/// pointer array, 256 bytes of kernel parameters). Longer chains are split
/// into launches that continue from `dst`; see [`FoldKernel::det_chain`].
pub const MAX_CHAIN_ADDENDS: usize = 32;

/// The loaded fold module of one context, ready to launch on its streams.
///
/// Holds the module (and through it the context) alive; cheap to clone and
/// to share between threads (launches go through the caller's stream).
#[derive(Debug, Clone)]
pub struct FoldKernel {
    ctx: Arc<CudaContext>,
    module: Arc<CudaModule>,
    chain: CudaFunction,
    scale: CudaFunction,
    shape: LaunchShape,
    /// Multiprocessors of the device (for shapes that take a share of them).
    sms: u32,
}

impl FoldKernel {
    /// The module name (`kernels/cuda/fold.cu`).
    pub const MODULE: &'static str = "fold";
    /// Kernel symbol of [`Self::det_chain`] and [`Self::det_chain_raw`].
    pub const CHAIN_SYMBOL: &'static str = "det_chain_f32";
    /// Kernel symbol of [`Self::det_scale`].
    pub const SCALE_SYMBOL: &'static str = "det_scale_f32";

    /// Load the fold module into `ctx` and size the grid for its device
    /// (256 threads per block, at most 16 blocks per multiprocessor).
    pub fn load(ctx: &Arc<CudaContext>) -> Result<FoldKernel, KernelError> {
        let module = load_module(ctx, Self::MODULE)?;
        let function = |symbol: &str| {
            module.load_function(symbol).map_err(|e| {
                KernelError::driver(format!("looking up kernel {symbol} in module fold"), e)
            })
        };
        let chain = function(Self::CHAIN_SYMBOL)?;
        let scale = function(Self::SCALE_SYMBOL)?;
        let sms = ctx
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| KernelError::driver("querying the multiprocessor count", e))?;
        let sms = u32::try_from(sms).unwrap_or(1).max(1);
        let shape = LaunchShape::for_device(THREADS, sms, BLOCKS_PER_SM)?;
        Ok(FoldKernel {
            ctx: ctx.clone(),
            module,
            chain,
            scale,
            shape,
            sms,
        })
    }

    /// The same kernels with another launch shape (tuning, or tests that need
    /// a grid much smaller than the data so threads loop). Results do not
    /// depend on the shape. Every [`LaunchShape`] launches: the chain kernel
    /// is compiled with `__launch_bounds__(1024)` (at most 64 registers a
    /// thread), the scale kernel uses fewer than 64 registers anyway, so
    /// 1024-thread blocks fit a multiprocessor.
    pub fn with_shape(mut self, shape: LaunchShape) -> FoldKernel {
        self.shape = shape;
        self
    }

    pub fn shape(&self) -> LaunchShape {
        self.shape
    }

    /// The device's multiprocessor count (at least 1), for shapes such as
    /// [`LaunchShape::for_sm_fraction`].
    pub fn multiprocessors(&self) -> u32 {
        self.sms
    }

    /// The context the module lives in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The loaded module (for callers that want the raw functions).
    pub fn module(&self) -> &Arc<CudaModule> {
        &self.module
    }

    /// `dst[i] = ((a_0[i] + a_1[i]) + ...) + a_{n-1}[i]`, then `* factor`
    /// when `factor` is `Some` (one more round-to-nearest multiply of the
    /// finished sum), for `i < len`. The addends `a_k` are `srcs` in order
    /// with `dst`'s own values inserted at position `dst_at` (`None`: `dst`
    /// is only written). Enqueued on `stream` with cudarc's event tracking
    /// (ordered after earlier uses of every view on other streams).
    ///
    /// Bits: the same as a serial host loop over the addends in this order
    /// followed by [`Self::det_scale`].
    ///
    /// Refused before any launch: no addend at all; `dst_at > srcs.len()`;
    /// `dst.len() < len` or some `src.len() < len`; more than
    /// [`MAX_CHAIN_ADDENDS`] addends with `dst` at a position `>=`
    /// [`MAX_CHAIN_ADDENDS`] (longer chains continue from `dst`, so its own
    /// values must be consumed by the first launch); a stream of another
    /// context. `len == 0` launches nothing.
    pub fn det_chain(
        &self,
        stream: &Arc<CudaStream>,
        dst: &mut CudaViewMut<f32>,
        dst_at: Option<usize>,
        srcs: &[CudaView<f32>],
        len: usize,
        factor: Option<f32>,
    ) -> Result<(), KernelError> {
        const NAME: &str = "det_chain";
        self.check_stream(NAME, stream)?;
        if dst_at.is_some_and(|k| k > srcs.len()) {
            return Err(KernelError::invalid(
                NAME,
                format!(
                    "dst_at = {dst_at:?} with {} sources; expected a position in 0..={}",
                    srcs.len(),
                    srcs.len()
                ),
            ));
        }
        if dst.len() < len {
            return Err(KernelError::invalid(
                NAME,
                format!(
                    "dst holds {} elements; expected at least len = {len}",
                    dst.len()
                ),
            ));
        }
        if let Some((k, s)) = srcs.iter().enumerate().find(|(_, s)| s.len() < len) {
            return Err(KernelError::invalid(
                NAME,
                format!(
                    "source {k} holds {} elements; expected at least len = {len}",
                    s.len()
                ),
            ));
        }
        // Pointers through cudarc's tracking: `stream` waits for earlier
        // writes (and, for dst, reads) on other streams; the guards record
        // this launch's reads and write when they drop, after the launch.
        let (dst_ptr, _dst_guard) = dst.device_ptr_mut(stream);
        let mut guards = Vec::with_capacity(srcs.len());
        let mut addends = Vec::with_capacity(srcs.len() + 1);
        for s in srcs {
            let (p, g) = s.device_ptr(stream);
            addends.push(p);
            guards.push(g);
        }
        if let Some(k) = dst_at {
            addends.insert(k, dst_ptr);
        }
        self.launch_chain(stream, dst_ptr, &addends, len, factor)
    }

    /// [`Self::det_chain`] on raw device addresses, without cudarc's event
    /// tracking: an addend equal to `dst` means `dst`'s own values. For
    /// executors that order their streams themselves with events.
    ///
    /// Checked here (refused before any launch): at least one addend; no
    /// addend other than `dst` itself overlapping `dst[0..len)`; the
    /// [`MAX_CHAIN_ADDENDS`] rule of [`Self::det_chain`]; the stream's
    /// context.
    ///
    /// # Safety
    ///
    /// `dst` and every addend must address at least `len` f32 of live device
    /// memory of this kernel's context, 4-byte aligned, kept alive until the
    /// launch completes; nothing else may write `dst[0..len)` or an addend,
    /// or read `dst[0..len)`, while the launch runs (the caller orders its
    /// streams).
    pub unsafe fn det_chain_raw(
        &self,
        stream: &CudaStream,
        dst: CUdeviceptr,
        addends: &[CUdeviceptr],
        len: usize,
        factor: Option<f32>,
    ) -> Result<(), KernelError> {
        self.check_stream("det_chain_raw", stream)?;
        self.launch_chain(stream, dst, addends, len, factor)
    }

    /// `buf[i] = buf[i] * factor` for `i < len`, one round-to-nearest
    /// multiply each (the host's `x * factor`); enqueued on `stream`.
    /// Refused when `buf.len() < len` or the stream belongs to another
    /// context.
    pub fn det_scale(
        &self,
        stream: &Arc<CudaStream>,
        buf: &mut CudaViewMut<f32>,
        len: usize,
        factor: f32,
    ) -> Result<(), KernelError> {
        const NAME: &str = "det_scale";
        self.check_stream(NAME, stream)?;
        if buf.len() < len {
            return Err(KernelError::invalid(
                NAME,
                format!(
                    "buf holds {} elements; expected at least len = {len}",
                    buf.len()
                ),
            ));
        }
        if len == 0 {
            return Ok(());
        }
        let l = len as u64;
        let cfg = self.shape.config(l.div_ceil(4));
        let mut launch = stream.launch_builder(&self.scale);
        launch.arg(buf).arg(&l).arg(&factor);
        // SAFETY: det_scale_f32(float* buf, u64 len, f32 factor) reads and
        // writes buf[0..len), inside the view (checked above).
        unsafe { launch.launch(cfg) }
            .map_err(|e| KernelError::driver(format!("launching {NAME} ({len} elements)"), e))?;
        Ok(())
    }

    /// Split a chain into launches of at most [`MAX_CHAIN_ADDENDS`]
    /// addends (later launches start from `dst`) and launch them.
    fn launch_chain(
        &self,
        stream: &CudaStream,
        dst: CUdeviceptr,
        addends: &[CUdeviceptr],
        len: usize,
        factor: Option<f32>,
    ) -> Result<(), KernelError> {
        const NAME: &str = "det_chain";
        check_chain(NAME, dst, addends, len)?;
        if len == 0 {
            return Ok(());
        }
        let l = len as u64;
        let cfg = self.shape.config(l.div_ceil(4));
        let mut rest = addends;
        let mut first = true;
        while !rest.is_empty() {
            let mut list = [0u64; MAX_CHAIN_ADDENDS];
            let mut n = 0;
            if !first {
                list[0] = dst;
                n = 1;
            }
            let take = rest.len().min(MAX_CHAIN_ADDENDS - n);
            list[n..n + take].copy_from_slice(&rest[..take]);
            n += take;
            rest = &rest[take..];
            let last = rest.is_empty();
            let (f, scale) = match factor {
                Some(f) if last => (f, 1u32),
                _ => (1.0f32, 0u32),
            };
            let n_arg = n as u32;
            let mut launch = stream.launch_builder(&self.chain);
            launch
                .arg(&dst)
                .arg(&list)
                .arg(&n_arg)
                .arg(&l)
                .arg(&f)
                .arg(&scale);
            // SAFETY: the arguments match det_chain_f32(float* dst, ChainTerms
            // {const float* p[32]} by value, u32 n, u64 len, f32 factor, u32
            // scale); the first n entries of the list are addresses the
            // callers vouch for (safe wrapper: views of >= len elements;
            // raw: the caller's contract), each read only below len, and
            // dst is written only below len. check_chain refused partial
            // overlaps of dst with an addend.
            unsafe { launch.launch(cfg) }.map_err(|e| {
                KernelError::driver(
                    format!("launching {NAME} ({n} addends x {len} elements)"),
                    e,
                )
            })?;
            first = false;
        }
        Ok(())
    }

    fn check_stream(&self, kernel: &'static str, stream: &CudaStream) -> Result<(), KernelError> {
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

/// Validate a pointer chain: at least one addend; no addend other than
/// `dst` itself overlapping `dst[0..len)` (a partial overlap would race
/// between threads); `dst`'s own values consumed by the first launch when
/// the chain needs several.
pub(crate) fn check_chain(
    kernel: &'static str,
    dst: CUdeviceptr,
    addends: &[CUdeviceptr],
    len: usize,
) -> Result<(), KernelError> {
    if addends.is_empty() {
        return Err(KernelError::invalid(
            kernel,
            "no addends; expected at least one (the chain starts from its first addend)",
        ));
    }
    let bytes = (len as u64).saturating_mul(4);
    let dst_end = dst.saturating_add(bytes);
    if let Some(k) = addends
        .iter()
        .position(|&a| a != dst && a < dst_end && dst < a.saturating_add(bytes))
    {
        return Err(KernelError::invalid(
            kernel,
            format!(
                "addend {k} at {:#x} overlaps dst {dst:#x}..{dst_end:#x} without being dst; an \
                 addend is either dst itself or disjoint from it",
                addends[k]
            ),
        ));
    }
    if addends.len() > MAX_CHAIN_ADDENDS {
        if let Some(k) = addends
            .iter()
            .skip(MAX_CHAIN_ADDENDS)
            .position(|&a| a == dst)
        {
            return Err(KernelError::invalid(
                kernel,
                format!(
                    "dst is addend {} of {}; a chain longer than {MAX_CHAIN_ADDENDS} continues \
                     from dst, so dst may only be one of the first {MAX_CHAIN_ADDENDS} addends",
                    k + MAX_CHAIN_ADDENDS,
                    addends.len()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(r: Result<(), KernelError>) -> String {
        match r {
            Err(KernelError::InvalidArgument { message, .. }) => message,
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
    }

    #[test]
    fn chain_checks_overlap_and_the_split_rule() {
        let c = |dst, addends: &[u64], len| check_chain("det_chain", dst, addends, len);
        assert!(message(c(0x1000, &[], 4)).contains("no addends"));
        // dst itself anywhere, and disjoint neighbours on both sides.
        assert!(c(0x1000, &[0x2000, 0x1000, 0x0ff0], 4).is_ok());
        assert!(c(0x1000, &[0x1010], 4).is_ok());
        // One element of overlap either side is refused.
        assert!(message(c(0x1000, &[0x100c], 4)).contains("addend 0"));
        assert!(message(c(0x1000, &[0x2000, 0x0ff4], 4)).contains("addend 1"));
        // Long chains: dst among the first MAX addends is fine, later not.
        let mut long: Vec<u64> = (0..40).map(|k| 0x10_0000 + 0x1000 * k).collect();
        long[MAX_CHAIN_ADDENDS - 1] = 0x1000;
        assert!(c(0x1000, &long, 4).is_ok());
        long.swap(MAX_CHAIN_ADDENDS - 1, MAX_CHAIN_ADDENDS);
        assert!(message(c(0x1000, &long, 4)).contains("first 32"));
        // Zero length: nothing overlaps.
        assert!(c(0x1000, &[0x1000, 0x1000], 0).is_ok());
    }
}
