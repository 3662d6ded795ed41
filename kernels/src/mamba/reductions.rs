//! Launchers of `kernels/cuda/mamba_ops.cu`'s fixed-order reductions:
//! column sums (two stages: slabs of [`COL_SLAB`] rows, then the slab sums
//! ascending), the partial-sum reduction they end with, the cross-entropy
//! and the mean loss. Formulas are in the `.cu` file.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut};

use super::check;
use super::launcher::{Arg, Grid, Launch};
use super::store::Stored;
use super::{MambaKernels, COL_SLAB};
use crate::error::KernelError;

/// Threads per block of the reduction kernels (`kReduceThreads`).
pub(crate) const REDUCE_THREADS: u32 = 256;

/// Block size of `mamba_reduce_partials`: one thread per column, so a small
/// block spreads a few hundred columns (a d_model-wide column sum) over
/// many SMs instead of a handful, each thread's serial sum waiting on its
/// own loads (the kernel is latency-bound; 256 a block ran the 145 calls
/// of a 130m step at ~13 us each, ncu 2026-12-02).
const PARTIALS_THREADS: u32 = 64;

/// A column sum over rows, `out[c] = sum_m term(m, c)`, evaluated in the
/// fixed two-stage order of [`MambaKernels::colsum`].
#[derive(Clone, Copy)]
pub enum ColSum<'a> {
    /// `a[m, c]`.
    Plain {
        a: &'a CudaView<'a, f32>,
        lda: usize,
    },
    /// `a[m, c] * b[m, c]` (each f32 or kept in bf16).
    Product {
        a: Stored<'a>,
        lda: usize,
        b: Stored<'a>,
        ldb: usize,
    },
    /// `a[m, c] * b[m, c] * row_scale[m]` (RMSNorm's weight gradient with
    /// `row_scale` = the saved 1/rms; `b` f32 or kept in bf16).
    ProductRowScaled {
        a: &'a CudaView<'a, f32>,
        lda: usize,
        b: Stored<'a>,
        ldb: usize,
        row_scale: &'a CudaView<'a, f32>,
    },
}

/// The loss's scale for a batch of `counted` targets, as
/// [`MambaKernels::cross_entropy`] and [`MambaKernels::loss_mean`] read it
/// from device memory: `[1 / counted, counted]` in f32 (`[0, 0]` when
/// nothing is counted). One function makes both values, so an eager pass
/// and a replayed graph see the same bits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScale(pub [f32; 2]);

impl LossScale {
    /// Floats of a scale buffer on the device.
    pub const LEN: usize = 2;

    /// The scale of `counted` counted targets.
    pub fn of(counted: usize) -> Self {
        if counted == 0 {
            return LossScale([0.0, 0.0]);
        }
        LossScale([1.0f32 / counted as f32, counted as f32])
    }
}

/// What [`MambaKernels::cross_entropy`] does with the gradient of the
/// logits.
pub enum LogitGrad<'b> {
    /// The loss only: the logits stay.
    None,
    /// The gradient over the logits, in place (f32).
    InPlace,
    /// The gradient rounded to bf16 into this `[rows, vocab]` buffer (what
    /// only a bf16 GEMM reads); the logits stay.
    Bf16(CudaViewMut<'b, u16>),
}

