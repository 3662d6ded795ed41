//! Launchers of `kernels/cuda/mamba_ops.cu`: embedding, RMSNorm, the causal
//! depthwise conv with SiLU, softplus of dt, the gate's backward, column
//! sums and the cross-entropy. Formulas are in the `.cu` file, next to the
//! code; each launcher documents its buffers and what it checks.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, PushKernelArg};

use super::check::{self, grid};
use super::{launched, MambaKernels, COL_SLAB};
use crate::error::KernelError;

/// Threads per block of the row/element kernels.
const THREADS: u32 = 128;
/// Threads per block of the reduction kernels (`kReduceThreads`).
const REDUCE_THREADS: u32 = 256;
/// Rows per block of the warp-per-row kernels (RMSNorm).
const ROWS_PER_BLOCK: usize = 8;
/// Largest conv width the conv weight-gradient kernel handles.
pub const MAX_CONV_WIDTH: usize = 8;

/// A column sum over rows, `out[c] = sum_m term(m, c)`, evaluated in the
/// fixed two-stage order of [`MambaKernels::colsum`].
#[derive(Clone, Copy)]
pub enum ColSum<'a> {
    /// `a[m, c]`.
    Plain {
        a: &'a CudaView<'a, f32>,
        lda: usize,
    },
    /// `a[m, c] * b[m, c]`.
    Product {
        a: &'a CudaView<'a, f32>,
        lda: usize,
        b: &'a CudaView<'a, f32>,
        ldb: usize,
    },
    /// `a[m, c] * b[m, c] * row_scale[m]` (RMSNorm's weight gradient with
    /// `row_scale` = the saved 1/rms).
    ProductRowScaled {
        a: &'a CudaView<'a, f32>,
        lda: usize,
        b: &'a CudaView<'a, f32>,
        ldb: usize,
        row_scale: &'a CudaView<'a, f32>,
    },
}

/// The positions of every distinct token of a batch, for the embedding's
/// deterministic scatter-add: distinct tokens ascending, and for each its
/// positions ascending (a counting sort of the token ids; built on the host,
/// where the batch lives).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenCsr {
    /// Distinct token ids, ascending.
    pub uniq: Vec<u32>,
    /// `pos[row_ptr[u]..row_ptr[u + 1]]` are the positions of `uniq[u]`.
    pub row_ptr: Vec<u32>,
    /// Row indices into the `[rows, d]` activation, grouped by token.
    pub pos: Vec<u32>,
    vocab: usize,
}

impl TokenCsr {
    /// Group `tokens` by id; every id must be `< vocab`.
    pub fn build(tokens: &[u32], vocab: usize) -> Result<TokenCsr, KernelError> {
        const NAME: &str = "TokenCsr::build";
        if u32::try_from(tokens.len()).is_err() {
            return Err(KernelError::invalid(
                NAME,
                format!("{} tokens; at most {} per batch", tokens.len(), u32::MAX),
            ));
        }
        let mut counts = vec![0u32; vocab];
        for (i, &t) in tokens.iter().enumerate() {
            match counts.get_mut(t as usize) {
                Some(c) => *c += 1,
                None => {
                    return Err(KernelError::invalid(
                        NAME,
                        format!(
                            "token {t} at position {i} is not below the vocabulary size {vocab}"
                        ),
                    ))
                }
            }
        }
        let mut uniq = Vec::new();
        let mut row_ptr = vec![0u32];
        let mut start = vec![0u32; vocab];
        let mut next = 0u32;
        for (v, &c) in counts.iter().enumerate() {
            if c > 0 {
                uniq.push(v as u32);
                start[v] = next;
                next += c;
                row_ptr.push(next);
            }
        }
        let mut pos = vec![0u32; tokens.len()];
        for (i, &t) in tokens.iter().enumerate() {
            let s = &mut start[t as usize];
            pos[*s as usize] = i as u32;
            *s += 1;
        }
        Ok(TokenCsr {
            uniq,
            row_ptr,
            pos,
            vocab,
        })
    }

