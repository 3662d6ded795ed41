//! Launchers of `kernels/cuda/mamba_ops.cu`'s causal depthwise conv: the
//! forward with SiLU, the backward through SiLU, the input gradient and the
//! weight and bias gradients (fixed two-stage sums). Formulas are in the
//! `.cu` file.

use cudarc::driver::{CudaFunction, CudaStream, CudaView, CudaViewMut};

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
        u: Store<'_>,
        rows: usize,
        seq_len: usize,
        d_inner: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        self.conv_pointwise(
            "mamba_conv_fwd",
            &self.f.conv_fwd,
            "u",
            stream,
            x,
            ldx,
            w,
            bias,
            ConvOut::Stored(u),
            rows,
            seq_len,
            d_inner,
            k,
        )
    }

    /// In place, `g <- g * SiLU'(pre)`: turns the gradient of the conv's
    /// output `u` into the gradient of its pre-activation (recomputed from
    /// `x`, `w`, `bias`). Same shapes as [`Self::conv_fwd`], `g` in `u`'s place.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_bwd_pre(
        &self,
        stream: &CudaStream,
        x: Stored<'_>,
        ldx: usize,
        w: &CudaView<f32>,
        bias: &CudaView<f32>,
        g: &mut CudaViewMut<f32>,
        rows: usize,
        seq_len: usize,
        d_inner: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        self.conv_pointwise(
            "mamba_conv_bwd_pre",
            &self.f.conv_bwd_pre,
            "g",
            stream,
            x,
            ldx,
            w,
            bias,
            ConvOut::InPlace(g),
            rows,
            seq_len,
            d_inner,
            k,
        )
    }

    /// The shared launcher of [`Self::conv_fwd`] and [`Self::conv_bwd_pre`]:
    /// both kernels recompute the conv's pre-activation from `x`, `w` and
    /// `bias` at each element of `[rows, d_inner]` and write one value of
    /// `out` there, so they take the same arguments, checks and grid.
    /// `out_name` names `out` in errors.
    #[allow(clippy::too_many_arguments)]
    fn conv_pointwise(
        &self,
        kernel: &'static str,
        func: &CudaFunction,
        out_name: &str,
        stream: &CudaStream,
        x: Stored<'_>,
        ldx: usize,
        w: &CudaView<f32>,
        bias: &CudaView<f32>,
        out: ConvOut<'_, '_>,
        rows: usize,
        seq_len: usize,
        d_inner: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        self.check_stream(kernel, stream)?;
        conv_checks(kernel, rows, seq_len, k)?;
        check::matrix(kernel, "x", x.len(), rows, d_inner, ldx)?;
        check::len(kernel, "w", w.len(), check::mul(kernel, "w", d_inner, k)?)?;
        check::len(kernel, "bias", bias.len(), d_inner)?;
        // The forward's kernel takes u's bf16 pointer after u; the
        // backward's has no such parameter.
        let (mut out, takes_bf16) = match out {
            ConvOut::Stored(s) => (s, true),
            ConvOut::InPlace(g) => (Store::F32(g.slice_mut(..)), false),
        };
        out.check_matrix(kernel, out_name, rows, d_inner, d_inner)?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel,
            func,
            grid: Grid::RowGroupsByCols {
                rows,
                cols: d_inner,
            },
            block: THREADS,
        };
        let [out_f32, out_bf16] = out.args();
        let [x_f32, x_bf16] = x.args();
        let mut args = vec![
            x_f32,
            x_bf16,
            Arg::Long("ldx", ldx),
            Arg::In(w),
            Arg::In(bias),
            out_f32,
        ];
        if takes_bf16 {
            args.push(out_bf16);
        }
        args.extend([
            Arg::Long("rows", rows),
            Arg::Int("seq_len", seq_len),
            Arg::Int("d_inner", d_inner),
            Arg::Int("k", k),
        ]);
        // SAFETY: `func` is mamba_conv_fwd (const float* x, const unsigned
        // short* x_h (one of the two null: Stored), long long ldx,
        // const float* w, const float* bias, float* u, unsigned short* u_h,
        // long long M, int T, int D, int K; u and u_h each null or checked
        // above) or mamba_conv_bwd_pre (the same without u_h, g in u's place:
        // always f32, ConvOut::InPlace), as the callers pass with `kernel`;
        // threads touch rows < M only, rows are a whole number of sequences,
        // reads stay inside the sequence, extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// `dx[b, t, c] = sum_k w[c, k] dpre[b, t + k_max - k, c]` (inside the
    /// sequence), written to `dx` (f32 and/or bf16, leading dimension `ldo`;
    /// the first half of in_proj's output gradient).
    #[allow(clippy::too_many_arguments)]
    pub fn conv_bwd_dx(
        &self,
        stream: &CudaStream,
        dpre: &CudaView<f32>,
        w: &CudaView<f32>,
        mut dx: Store<'_>,
        ldo: usize,
        rows: usize,
        seq_len: usize,
        d_inner: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_conv_bwd_dx";
        self.check_stream(K, stream)?;
        conv_checks(K, rows, seq_len, k)?;
        check::len(K, "dpre", dpre.len(), check::mul(K, "dpre", rows, d_inner)?)?;
        check::len(K, "w", w.len(), check::mul(K, "w", d_inner, k)?)?;
        dx.check_matrix(K, "dx", rows, d_inner, ldo)?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.f.conv_bwd_dx,
            grid: Grid::RowGroupsByCols {
                rows,
                cols: d_inner,
            },
            block: THREADS,
        };
        let [dx_f32, dx_bf16] = dx.args();
        let mut args = [
            Arg::In(dpre),
            Arg::In(w),
            dx_f32,
            dx_bf16,
            Arg::Long("ldo", ldo),
            Arg::Long("rows", rows),
            Arg::Int("seq_len", seq_len),
            Arg::Int("d_inner", d_inner),
            Arg::Int("k", k),
        ];
        // SAFETY: matches mamba_conv_bwd_dx(const float* dpre, const float*
        // w, float* dx, unsigned short* dx_h, long long ldo, long long M, int
        // T, int D, int K) (dx and dx_h each null or checked); threads touch
        // rows < M only; extents checked.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// Partial buffer length [`Self::conv_wgrad`] needs.
    pub fn conv_wgrad_scratch_len(rows: usize, d_inner: usize, k: usize) -> usize {
        rows.div_ceil(COL_SLAB) * (d_inner * k + d_inner)
    }

    /// The conv's weight and bias gradients (`x` f32 or kept in bf16) into
    /// `dw_db`, the weight's `d_inner * k` then the bias's `d_inner` (the
    /// order of conv1d.weight and conv1d.bias in the parameter arena):
    /// `dw[c, k] = sum_m dpre[m, c] x[m - k_max + k, c]` and `db[c] = sum_m
    /// dpre[m, c]`, each a fixed two-stage sum (slabs of [`COL_SLAB`] rows,
    /// then slabs ascending; the second stage is one launch for both, as
    /// the slab partials hold them in the same order). `scratch` holds
    /// [`Self::conv_wgrad_scratch_len`] elements.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_wgrad(
        &self,
        stream: &CudaStream,
        dpre: &CudaView<f32>,
        x: Stored<'_>,
        ldx: usize,
        scratch: &mut CudaViewMut<f32>,
        dw_db: &mut CudaViewMut<f32>,
        rows: usize,
        seq_len: usize,
        d_inner: usize,
        k: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_conv_wgrad_partial";
        self.check_stream(K, stream)?;
        conv_checks(K, rows, seq_len, k)?;
        check::len(K, "dpre", dpre.len(), check::mul(K, "dpre", rows, d_inner)?)?;
        check::matrix(K, "x", x.len(), rows, d_inner, ldx)?;
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
            func: &self.f.conv_wgrad_partial,
            grid: Grid::Dims(slabs, d_inner.div_ceil(32), 1),
            block: REDUCE_THREADS,
        };
        let [x_f32, x_bf16] = x.args();
        let mut args = [
            Arg::In(dpre),
            x_f32,
            x_bf16,
            Arg::Long("ldx", ldx),
            Arg::Out(&mut *scratch),
            Arg::Long("rows", rows),
            Arg::Int("seq_len", seq_len),
            Arg::Int("d_inner", d_inner),
            Arg::Int("k", k),
        ];
        // SAFETY: matches mamba_conv_wgrad_partial(const float* dpre, const
        // float* x, const unsigned short* x_h (one of the two null: Stored),
        // long long ldx, float* part, long long M, int T, int D, int K);
        // writes part[< slabs * stride], extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }?;
        let part = scratch.as_view();
        self.reduce_partials(stream, &part, slabs, stride, 0, stride, None, dw_db)
    }
}

/// Shared conv checks: rows are whole sequences, the width fits the kernel.
/// The output of [`MambaKernels::conv_pointwise`]: the forward's `u`
/// (f32 and/or bf16) or the backward's gradient, rewritten in place (f32).
enum ConvOut<'a, 'b> {
    Stored(Store<'b>),
    InPlace(&'a mut CudaViewMut<'b, f32>),
}

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