impl MambaKernels {
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
        // The operands a mode does not read are passed null.
        let (a, lda, b, rs, mode) = match sum {
            ColSum::Plain { a, lda } => (Stored::F32(a), lda, None, None, 0i32),
            ColSum::Product { a, lda, b, ldb } => (a, lda, Some((b, ldb)), None, 1),
            ColSum::ProductRowScaled {
                a,
                lda,
                b,
                ldb,
                row_scale,
            } => {
                check::len(K, "row_scale", row_scale.len(), rows)?;
                (Stored::F32(a), lda, Some((b, ldb)), Some(row_scale), 2)
            }
        };
        check::matrix(K, "a", a.len(), rows, cols, lda)?;
        if let Some((b, ldb)) = b {
            check::matrix(K, "b", b.len(), rows, cols, ldb)?;
        }
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
        let launch = Launch {
            kernel: K,
            func: &self.f.colsum_partial,
            grid: Grid::Dims(slabs, cols.div_ceil(32), 1),
            block: REDUCE_THREADS,
        };
        let [a_f32, a_bf16] = a.args();
        let ([b_f32, b_bf16], ldb) = match b {
            Some((b, ldb)) => (b.args(), ldb),
            None => ([Arg::Null, Arg::Null], 0),
        };
        let mut args = [
            a_f32,
            a_bf16,
            Arg::Long("lda", lda),
            b_f32,
            b_bf16,
            Arg::Long("ldb", ldb),
            rs.map_or(Arg::Null, |rs| Arg::In(rs)),
            Arg::I32(mode),
            Arg::Out(&mut *scratch),
            Arg::Long("rows", rows),
            Arg::Int("cols", cols),
        ];
        // SAFETY: matches mamba_colsum_partial(const float* a, const
        // unsigned short* a_h, long long lda, const float* b, const unsigned
        // short* b_h (one of each pair null: Stored), long long ldb, const
        // float* rs, int mode, float* part, long long M, int C); b and rs are
        // read only in the modes that checked them (else they are null).
        unsafe { self.launch(stream, launch, &mut args) }?;
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
        let launch = Launch {
            kernel: K,
            func: &self.f.reduce_partials,
            grid: Grid::Flat { n: ncols },
            block: PARTIALS_THREADS,
        };
        let mut args = [
            Arg::In(part),
            Arg::Int("nparts", nparts),
            Arg::Long("stride", stride),
            Arg::Long("col0", col0),
            Arg::Long("ncols", ncols),
            Arg::In(aux),
            Arg::I32(mode),
            Arg::Out(out),
        ];
        // SAFETY: matches mamba_reduce_partials(const float* part, int
        // nparts, long long stride, long long col0, long long ncols, const
        // float* aux, int mode, float* out); aux is read only in mode 1.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// Cross-entropy of `logits` (`[rows, vocab]`) against `targets` (one
    /// per row, `-100` = ignored). Per row: `row_loss[m] = logsumexp -
    /// logit[target]` (0 for ignored rows), and the gradient `(softmax -
    /// onehot) / counted` (0 for ignored rows) as `grad` says: none, over
    /// the logits in place, or rounded to bf16 into its own buffer (the
    /// bits a cast of the in-place values would give). `1 / counted` is
    /// read from `scale` on the device (a [`LossScale`], uploaded by the
    /// caller), so that a captured CUDA graph of the pass reads each
    /// batch's count rather than the one it was captured with.
    /// A target outside `[0, vocab)` other than `-100` must be refused by the
    /// caller before upload (the kernel would read outside the row).
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy(
        &self,
        stream: &CudaStream,
        logits: &mut CudaViewMut<f32>,
        targets: &CudaView<i32>,
        row_loss: &mut CudaViewMut<f32>,
        scale: &CudaView<f32>,
        rows: usize,
        vocab: usize,
        mut grad: LogitGrad<'_>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_ce_fwd_bwd";
        self.check_stream(K, stream)?;
        check::len(K, "scale", scale.len(), LossScale::LEN)?;
        check::len(
            K,
            "logits",
            logits.len(),
            check::mul(K, "logits", rows, vocab)?,
        )?;
        check::len(K, "targets", targets.len(), rows)?;
        check::len(K, "row_loss", row_loss.len(), rows)?;
        if let LogitGrad::Bf16(h) = &grad {
            check::len(
                K,
                "grad_bf16",
                h.len(),
                check::mul(K, "grad_bf16", rows, vocab)?,
            )?;
        }
        if rows == 0 {
            return Ok(());
        }
        if vocab == 0 {
            return Err(KernelError::invalid(K, "vocab is 0"));
        }
        let launch = Launch {
            kernel: K,
            func: &self.f.ce_fwd_bwd,
            grid: Grid::Dims(rows, 1, 1),
            block: REDUCE_THREADS,
        };
        let write_grad = !matches!(grad, LogitGrad::None);
        let grad_h = match &mut grad {
            LogitGrad::Bf16(h) => Arg::Out(h),
            LogitGrad::None | LogitGrad::InPlace => Arg::Null,
        };
        let mut args = [
            Arg::Out(logits),
            Arg::In(targets),
            Arg::Out(row_loss),
            grad_h,
            Arg::In(scale),
            Arg::Int("vocab", vocab),
            Arg::I32(write_grad as i32),
        ];
        // SAFETY: matches mamba_ce_fwd_bwd(float* logits, const int*
        // targets, float* row_loss, unsigned short* grad_h, const float*
        // scale, int V, int write_grad) (grad_h null or checked); extents checked
        // above, target values validated by the caller.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// `out[0] = (sum of row_loss[..rows]) / counted` (0 when `counted` is
    /// 0), in a fixed order (lane-strided serial sums, then a fixed tree);
    /// `counted` is read from `scale` on the device, as in
    /// [`Self::cross_entropy`].
    pub fn loss_mean(
        &self,
        stream: &CudaStream,
        row_loss: &CudaView<f32>,
        rows: usize,
        scale: &CudaView<f32>,
        out: &mut CudaViewMut<f32>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_loss_mean";
        self.check_stream(K, stream)?;
        check::len(K, "row_loss", row_loss.len(), rows)?;
        check::len(K, "scale", scale.len(), LossScale::LEN)?;
        check::len(K, "out", out.len(), 1)?;
        let launch = Launch {
            kernel: K,
            func: &self.f.loss_mean,
            grid: Grid::Dims(1, 1, 1),
            block: REDUCE_THREADS,
        };
        let mut args = [
            Arg::In(row_loss),
            Arg::Long("rows", rows),
            Arg::In(scale),
            Arg::Out(out),
        ];
        // SAFETY: matches mamba_loss_mean(const float* row_loss, long long M,
        // const float* scale, float* out); extents checked above.
        unsafe { self.launch(stream, launch, &mut args) }
    }
}
