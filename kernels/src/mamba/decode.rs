//! Launchers of `kernels/cuda/mamba_decode.cu`: the two kernels of a
//! recurrent decode step that read a carried state (the conv's kept inputs,
//! the SSM state) instead of earlier rows. Formulas are in the `.cu` file.
//!
//! [`DecodeKernels`] is loaded beside [`MambaKernels`] (whose embedding,
//! RMSNorm and softplus kernels a decode step also uses) and launches
//! through it, so the same launcher checks every argument; it is its own
//! module so that training never loads it.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaModule, CudaStream, CudaView, CudaViewMut};

use super::check;
use super::launcher::{Arg, Grid, Launch, THREADS};
use super::MambaKernels;
use crate::device::load_module;
use crate::error::KernelError;

/// The decode-step kernels of one context.
#[derive(Debug, Clone)]
pub struct DecodeKernels {
    base: MambaKernels,
    module: Arc<CudaModule>,
    conv_step: CudaFunction,
    scan_step: CudaFunction,
}

/// What [`DecodeKernels::scan_step`] reads, each of one token's row.
#[derive(Clone, Copy)]
pub struct ScanStepInputs<'a> {
    /// `u = SiLU(conv)`, `[d_inner]`.
    pub u: &'a CudaView<'a, f32>,
    /// `dt = softplus(.)`, `[d_inner]`.
    pub dt: &'a CudaView<'a, f32>,
    /// x_proj's output from its B column on: B then C, `2 d_state`.
    pub bc: &'a CudaView<'a, f32>,
    /// `A_log`, `[d_inner, d_state]`.
    pub a_log: &'a CudaView<'a, f32>,
    /// The skip parameter `D`, `[d_inner]`.
    pub d: &'a CudaView<'a, f32>,
    /// The gate `z`, `[d_inner]`.
    pub z: &'a CudaView<'a, f32>,
}

