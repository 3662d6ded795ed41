//! Launchers of `kernels/cuda/mamba_ops.cu`'s causal depthwise conv: the
//! forward with SiLU, and the backward through SiLU in one pass (the input
//! gradient, and the weight and bias gradients as fixed two-stage sums).
//! Formulas are in the `.cu` file.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut};

use super::check;
use super::launcher::{Arg, Grid, Launch, THREADS};
use super::reductions::REDUCE_THREADS;
use super::store::{Store, Stored};
use super::{MambaKernels, COL_SLAB};
use crate::error::KernelError;

/// Largest conv width the conv weight-gradient kernel handles.
pub const MAX_CONV_WIDTH: usize = 8;

impl MambaKernels {
    /// `u = SiLU(conv(x))`: causal depthwise conv of width `k` with bias
    /// over each sequence of `seq_len` rows; `x` is `[rows, d_inner]` with
    /// leading dimension `ldx` (the first half of in_proj's output, f32 or
    /// kept in bf16), `w` is `[d_inner, 1, k]`, `u` is `[rows, d_inner]`
    /// (f32, bf16 or both).
    #[allow(clippy::too_many_arguments)]
    pub fn conv_fwd(
        &self,
        stream: &CudaStream,
        x: Stored<'_>,
        ldx: usize,
        w: &CudaView<f32>,
        bias: &CudaView<f32>,
        mut u: Store<'_>,
        rows: usize,
        seq_len: usize,
        d_inner: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_conv_fwd";
        self.check_stream(K, stream)?;
        conv_checks(K, rows, seq_len, k)?;
        check_conv_params(K, x, ldx, w, bias, rows, d_inner, k)?;
        u.check_matrix(K, "u", rows, d_inner, d_inner)?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.f.conv_fwd,
            grid: Grid::RowGroupsByCols {
                rows,
                cols: d_inner,
            },
            block: THREADS,
        };
        let [u_f32, u_bf16] = u.args();
        let [x_f32, x_bf16] = x.args();
        let mut args = [
            x_f32,
            x_bf16,
            Arg::Long("ldx", ldx),
            Arg::In(w),
            Arg::In(bias),
            u_f32,
            u_bf16,
            Arg::Long("rows", rows),
            Arg::Int("seq_len", seq_len),
            Arg::Int("d_inner", d_inner),
            Arg::Int("k", k),
        ];
        // SAFETY: matches mamba_conv_fwd(const float* x, const unsigned
        // short* x_h (one of the two null: Stored), long long ldx, const
        // float* w, const float* bias, float* u, unsigned short* u_h (each
        // null or checked above), long long M, int T, int D, int K); threads
        // touch rows < M only, rows are a whole number of sequences, reads
        // stay inside the sequence, extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// Partial buffer length [`Self::conv_bwd`] needs.
    pub fn conv_wgrad_scratch_len(rows: usize, d_inner: usize, k: usize) -> usize {
        rows.div_ceil(COL_SLAB) * (d_inner * k + d_inner)
    }