    /// Copy to the device (asynchronous on `stream`).
    pub fn upload(&self, stream: &Arc<CudaStream>) -> Result<DeviceTokenCsr, KernelError> {
        let up = |v: &[u32], what: &str| {
            // An empty upload would be a zero-byte allocation; keep one
            // element so every buffer is a real allocation.
            let data = if v.is_empty() { &[0u32][..] } else { v };
            stream
                .clone_htod(data)
                .map_err(|e| KernelError::driver(format!("uploading the token CSR's {what}"), e))
        };
        Ok(DeviceTokenCsr {
            uniq: up(&self.uniq, "distinct tokens")?,
            row_ptr: up(&self.row_ptr, "row pointers")?,
            pos: up(&self.pos, "positions")?,
            distinct: self.uniq.len(),
            positions: self.pos.len(),
            vocab: self.vocab,
        })
    }
}

/// A [`TokenCsr`] on the device. Only [`TokenCsr::upload`] makes one, so its
/// contents are known valid: every token `< vocab`, every position `<
/// positions`.
#[derive(Debug)]
pub struct DeviceTokenCsr {
    uniq: CudaSlice<u32>,
    row_ptr: CudaSlice<u32>,
    pos: CudaSlice<u32>,
    distinct: usize,
    positions: usize,
    vocab: usize,
}