impl DecodeKernels {
    /// The module's name (`kernels/cuda/mamba_decode.cu`).
    pub const MODULE: &'static str = "mamba_decode";
    /// Its kernels.
    pub const SYMBOLS: [&'static str; 2] = ["mamba_decode_conv_step", "mamba_decode_scan_step"];

    /// Load the decode module into `base`'s context.
    ///
    /// Errors: [`KernelError::NotBuilt`] in a build without nvcc,
    /// [`KernelError::Driver`] naming the module or kernel refused.
    pub fn load(base: &MambaKernels) -> Result<DecodeKernels, KernelError> {
        let module = load_module(base.context(), Self::MODULE)?;
        let get = |symbol: &str| {
            module.load_function(symbol).map_err(|e| {
                KernelError::driver(
                    format!("looking up kernel {symbol} in module {}", Self::MODULE),
                    e,
                )
            })
        };
        Ok(DecodeKernels {
            conv_step: get(Self::SYMBOLS[0])?,
            scan_step: get(Self::SYMBOLS[1])?,
            base: base.clone(),
            module,
        })
    }

    /// The loaded module.
    pub fn module(&self) -> &Arc<CudaModule> {
        &self.module
    }

    /// The conv for one new token over `d_inner` channels of width `k`:
    /// `x` (`[d_inner]`, the x half of in_proj's row), `w` `[d_inner, 1,
    /// k]`, `bias`; `state` `[k - 1, d_inner]` holds the kept inputs, oldest
    /// first, of which the newest `filled` (`<= k - 1`) are inside the
    /// sequence; writes `u = SiLU(conv)` and shifts `x` into `state`.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_step(
        &self,
        stream: &CudaStream,
        x: &CudaView<f32>,
        w: &CudaView<f32>,
        bias: &CudaView<f32>,
        state: &mut CudaViewMut<f32>,
        u: &mut CudaViewMut<f32>,
        d_inner: usize,
        k: usize,
        filled: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_decode_conv_step";
        self.base.check_stream(K, stream)?;
        if k == 0 || filled >= k {
            return Err(KernelError::invalid(
                K,
                format!(
                    "conv width {k} with {filled} kept inputs; need width >= 1 and kept < width"
                ),
            ));
        }
        check::len(K, "x", x.len(), d_inner)?;
        check::len(K, "w", w.len(), check::mul(K, "w", d_inner, k)?)?;
        check::len(K, "bias", bias.len(), d_inner)?;
        check::len(
            K,
            "state",
            state.len(),
            check::mul(K, "state", k - 1, d_inner)?,
        )?;
        check::len(K, "u", u.len(), d_inner)?;
        if d_inner == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.conv_step,
            grid: Grid::Flat { n: d_inner },
            block: THREADS,
        };
        let mut args = [
            Arg::In(x),
            Arg::In(w),
            Arg::In(bias),
            Arg::Out(state),
            Arg::Out(u),
            Arg::Int("d_inner", d_inner),
            Arg::Int("k", k),
            Arg::Int("filled", filled),
        ];
        // SAFETY: matches mamba_decode_conv_step(const float* x, const
        // float* w, const float* bias, float* state, float* u, int D, int
        // K, int filled); thread c < D reads x[c], w[c*K..c*K+K], bias[c],
        // state[k*D + c] for k < K-1 and writes state there and u[c], all
        // inside the lengths checked above.
        unsafe { self.base.launch(stream, launch, &mut args) }
    }

    /// The scan for one new token over `d_inner` channels of `d_state`
    /// states: advances `h` (`[d_inner, d_state]`) and writes `y = C.h + D
    /// u` and `out = y SiLU(z)` (`[d_inner]` each).
    #[allow(clippy::too_many_arguments)]
    pub fn scan_step(
        &self,
        stream: &CudaStream,
        inp: ScanStepInputs<'_>,
        h: &mut CudaViewMut<f32>,
        y: &mut CudaViewMut<f32>,
        out: &mut CudaViewMut<f32>,
        d_inner: usize,
        d_state: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_decode_scan_step";
        self.base.check_stream(K, stream)?;
        let dn = check::mul(K, "h", d_inner, d_state)?;
        for (what, have) in [
            ("u", inp.u.len()),
            ("dt", inp.dt.len()),
            ("d", inp.d.len()),
            ("z", inp.z.len()),
            ("y", y.len()),
            ("out", out.len()),
        ] {
            check::len(K, what, have, d_inner)?;
        }
        check::len(K, "bc", inp.bc.len(), check::mul(K, "bc", 2, d_state)?)?;
        check::len(K, "a_log", inp.a_log.len(), dn)?;
        check::len(K, "h", h.len(), dn)?;
        if d_inner == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.scan_step,
            grid: Grid::Flat { n: d_inner },
            block: THREADS,
        };
        let mut args = [
            Arg::In(inp.u),
            Arg::In(inp.dt),
            Arg::In(inp.bc),
            Arg::In(inp.a_log),
            Arg::In(inp.d),
            Arg::In(inp.z),
            Arg::Out(h),
            Arg::Out(y),
            Arg::Out(out),
            Arg::Int("d_inner", d_inner),
            Arg::Int("d_state", d_state),
        ];
        // SAFETY: matches mamba_decode_scan_step(const float* u, dt, bc,
        // a_log, dpar, z, float* h, y, out, int D, int N); thread c < D
        // reads u, dt, dpar, z at c, bc[< 2N], a_log and h at c*N + n < D*N,
        // and writes h there and y[c], out[c]: inside the lengths checked.
        unsafe { self.base.launch(stream, launch, &mut args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_decode_kernel_is_in_its_embedded_module() {
        assert!(
            crate::source_names().contains(&DecodeKernels::MODULE),
            "kernels/cuda/{}.cu is missing",
            DecodeKernels::MODULE
        );
        let Some(image) = crate::fatbin(DecodeKernels::MODULE) else {
            assert!(
                !crate::available(),
                "built with nvcc but {} is not embedded",
                DecodeKernels::MODULE
            );
            return;
        };
        for symbol in DecodeKernels::SYMBOLS {
            let found = image.windows(symbol.len()).any(|w| w == symbol.as_bytes());
            assert!(found, "the {} fatbin lacks {symbol}", DecodeKernels::MODULE);
        }
        let bogus = b"mamba_decode_no_such_step";
        assert!(!image.windows(bogus.len()).any(|w| w == bogus));
    }
}