    /// The conv's whole backward through SiLU, from `du` (the gradient of
    /// [`Self::conv_fwd`]'s `u`, `[rows, d_inner]`, read only), with the
    /// forward's `x`, `w`, `bias` and shapes:
    /// - `dx[b, t, c] = sum_k w[c, k] dpre[b, t + k_max - k, c]` (inside the
    ///   sequence) into `dx` (f32 and/or bf16, leading dimension `ldo`: the
    ///   conv's columns of in_proj's output gradient), where `dpre = du *
    ///   SiLU'(pre)` and `pre` is recomputed from `x` exactly as the forward
    ///   made it;
    /// - the weight and bias gradients into `dw_db`, the weight's `d_inner *
    ///   k` then the bias's `d_inner` (the order of conv1d.weight and
    ///   conv1d.bias in the parameter arena): `dw[c, k] = sum_m dpre[m, c]
    ///   x[m - k_max + k, c]` and `db[c] = sum_m dpre[m, c]`, each a fixed
    ///   two-stage sum (slabs of [`COL_SLAB`] rows in the kernel, then the
    ///   slabs ascending, one launch for both). `scratch` holds
    ///   [`Self::conv_wgrad_scratch_len`] elements.
    ///
    /// One kernel makes `dpre` tile by tile in shared memory, so it is never
    /// written: the bits of the three passes it replaced (through SiLU in
    /// place, dx, the slab sums), whose expressions and association it
    /// keeps (`kernels/emu/conv_check.cpp` pins both).
    #[allow(clippy::too_many_arguments)]
    pub fn conv_bwd(
        &self,
        stream: &CudaStream,
        x: Stored<'_>,
        ldx: usize,
        w: &CudaView<f32>,
        bias: &CudaView<f32>,
        du: &CudaView<f32>,
        mut dx: Store<'_>,
        ldo: usize,
        scratch: &mut CudaViewMut<f32>,
        dw_db: &mut CudaViewMut<f32>,
        rows: usize,
        seq_len: usize,
        d_inner: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_conv_bwd";
        self.check_stream(K, stream)?;
        conv_checks(K, rows, seq_len, k)?;
        check_conv_params(K, x, ldx, w, bias, rows, d_inner, k)?;
        check::len(K, "du", du.len(), check::mul(K, "du", rows, d_inner)?)?;
        dx.check_matrix(K, "dx", rows, d_inner, ldo)?;
        let stride = d_inner * k + d_inner;
        check::len(
            K,
            "scratch",
            scratch.len(),
            Self::conv_wgrad_scratch_len(rows, d_inner, k),
        )?;
        check::len(K, "dw_db", dw_db.len(), stride)?;
        if d_inner == 0 {
            return Ok(());
        }
        if rows == 0 {
            return Err(KernelError::invalid(
                K,
                "no rows: the gradient would be undefined",
            ));
        }
        let slabs = rows.div_ceil(COL_SLAB);
        let launch = Launch {
            kernel: K,
            func: &self.f.conv_bwd,
            grid: Grid::Dims(slabs, d_inner.div_ceil(32), 1),
            block: REDUCE_THREADS,
        };
        let [x_f32, x_bf16] = x.args();
        let [dx_f32, dx_bf16] = dx.args();
        let mut args = [
            x_f32,
            x_bf16,
            Arg::Long("ldx", ldx),
            Arg::In(w),
            Arg::In(bias),
            Arg::In(du),
            dx_f32,
            dx_bf16,
            Arg::Long("ldo", ldo),
            Arg::Out(&mut *scratch),
            Arg::Long("rows", rows),
            Arg::Int("seq_len", seq_len),
            Arg::Int("d_inner", d_inner),
            Arg::Int("k", k),
        ];
        // SAFETY: matches mamba_conv_bwd(const float* x, const unsigned
        // short* x_h (one of the two null: Stored), long long ldx, const
        // float* w, const float* bias, const float* du, float* dx, unsigned
        // short* dx_h (each null or checked above), long long ldo, float*
        // part, long long M, int T, int D, int K), block 256 as the kernel's
        // lanes assume; threads read rows < M and write dx rows < M and
        // part[< slabs * stride], extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }?;
        let part = scratch.as_view();
        self.reduce_partials(stream, &part, slabs, stride, 0, stride, None, dw_db)
    }
}

/// The checks both conv directions make of the forward's operands: `x`
/// (`[rows, d_inner]`, leading dimension `ldx`), `w` (`[d_inner, 1, k]`),
/// `bias` (`[d_inner]`).
#[allow(clippy::too_many_arguments)]
fn check_conv_params(
    kernel: &'static str,
    x: Stored<'_>,
    ldx: usize,
    w: &CudaView<f32>,
    bias: &CudaView<f32>,
    rows: usize,
    d_inner: usize,
    k: usize,
) -> Result<(), KernelError> {
    check::matrix(kernel, "x", x.len(), rows, d_inner, ldx)?;
    check::len(kernel, "w", w.len(), check::mul(kernel, "w", d_inner, k)?)?;
    check::len(kernel, "bias", bias.len(), d_inner)
}

/// Shared conv checks: rows are whole sequences, the width fits the kernel.
fn conv_checks(
    kernel: &'static str,
    rows: usize,
    seq_len: usize,
    k: usize,
) -> Result<(), KernelError> {
    if seq_len == 0 || rows % seq_len != 0 {
        return Err(KernelError::invalid(
            kernel,
            format!("{rows} rows are not a whole number of sequences of length {seq_len}"),
        ));
    }
    if k == 0 || k > MAX_CONV_WIDTH {
        return Err(KernelError::invalid(
            kernel,
            format!("conv width {k}; the kernels handle 1..={MAX_CONV_WIDTH}"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conv_shape_errors_say_what_is_expected() {
        let e = conv_checks("k", 10, 4, 4).unwrap_err().to_string();
        assert!(e.contains("not a whole number of sequences"), "{e}");
        let e = conv_checks("k", 8, 4, 9).unwrap_err().to_string();
        assert!(e.contains("1..=8"), "{e}");
        assert!(conv_checks("k", 8, 4, 4).is_ok());
    }
}
