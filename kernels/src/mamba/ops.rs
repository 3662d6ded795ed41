//! Launchers of `kernels/cuda/mamba_ops.cu`'s row and element kernels:
//! embedding, RMSNorm, softplus of dt and the gate's backward (the causal
//! conv is in [`super::conv`], the fixed-order reductions in
//! [`super::reductions`]). Formulas are in the `.cu` file, next to the code;
//! each launcher documents its buffers and what it checks.

use cudarc::driver::{CudaFunction, CudaStream, CudaView, CudaViewMut};

use super::check;
use super::launcher::{Arg, Grid, Launch, THREADS};
use super::reductions::REDUCE_THREADS;
use super::store::{Store, Stored};
use super::MambaKernels;
use crate::error::KernelError;

pub use super::reductions::ColSum;
pub use super::tokens::{DeviceTokenCsr, TokenCsr};

/// Rows per block of the warp-per-row kernels (RMSNorm, the gated-norm
/// backward).
pub(super) const ROWS_PER_BLOCK: usize = 8;

impl MambaKernels {
    /// `h[m, :] = emb[tokens[m], :]` for `m < tokens.len()`; `emb` is
    /// `[vocab, d]`, `h` is `[tokens.len(), d]`. A token `>= vocab` gives a
    /// NaN row (callers validate tokens first; this only keeps a bug loud).
    pub fn embed_fwd(
        &self,
        stream: &CudaStream,
        tokens: &CudaView<u32>,
        emb: &CudaView<f32>,
        h: &mut CudaViewMut<f32>,
        d: usize,
        vocab: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_embed_fwd";
        self.check_stream(K, stream)?;
        let rows = tokens.len();
        check::len(K, "emb", emb.len(), check::mul(K, "emb", vocab, d)?)?;
        check::len(K, "h", h.len(), check::mul(K, "h", rows, d)?)?;
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.f.embed_fwd,
            grid: Grid::RowsByCols { rows, cols: d },
            block: THREADS,
        };
        let mut args = [
            Arg::In(tokens),
            Arg::In(emb),
            Arg::Out(h),
            Arg::Int("d", d),
            Arg::Int("vocab", vocab),
        ];
        // SAFETY: matches mamba_embed_fwd(const unsigned*, const float*,
        // float*, int d, int vocab); reads tokens[< rows], emb rows < vocab
        // (guarded in the kernel), writes h[< rows * d].
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// `demb[v, :] += sum of dh[p, :]` over the positions `p` of each
    /// distinct token `v` of `csr`, in ascending `p` (one owner per row: no
    /// atomics). `dh` is `[csr.positions(), d]`, `demb` `[vocab, d]`. The
    /// launch covers the CSR's padded rows ([`DeviceTokenCsr::rows`]): an
    /// empty row rewrites its token's values unchanged.
    pub fn embed_bwd(
        &self,
        stream: &CudaStream,
        csr: &DeviceTokenCsr,
        dh: &CudaView<f32>,
        demb: &mut CudaViewMut<f32>,
        d: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_embed_bwd";
        self.check_stream(K, stream)?;
        check::len(K, "dh", dh.len(), check::mul(K, "dh", csr.positions, d)?)?;
        check::len(K, "demb", demb.len(), check::mul(K, "demb", csr.vocab, d)?)?;
        if csr.rows == 0 || d == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.f.embed_bwd,
            grid: Grid::RowsByCols {
                rows: csr.rows,
                cols: d,
            },
            block: THREADS,
        };
        let mut args = [
            Arg::In(&csr.uniq),
            Arg::In(&csr.row_ptr),
            Arg::In(&csr.pos),
            Arg::In(dh),
            Arg::Out(demb),
            Arg::Int("d", d),
        ];
        // SAFETY: matches mamba_embed_bwd(const unsigned* uniq, const
        // unsigned* row_ptr, const unsigned* pos, const float* dh, float*
        // demb, int d); DeviceTokenCsr guarantees tokens < vocab and
        // positions < csr.positions, checked against demb and dh above.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// RMSNorm forward over `rows` rows of width `d`: `y = w * (x * r)`
    /// (f32, bf16 or both), `r = 1/sqrt(mean(x^2) + eps)`, saving
    /// `rstd[m] = r`; `x` f32 or kept in bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_fwd(
        &self,
        stream: &CudaStream,
        x: Stored<'_>,
        w: &CudaView<f32>,
        mut y: Store<'_>,
        rstd: &mut CudaViewMut<f32>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_rmsnorm_fwd";
        self.check_stream(K, stream)?;
        let n = check::mul(K, "x", rows, d)?;
        check::len(K, "x", x.len(), n)?;
        y.check_each("y", |what, have| check::len(K, what, have, n))?;
        check::len(K, "w", w.len(), d)?;
        check::len(K, "rstd", rstd.len(), rows)?;
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let launch = warp_per_row(K, &self.f.rmsnorm_fwd, rows);
        let [y_f32, y_bf16] = y.args();
        let [x_f32, x_bf16] = x.args();
        let mut args = [
            x_f32,
            x_bf16,
            Arg::In(w),
            y_f32,
            y_bf16,
            Arg::Out(rstd),
            Arg::Long("rows", rows),
            Arg::Int("d", d),
            Arg::F32(eps),
        ];
        // SAFETY: matches mamba_rmsnorm_fwd(const float* x, const unsigned
        // short* x_h (one of the two null: Stored), const float* w, float*
        // y, unsigned short* y_h, float* rstd, long long M, int d, float eps)
        // (y and y_h each null or checked); all extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// RMSNorm backward: `dx = r w dy - x r^3 (sum_k dy_k w_k x_k) / d`,
    /// written to `dx` or, with `accumulate`, added to it (the residual
    /// stream's gradient; `dx` must then hold f32 values), and the result's
    /// bf16 copy stored too when `dx` has one; `x` f32 or kept in bf16.
    /// The weight gradient is a [`ColSum::ProductRowScaled`] of `dy`, `x`
    /// and `rstd`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bwd(
        &self,
        stream: &CudaStream,
        dy: &CudaView<f32>,
        x: Stored<'_>,
        w: &CudaView<f32>,
        rstd: &CudaView<f32>,
        mut dx: Store<'_>,
        rows: usize,
        d: usize,
        accumulate: bool,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_rmsnorm_bwd";
        self.check_stream(K, stream)?;
        let n = check::mul(K, "x", rows, d)?;
        check::len(K, "dy", dy.len(), n)?;
        check::len(K, "x", x.len(), n)?;
        dx.check_each("dx", |what, have| check::len(K, what, have, n))?;
        if accumulate && !dx.has_f32() {
            return Err(KernelError::invalid(
                K,
                "accumulating into dx needs its f32 values; a bf16-only dx was given",
            ));
        }
        check::len(K, "w", w.len(), d)?;
        check::len(K, "rstd", rstd.len(), rows)?;
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let launch = warp_per_row(K, &self.f.rmsnorm_bwd, rows);
        let [dx_f32, dx_bf16] = dx.args();
        let [x_f32, x_bf16] = x.args();
        let mut args = [
            Arg::In(dy),
            x_f32,
            x_bf16,
            Arg::In(w),
            Arg::In(rstd),
            dx_f32,
            dx_bf16,
            Arg::Long("rows", rows),
            Arg::Int("d", d),
            Arg::I32(accumulate as i32),
        ];
        // SAFETY: matches mamba_rmsnorm_bwd(const float* dy, const float* x,
        // const unsigned short* x_h (one of the two null: Stored), const
        // float* w, const float* rstd, float* dx, unsigned short* dx_h,
        // long long M, int d, int accumulate) (dx and dx_h each null or
        // checked; dx not null when accumulating); extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// `dt = softplus(raw + bias[c])` over `[rows, d_inner]` (torch's
    /// softplus: threshold 20): in place over an f32 `raw` when `dt` is
    /// `None`, else from `raw` into `dt` (f32, its bf16 rounding, or both).
    pub fn dt_softplus(
        &self,
        stream: &CudaStream,
        raw: &mut CudaViewMut<f32>,
        mut dt: Option<Store<'_>>,
        bias: &CudaView<f32>,
        rows: usize,
        d_inner: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_dt_softplus";
        self.check_stream(K, stream)?;
        let n = check::mul(K, "dt", rows, d_inner)?;
        check::len(K, "raw", raw.len(), n)?;
        if let Some(dt) = &dt {
            dt.check_each("dt", |what, have| check::len(K, what, have, n))?;
        }
        check::len(K, "bias", bias.len(), d_inner)?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.f.dt_softplus,
            grid: Grid::RowGroupsByCols {
                rows,
                cols: d_inner,
            },
            block: THREADS,
        };
        let [dt_f32, dt_bf16] = match dt.as_mut() {
            Some(dt) => dt.args(),
            None => [Arg::Null, Arg::Null],
        };
        let mut args = [
            Arg::Out(raw),
            Arg::In(bias),
            dt_f32,
            dt_bf16,
            Arg::Long("rows", rows),
            Arg::Int("d_inner", d_inner),
        ];
        // SAFETY: matches mamba_dt_softplus(float* raw, const float* bias,
        // float* dt, unsigned short* dt_h, long long M, int D) (dt, dt_h
        // each null or checked; both null: the result goes over raw, which
        // is why raw is pushed as written); a thread touches rows < M of its
        // column only; extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// Backward of `out = y * SiLU(z)`: `dy = dout SiLU(z)` (`[rows,
    /// d_inner]`), `dz = dout y SiLU'(z)` (f32 and/or bf16), and `out`
    /// itself again into `g` (f32 and/or bf16, `[rows, d_inner]`): the same
    /// bits as [`Self::scan_forward`] wrote it from the same `y` and `z`
    /// (one device function, `gate_out`), so no caller needs to keep it for
    /// out_proj's weight gradient. `y` and `z` as they are kept (f32 or
    /// bf16); `z` and `dz` have leading dimension `ldz` (the second half of
    /// in_proj's output / its gradient).
    #[allow(clippy::too_many_arguments)]
    pub fn gate_bwd(
        &self,
        stream: &CudaStream,
        dout: &CudaView<f32>,
        y: Stored<'_>,
        z: Stored<'_>,
        ldz: usize,
        dy: &mut CudaViewMut<f32>,
        mut dz: Store<'_>,
        mut g: Store<'_>,
        rows: usize,
        d_inner: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_gate_bwd";
        self.check_stream(K, stream)?;
        let n = check::mul(K, "dout", rows, d_inner)?;
        check::len(K, "dout", dout.len(), n)?;
        check_gate_operands(K, y, z, ldz, dy.len(), &dz, rows, d_inner)?;
        g.check_each("g", |what, have| check::len(K, what, have, n))?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.f.gate_bwd,
            grid: Grid::RowsByCols {
                rows,
                cols: d_inner,
            },
            block: THREADS,
        };
        let [dz_f32, dz_bf16] = dz.args();
        let [g_f32, g_bf16] = g.args();
        let [y_f32, y_bf16] = y.args();
        let [z_f32, z_bf16] = z.args();
        let mut args = [
            Arg::In(dout),
            y_f32,
            y_bf16,
            z_f32,
            z_bf16,
            Arg::Long("ldz", ldz),
            Arg::Out(dy),
            dz_f32,
            dz_bf16,
            g_f32,
            g_bf16,
            Arg::Int("d_inner", d_inner),
        ];
        // SAFETY: matches mamba_gate_bwd(const float* dout, const float* y,
        // const unsigned short* y_h, const float* z, const unsigned short*
        // z_h (one of each pair null: Stored), long long ldz, float* dy,
        // float* dz, unsigned short* dz_h, float* g, unsigned short* g_h,
        // int D) (dz, dz_h, g, g_h each null or checked); extents checked
        // above.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// Mamba-2's gated RMSNorm backward and the gate's in one pass: `dg`,
    /// what [`Self::rmsnorm_bwd`] makes of `dgn`, `g`, `w` and `rstd` (never
    /// stored), taken through `out = y * SiLU(z)` as [`Self::gate_bwd`]
    /// does, into `dy = dg SiLU(z)` (`[rows, d_inner]`, f32 and/or bf16:
    /// bf16 runs keep the SSD's dy in bf16 alone) and `dz = dg y SiLU'(z)`
    /// (f32 and/or bf16, leading dimension `ldz`). `dgn` is the gradient of the norm's
    /// output (`[rows, d_inner]`); `g` (the norm's input), `y` and `z` as
    /// they are kept (f32 or bf16). The same bits as the two kernels one
    /// after the other (they share their device functions; the emulated
    /// ops check compares them), without dg's write and read. The norm
    /// weight's gradient is still a [`ColSum::ProductRowScaled`] of `dgn`,
    /// `g` and `rstd`.
    ///
    /// [`ColSum::ProductRowScaled`]: super::reductions::ColSum::ProductRowScaled
    #[allow(clippy::too_many_arguments)]
    pub fn gated_norm_bwd(
        &self,
        stream: &CudaStream,
        dgn: &CudaView<f32>,
        g: Stored<'_>,
        w: &CudaView<f32>,
        rstd: &CudaView<f32>,
        y: Stored<'_>,
        z: Stored<'_>,
        ldz: usize,
        mut dy: Store<'_>,
        mut dz: Store<'_>,
        rows: usize,
        d_inner: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_gated_norm_bwd";
        self.check_stream(K, stream)?;
        let n = check::mul(K, "dgn", rows, d_inner)?;
        check::len(K, "dgn", dgn.len(), n)?;
        check::len(K, "g", g.len(), n)?;
        check::len(K, "w", w.len(), d_inner)?;
        check::len(K, "rstd", rstd.len(), rows)?;
        dy.check_each("dy", |what, have| check::len(K, what, have, n))?;
        check_gate_operands(K, y, z, ldz, n, &dz, rows, d_inner)?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let launch = warp_per_row(K, &self.f.gated_norm_bwd, rows);
        let [g_f32, g_bf16] = g.args();
        let [y_f32, y_bf16] = y.args();
        let [z_f32, z_bf16] = z.args();
        let [dz_f32, dz_bf16] = dz.args();
        let [dy_f32, dy_bf16] = dy.args();
        let mut args = [
            Arg::In(dgn),
            g_f32,
            g_bf16,
            Arg::In(w),
            Arg::In(rstd),
            y_f32,
            y_bf16,
            z_f32,
            z_bf16,
            Arg::Long("ldz", ldz),
            dy_f32,
            dy_bf16,
            dz_f32,
            dz_bf16,
            Arg::Long("rows", rows),
            Arg::Int("d_inner", d_inner),
        ];
        // SAFETY: matches mamba_gated_norm_bwd(const float* dgn, const float*
        // g, const unsigned short* g_h, const float* w, const float* rstd,
        // const float* y, const unsigned short* y_h, const float* z, const
        // unsigned short* z_h (one of each pair null: Stored), long long
        // ldz, float* dy, unsigned short* dy_h, float* dz, unsigned short*
        // dz_h (each null or checked: Store), long long M, int D); one warp
        // per row, rows < M only; extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }
    }
}