impl DeviceTokenCsr {
    /// Number of distinct tokens.
    pub fn distinct(&self) -> usize {
        self.distinct
    }
    /// Number of positions (the batch's token count).
    pub fn positions(&self) -> usize {
        self.positions
    }
}

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
        let cfg = grid(K, (rows, d.div_ceil(THREADS as usize), 1), THREADS)?;
        let (di, vi) = (check::int(K, "d", d)?, check::int(K, "vocab", vocab)?);
        let mut b = stream.launch_builder(&self.f.embed_fwd);
        b.arg(tokens).arg(emb).arg(h).arg(&di).arg(&vi);
        // SAFETY: matches mamba_embed_fwd(const unsigned*, const float*,
        // float*, int d, int vocab); reads tokens[< rows], emb rows < vocab
        // (guarded in the kernel), writes h[< rows * d].
        launched(K, unsafe { b.launch(cfg) })
    }

    /// `demb[v, :] += sum of dh[p, :]` over the positions `p` of each
    /// distinct token `v` of `csr`, in ascending `p` (one owner per row: no
    /// atomics). `dh` is `[csr.positions(), d]`, `demb` `[vocab, d]`.
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
        if csr.distinct == 0 || d == 0 {
            return Ok(());
        }
        let cfg = grid(K, (csr.distinct, d.div_ceil(THREADS as usize), 1), THREADS)?;
        let di = check::int(K, "d", d)?;
        let mut b = stream.launch_builder(&self.f.embed_bwd);
        b.arg(&csr.uniq)
            .arg(&csr.row_ptr)
            .arg(&csr.pos)
            .arg(dh)
            .arg(demb)
            .arg(&di);
        // SAFETY: matches mamba_embed_bwd(const unsigned* uniq, const
        // unsigned* row_ptr, const unsigned* pos, const float* dh, float*
        // demb, int d); DeviceTokenCsr guarantees tokens < vocab and
        // positions < csr.positions, checked against demb and dh above.
        launched(K, unsafe { b.launch(cfg) })
    }

    /// RMSNorm forward over `rows` rows of width `d`: `y = w * (x * r)`,
    /// `r = 1/sqrt(mean(x^2) + eps)`, saving `rstd[m] = r`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_fwd(
        &self,
        stream: &CudaStream,
        x: &CudaView<f32>,
        w: &CudaView<f32>,
        y: &mut CudaViewMut<f32>,
        rstd: &mut CudaViewMut<f32>,
        rows: usize,
        d: usize,
        eps: f32,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_rmsnorm_fwd";
        self.check_stream(K, stream)?;
        let n = check::mul(K, "x", rows, d)?;
        check::len(K, "x", x.len(), n)?;
        check::len(K, "y", y.len(), n)?;
        check::len(K, "w", w.len(), d)?;
        check::len(K, "rstd", rstd.len(), rows)?;
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let cfg = grid(K, (rows.div_ceil(ROWS_PER_BLOCK), 1, 1), REDUCE_THREADS)?;
        let (m, di) = (check::long(K, "rows", rows)?, check::int(K, "d", d)?);
        let mut b = stream.launch_builder(&self.f.rmsnorm_fwd);
        b.arg(x).arg(w).arg(y).arg(rstd).arg(&m).arg(&di).arg(&eps);
        // SAFETY: matches mamba_rmsnorm_fwd(const float* x, const float* w,
        // float* y, float* rstd, long long M, int d, float eps); all extents
        // checked above.
        launched(K, unsafe { b.launch(cfg) })
    }

    /// RMSNorm backward: `dx = r w dy - x r^3 (sum_k dy_k w_k x_k) / d`,
    /// written to `dx` or, with `accumulate`, added to it (the residual
    /// stream's gradient). The weight gradient is a [`ColSum::ProductRowScaled`]
    /// of `dy`, `x` and `rstd`.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bwd(
        &self,
        stream: &CudaStream,
        dy: &CudaView<f32>,
        x: &CudaView<f32>,
        w: &CudaView<f32>,
        rstd: &CudaView<f32>,
        dx: &mut CudaViewMut<f32>,
        rows: usize,
        d: usize,
        accumulate: bool,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_rmsnorm_bwd";
        self.check_stream(K, stream)?;
        let n = check::mul(K, "x", rows, d)?;
        check::len(K, "dy", dy.len(), n)?;
        check::len(K, "x", x.len(), n)?;
        check::len(K, "dx", dx.len(), n)?;
        check::len(K, "w", w.len(), d)?;
        check::len(K, "rstd", rstd.len(), rows)?;
        if rows == 0 || d == 0 {
            return Ok(());
        }
        let cfg = grid(K, (rows.div_ceil(ROWS_PER_BLOCK), 1, 1), REDUCE_THREADS)?;
        let (m, di, acc) = (
            check::long(K, "rows", rows)?,
            check::int(K, "d", d)?,
            accumulate as i32,
        );
        let mut b = stream.launch_builder(&self.f.rmsnorm_bwd);
        b.arg(dy)
            .arg(x)
            .arg(w)
            .arg(rstd)
            .arg(dx)
            .arg(&m)
            .arg(&di)
            .arg(&acc);
        // SAFETY: matches mamba_rmsnorm_bwd(const float* dy, const float* x,
        // const float* w, const float* rstd, float* dx, long long M, int d,
        // int accumulate); extents checked above.
        launched(K, unsafe { b.launch(cfg) })
    }

    /// `u = SiLU(conv(x))`: causal depthwise conv of width `k` with bias
    /// over each sequence of `seq_len` rows; `x` is `[rows, d_inner]` with
    /// leading dimension `ldx` (the first half of in_proj's output), `w` is
    /// `[d_inner, 1, k]`, `u` is `[rows, d_inner]`.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_fwd(
        &self,
        stream: &CudaStream,
        x: &CudaView<f32>,
        ldx: usize,
        w: &CudaView<f32>,
        bias: &CudaView<f32>,
        u: &mut CudaViewMut<f32>,
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
            u,
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
        x: &CudaView<f32>,
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
            g,
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
        x: &CudaView<f32>,
        ldx: usize,
        w: &CudaView<f32>,
        bias: &CudaView<f32>,
        out: &mut CudaViewMut<f32>,
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
        check::len(
            kernel,
            out_name,
            out.len(),
            check::mul(kernel, out_name, rows, d_inner)?,
        )?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let cfg = grid(
            kernel,
            (rows, d_inner.div_ceil(THREADS as usize), 1),
            THREADS,
        )?;
        let (ld, t, dd, kk) = (
            check::long(kernel, "ldx", ldx)?,
            check::int(kernel, "seq_len", seq_len)?,
            check::int(kernel, "d_inner", d_inner)?,
            check::int(kernel, "k", k)?,
        );
        let mut b = stream.launch_builder(func);
        b.arg(x)
            .arg(&ld)
            .arg(w)
            .arg(bias)
            .arg(out)
            .arg(&t)
            .arg(&dd)
            .arg(&kk);
        // SAFETY: `func` is mamba_conv_fwd or mamba_conv_bwd_pre (the callers
        // pass the one `kernel` names); both are (const float* x, long long
        // ldx, const float* w, const float* bias, float* out, int T, int D,
        // int K); rows are a whole number of sequences, reads stay inside
        // the sequence, extents checked above.
        launched(kernel, unsafe { b.launch(cfg) })
    }

    /// `dx[b, t, c] = sum_k w[c, k] dpre[b, t + k_max - k, c]` (inside the
    /// sequence), written to `dx` (leading dimension `ldo`; the first half
    /// of in_proj's output gradient).
    #[allow(clippy::too_many_arguments)]
    pub fn conv_bwd_dx(
        &self,
        stream: &CudaStream,
        dpre: &CudaView<f32>,
        w: &CudaView<f32>,
        dx: &mut CudaViewMut<f32>,
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
        check::matrix(K, "dx", dx.len(), rows, d_inner, ldo)?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let cfg = grid(K, (rows, d_inner.div_ceil(THREADS as usize), 1), THREADS)?;
        let (ld, t, dd, kk) = (
            check::long(K, "ldo", ldo)?,
            check::int(K, "seq_len", seq_len)?,
            check::int(K, "d_inner", d_inner)?,
            check::int(K, "k", k)?,
        );
        let mut b = stream.launch_builder(&self.f.conv_bwd_dx);
        b.arg(dpre)
            .arg(w)
            .arg(dx)
            .arg(&ld)
            .arg(&t)
            .arg(&dd)
            .arg(&kk);
        // SAFETY: matches mamba_conv_bwd_dx(const float* dpre, const float*
        // w, float* dx, long long ldo, int T, int D, int K); extents checked.
        launched(K, unsafe { b.launch(cfg) })
    }

    /// Partial buffer length [`Self::conv_wgrad`] needs.
    pub fn conv_wgrad_scratch_len(rows: usize, d_inner: usize, k: usize) -> usize {
        rows.div_ceil(COL_SLAB) * (d_inner * k + d_inner)
    }

    /// The conv's weight and bias gradients: `dw[c, k] = sum_m dpre[m, c]
    /// x[m - k_max + k, c]` and `db[c] = sum_m dpre[m, c]`, each a fixed
    /// two-stage sum (slabs of [`COL_SLAB`] rows, then slabs ascending).
    /// `scratch` holds [`Self::conv_wgrad_scratch_len`] elements.
    #[allow(clippy::too_many_arguments)]
    pub fn conv_wgrad(
        &self,
        stream: &CudaStream,
        dpre: &CudaView<f32>,
        x: &CudaView<f32>,
        ldx: usize,
        scratch: &mut CudaViewMut<f32>,
        dw: &mut CudaViewMut<f32>,
        db: &mut CudaViewMut<f32>,
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
        check::len(K, "dw", dw.len(), d_inner * k)?;
        check::len(K, "db", db.len(), d_inner)?;
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
        let cfg = grid(K, (slabs, d_inner.div_ceil(32), 1), REDUCE_THREADS)?;
        let (ld, m, t, dd, kk) = (
            check::long(K, "ldx", ldx)?,
            check::long(K, "rows", rows)?,
            check::int(K, "seq_len", seq_len)?,
            check::int(K, "d_inner", d_inner)?,
            check::int(K, "k", k)?,
        );
        let mut b = stream.launch_builder(&self.f.conv_wgrad_partial);
        b.arg(dpre)
            .arg(x)
            .arg(&ld)
            .arg(&mut *scratch)
            .arg(&m)
            .arg(&t)
            .arg(&dd)
            .arg(&kk);
        // SAFETY: matches mamba_conv_wgrad_partial(const float* dpre, const
        // float* x, long long ldx, float* part, long long M, int T, int D,
        // int K); writes part[< slabs * stride], extents checked above.
        launched(K, unsafe { b.launch(cfg) })?;
        let part = scratch.as_view();
        self.reduce_partials(stream, &part, slabs, stride, 0, d_inner * k, None, dw)?;
        self.reduce_partials(stream, &part, slabs, stride, d_inner * k, d_inner, None, db)
    }

    /// `dt <- softplus(dt + bias[c])` in place over `[rows, d_inner]`
    /// (torch's softplus: threshold 20).
    pub fn dt_softplus(
        &self,
        stream: &CudaStream,
        dt: &mut CudaViewMut<f32>,
        bias: &CudaView<f32>,
        rows: usize,
        d_inner: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_dt_softplus";
        self.check_stream(K, stream)?;
        check::len(K, "dt", dt.len(), check::mul(K, "dt", rows, d_inner)?)?;
        check::len(K, "bias", bias.len(), d_inner)?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let cfg = grid(K, (rows, d_inner.div_ceil(THREADS as usize), 1), THREADS)?;
        let dd = check::int(K, "d_inner", d_inner)?;
        let mut b = stream.launch_builder(&self.f.dt_softplus);
        b.arg(dt).arg(bias).arg(&dd);
        // SAFETY: matches mamba_dt_softplus(float* dt, const float* bias, int
        // D); extents checked above.
        launched(K, unsafe { b.launch(cfg) })
    }

    /// Backward of `out = y * SiLU(z)`: `dy = dout SiLU(z)` (`[rows,
    /// d_inner]`) and `dz = dout y SiLU'(z)`; `z` and `dz` have leading
    /// dimension `ldz` (the second half of in_proj's output / its gradient).
    #[allow(clippy::too_many_arguments)]
    pub fn gate_bwd(
        &self,
        stream: &CudaStream,
        dout: &CudaView<f32>,
        y: &CudaView<f32>,
        z: &CudaView<f32>,
        ldz: usize,
        dy: &mut CudaViewMut<f32>,
        dz: &mut CudaViewMut<f32>,
        rows: usize,
        d_inner: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_gate_bwd";
        self.check_stream(K, stream)?;
        let n = check::mul(K, "dout", rows, d_inner)?;
        check::len(K, "dout", dout.len(), n)?;
        check::len(K, "y", y.len(), n)?;
        check::len(K, "dy", dy.len(), n)?;
        check::matrix(K, "z", z.len(), rows, d_inner, ldz)?;
        check::matrix(K, "dz", dz.len(), rows, d_inner, ldz)?;
        if rows == 0 || d_inner == 0 {
            return Ok(());
        }
        let cfg = grid(K, (rows, d_inner.div_ceil(THREADS as usize), 1), THREADS)?;
        let (ld, dd) = (
            check::long(K, "ldz", ldz)?,
            check::int(K, "d_inner", d_inner)?,
        );
        let mut b = stream.launch_builder(&self.f.gate_bwd);
        b.arg(dout).arg(y).arg(z).arg(&ld).arg(dy).arg(dz).arg(&dd);
        // SAFETY: matches mamba_gate_bwd(const float* dout, const float* y,
        // const float* z, long long ldz, float* dy, float* dz, int D);
        // extents checked above.
        launched(K, unsafe { b.launch(cfg) })
    }

    /// Partial buffer length [`Self::colsum`] needs.
    pub fn colsum_scratch_len(rows: usize, cols: usize) -> usize {
        rows.div_ceil(COL_SLAB) * cols
    }

    /// `out[c] = sum over rows of sum's term` for `c < cols`, in a fixed
    /// order: each slab of [`COL_SLAB`] rows is summed by one block (8 row
    /// lanes in order, then a fixed tree over the lanes), then the slab sums
    /// are added in ascending order. `scratch` holds
    /// [`Self::colsum_scratch_len`] elements.
    pub fn colsum(
        &self,
        stream: &CudaStream,
        sum: ColSum<'_>,
        rows: usize,
        cols: usize,
        scratch: &mut CudaViewMut<f32>,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_colsum_partial";
        self.check_stream(K, stream)?;
        let (a, lda, b, ldb, rs, mode) = match sum {
            ColSum::Plain { a, lda } => (a, lda, a, lda, a, 0i32),
            ColSum::Product { a, lda, b, ldb } => (a, lda, b, ldb, a, 1),
            ColSum::ProductRowScaled {
                a,
                lda,
                b,
                ldb,
                row_scale,
            } => {
                check::len(K, "row_scale", row_scale.len(), rows)?;
                (a, lda, b, ldb, row_scale, 2)
            }
        };
        check::matrix(K, "a", a.len(), rows, cols, lda)?;
        check::matrix(K, "b", b.len(), rows, cols, ldb)?;
        check::len(
            K,
            "scratch",
            scratch.len(),
            Self::colsum_scratch_len(rows, cols),
        )?;
        check::len(K, "out", out.len(), cols)?;
        if cols == 0 {
            return Ok(());
        }
        if rows == 0 {
            return Err(KernelError::invalid(K, "no rows to sum"));
        }
        let slabs = rows.div_ceil(COL_SLAB);
        let cfg = grid(K, (slabs, cols.div_ceil(32), 1), REDUCE_THREADS)?;
        let (la, lb, m, c) = (
            check::long(K, "lda", lda)?,
            check::long(K, "ldb", ldb)?,
            check::long(K, "rows", rows)?,
            check::int(K, "cols", cols)?,
        );
        let mut l = stream.launch_builder(&self.f.colsum_partial);
        l.arg(a)
            .arg(&la)
            .arg(b)
            .arg(&lb)
            .arg(rs)
            .arg(&mode)
            .arg(&mut *scratch)
            .arg(&m)
            .arg(&c);
        // SAFETY: matches mamba_colsum_partial(const float* a, long long lda,
        // const float* b, long long ldb, const float* rs, int mode, float*
        // part, long long M, int C); b and rs are read only in the modes
        // that checked them (else they alias a, which is only read).
        launched(K, unsafe { l.launch(cfg) })?;
        self.reduce_partials(stream, &scratch.as_view(), slabs, cols, 0, cols, None, out)
    }

    /// `out[j] = part[0][col0 + j] + part[1][col0 + j] + ...` (rows of
    /// `part` `stride` apart, summed in ascending order) for `j < ncols`;
    /// with `neg_exp_of = Some(a_log)` the sum is multiplied by
    /// `-exp(a_log[j])` (the chain rule through `A = -exp(A_log)`).
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_partials(
        &self,
        stream: &CudaStream,
        part: &CudaView<f32>,
        nparts: usize,
        stride: usize,
        col0: usize,
        ncols: usize,
        neg_exp_of: Option<&CudaView<f32>>,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_reduce_partials";
        self.check_stream(K, stream)?;
        if col0 + ncols > stride && nparts > 1 {
            return Err(KernelError::invalid(
                K,
                format!(
                    "columns {col0}..{} exceed the partial stride {stride}",
                    col0 + ncols
                ),
            ));
        }
        if nparts > 0 {
            let need = check::mul(K, "part", nparts - 1, stride)? + col0 + ncols;
            check::len(K, "part", part.len(), need)?;
        }
        check::len(K, "out", out.len(), ncols)?;
        let (aux, mode) = match neg_exp_of {
            Some(a) => {
                check::len(K, "a_log", a.len(), ncols)?;
                (a, 1i32)
            }
            None => (part, 0),
        };
        if ncols == 0 {
            return Ok(());
        }
        let cfg = grid(
            K,
            (ncols.div_ceil(REDUCE_THREADS as usize), 1, 1),
            REDUCE_THREADS,
        )?;
        let (np, st, c0, nc) = (
            check::int(K, "nparts", nparts)?,
            check::long(K, "stride", stride)?,
            check::long(K, "col0", col0)?,
            check::long(K, "ncols", ncols)?,
        );
        let mut b = stream.launch_builder(&self.f.reduce_partials);
        b.arg(part)
            .arg(&np)
            .arg(&st)
            .arg(&c0)
            .arg(&nc)
            .arg(aux)
            .arg(&mode)
            .arg(out);
        // SAFETY: matches mamba_reduce_partials(const float* part, int
        // nparts, long long stride, long long col0, long long ncols, const
        // float* aux, int mode, float* out); aux is read only in mode 1.
        launched(K, unsafe { b.launch(cfg) })
    }

    /// Cross-entropy of `logits` (`[rows, vocab]`) against `targets` (one
    /// per row, `-100` = ignored). Per row: `row_loss[m] = logsumexp -
    /// logit[target]` (0 for ignored rows); with `write_grad`, the row
    /// becomes `(softmax - onehot) / counted` (0 for ignored rows), in place.
    /// A target outside `[0, vocab)` other than `-100` must be refused by the
    /// caller before upload (the kernel would read outside the row).
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy(
        &self,
        stream: &CudaStream,
        logits: &mut CudaViewMut<f32>,
        targets: &CudaView<i32>,
        row_loss: &mut CudaViewMut<f32>,
        counted: usize,
        rows: usize,
        vocab: usize,
        write_grad: bool,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_ce_fwd_bwd";
        self.check_stream(K, stream)?;
        check::len(
            K,
            "logits",
            logits.len(),
            check::mul(K, "logits", rows, vocab)?,
        )?;
        check::len(K, "targets", targets.len(), rows)?;
        check::len(K, "row_loss", row_loss.len(), rows)?;
        if rows == 0 {
            return Ok(());
        }
        if vocab == 0 {
            return Err(KernelError::invalid(K, "vocab is 0"));
        }
        let cfg = grid(K, (rows, 1, 1), REDUCE_THREADS)?;
        let inv = if counted > 0 {
            1.0f32 / counted as f32
        } else {
            0.0
        };
        let (v, wg) = (check::int(K, "vocab", vocab)?, write_grad as i32);
        let mut b = stream.launch_builder(&self.f.ce_fwd_bwd);
        b.arg(logits)
            .arg(targets)
            .arg(row_loss)
            .arg(&inv)
            .arg(&v)
            .arg(&wg);
        // SAFETY: matches mamba_ce_fwd_bwd(float* logits, const int*
        // targets, float* row_loss, float inv_count, int V, int write_grad);
        // extents checked above, target values validated by the caller.
        launched(K, unsafe { b.launch(cfg) })
    }

    /// `out[0] = (sum of row_loss[..rows]) / counted` (0 when `counted` is
    /// 0), in a fixed order (lane-strided serial sums, then a fixed tree).
    pub fn loss_mean(
        &self,
        stream: &CudaStream,
        row_loss: &CudaView<f32>,
        rows: usize,
        counted: usize,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_loss_mean";
        self.check_stream(K, stream)?;
        check::len(K, "row_loss", row_loss.len(), rows)?;
        check::len(K, "out", out.len(), 1)?;
        let cfg = grid(K, (1, 1, 1), REDUCE_THREADS)?;
        let (m, c) = (check::long(K, "rows", rows)?, counted as f32);
        let mut b = stream.launch_builder(&self.f.loss_mean);
        b.arg(row_loss).arg(&m).arg(&c).arg(out);
        // SAFETY: matches mamba_loss_mean(const float* row_loss, long long M,
        // float count, float* out); extents checked above.
        launched(K, unsafe { b.launch(cfg) })
    }
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
    use proptest::prelude::*;

    #[test]
    fn csr_groups_positions_by_token_in_order() {
        let csr = TokenCsr::build(&[3, 1, 3, 0, 1, 3], 5).unwrap();
        assert_eq!(csr.uniq, vec![0, 1, 3]);
        assert_eq!(csr.row_ptr, vec![0, 1, 3, 6]);
        assert_eq!(csr.pos, vec![3, 1, 4, 0, 2, 5]);
        let e = TokenCsr::build(&[0, 5], 5).unwrap_err().to_string();
        assert!(
            e.contains("token 5 at position 1") && e.contains("vocabulary size 5"),
            "{e}"
        );
        let empty = TokenCsr::build(&[], 5).unwrap();
        assert!(empty.uniq.is_empty() && empty.pos.is_empty() && empty.row_ptr == vec![0]);
    }

    proptest! {
        #[test]
        fn csr_is_a_stable_grouping(tokens in proptest::collection::vec(0u32..17, 0..200)) {
            let csr = TokenCsr::build(&tokens, 17).unwrap();
            prop_assert_eq!(csr.pos.len(), tokens.len());
            prop_assert_eq!(csr.row_ptr.len(), csr.uniq.len() + 1);
            prop_assert!(csr.uniq.windows(2).all(|w| w[0] < w[1]));
            for (u, &v) in csr.uniq.iter().enumerate() {
                let group = &csr.pos[csr.row_ptr[u] as usize..csr.row_ptr[u + 1] as usize];
                prop_assert!(!group.is_empty());
                prop_assert!(group.windows(2).all(|w| w[0] < w[1]), "ascending positions");
                let want: Vec<u32> = (0..tokens.len() as u32).filter(|&i| tokens[i as usize] == v).collect();
                prop_assert_eq!(group, &want[..]);
            }
        }
    }

    #[test]
    fn conv_shape_errors_say_what_is_expected() {
        let e = conv_checks("k", 10, 4, 4).unwrap_err().to_string();
        assert!(e.contains("not a whole number of sequences"), "{e}");
        let e = conv_checks("k", 8, 4, 9).unwrap_err().to_string();
        assert!(e.contains("1..=8"), "{e}");
        assert!(conv_checks("k", 8, 4, 4).is_ok());
    }
}