/// The launch of a warp-per-row kernel (the RMSNorms): [`ROWS_PER_BLOCK`]
/// rows a block of [`REDUCE_THREADS`] threads.
fn warp_per_row<'a>(kernel: &'static str, func: &'a CudaFunction, rows: usize) -> Launch<'a> {
    Launch {
        kernel,
        func,
        grid: Grid::Dims(rows.div_ceil(ROWS_PER_BLOCK), 1, 1),
        block: REDUCE_THREADS,
    }
}

/// The checks of the gate's backward operands, shared by its two kernels:
/// `y` and `dy` are `[rows, d_inner]`, `z` and `dz` `[rows, d_inner]` with
/// leading dimension `ldz`.
#[allow(clippy::too_many_arguments)]
fn check_gate_operands(
    kernel: &'static str,
    y: Stored<'_>,
    z: Stored<'_>,
    ldz: usize,
    dy_len: usize,
    dz: &Store<'_>,
    rows: usize,
    d_inner: usize,
) -> Result<(), KernelError> {
    let n = check::mul(kernel, "y", rows, d_inner)?;
    check::len(kernel, "y", y.len(), n)?;
    check::len(kernel, "dy", dy_len, n)?;
    check::matrix(kernel, "z", z.len(), rows, d_inner, ldz)?;
    dz.check_matrix(kernel, "dz", rows, d_inner, ldz)
}
