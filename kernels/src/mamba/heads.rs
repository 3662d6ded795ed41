//! Launchers of `mamba_ops.cu`'s per-head moves (Mamba-2): a value per head
//! broadcast to the head's channels, and the head's channels summed back
//! into one value, in a fixed order.
//!
//! Mamba-2 has one `dt`, `A` and `D` per head, shared by its `head_dim`
//! channels, while the selective scan of [`super::scan`] works per channel:
//! the CUDA Mamba-2 block broadcasts the per-head values to channels before
//! the scan and sums the per-channel gradients back per head after it. A
//! row of `groups * per` columns is `groups` column groups of `per`
//! consecutive columns. With `per = 1` both are strided copies between a
//! column block of a wider matrix and a matrix of its own.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut};

use super::check;
use super::launcher::{Arg, Grid, Launch, THREADS};
use super::{MambaKernels, Stored};
use crate::error::KernelError;

/// The extents of one per-head move: `rows` rows of `groups` groups of
/// `per` columns; the per-head side is `[rows, groups]` with leading
/// dimension `ld_heads`, the per-channel side `[rows, groups * per]` with
/// `ld_channels`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GroupShape {
    /// Rows (1 for a parameter vector).
    pub rows: usize,
    /// Column groups (heads).
    pub groups: usize,
    /// Columns per group (channels per head, or channels times states).
    pub per: usize,
    /// Leading dimension of the per-head matrix (at least `groups`).
    pub ld_heads: usize,
    /// Leading dimension of the per-channel matrix (at least `groups * per`).
    pub ld_channels: usize,
}

impl GroupShape {
    /// A dense shape: both sides without padding between rows.
    pub fn dense(rows: usize, groups: usize, per: usize) -> Self {
        GroupShape {
            rows,
            groups,
            per,
            ld_heads: groups,
            ld_channels: groups * per,
        }
    }

    /// Checks both sides' extents; returns `groups * per`, or `None` when
    /// there is nothing to do.
    fn check(
        &self,
        kernel: &'static str,
        heads: usize,
        channels: usize,
    ) -> Result<Option<usize>, KernelError> {
        if self.per == 0 {
            return Err(KernelError::invalid(
                kernel,
                "per is 0; a column group has at least one column",
            ));
        }
        let width = check::mul(kernel, "groups * per", self.groups, self.per)?;
        check::matrix(
            kernel,
            "per-head values",
            heads,
            self.rows,
            self.groups,
            self.ld_heads,
        )?;
        check::matrix(
            kernel,
            "per-channel values",
            channels,
            self.rows,
            width,
            self.ld_channels,
        )?;
        check::int(kernel, "groups * per", width)?;
        Ok((self.rows > 0 && width > 0).then_some(width))
    }
}

impl MambaKernels {
    /// `channels[m, g * per + p] = heads[m, g]` for every row `m`, group
    /// `g` and `p < per` (exact copies; `heads` kept in bf16 is widened,
    /// exactly).
    pub fn group_bcast(
        &self,
        stream: &CudaStream,
        heads: Stored<'_>,
        channels: &mut CudaViewMut<f32>,
        shape: GroupShape,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_group_bcast";
        self.check_stream(K, stream)?;
        let Some(width) = shape.check(K, heads.len(), channels.len())? else {
            return Ok(());
        };
        let launch = Launch {
            kernel: K,
            func: &self.f.group_bcast,
            grid: Grid::RowsByCols {
                rows: shape.rows,
                cols: width,
            },
            block: THREADS,
        };
        let [heads_f32, heads_bf16] = heads.args();
        let mut args = [
            heads_f32,
            heads_bf16,
            Arg::Long("ld_heads", shape.ld_heads),
            Arg::Out(channels),
            Arg::Long("ld_channels", shape.ld_channels),
            Arg::Int("groups", shape.groups),
            Arg::Int("per", shape.per),
        ];
        // SAFETY: matches mamba_group_bcast(const float* src, const unsigned
        // short* srch (one of the two null: Stored), long long lds, float*
        // dst, long long ldd, int G, int P); a thread reads src (or srch)[m *
        // lds + j / P] and writes dst[m * ldd + j] for m < rows, j < G * P,
        // both inside the matrices checked above (and the two buffers are
        // distinct borrows).
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// `heads[m, g] = channels[m, g * per] + channels[m, g * per + 1] + ...`,
    /// summed serially in ascending `p` (the bits depend on the values and
    /// `per` only: [`group_sum_host`] is the same sum).
    pub fn group_sum(
        &self,
        stream: &CudaStream,
        channels: &CudaView<f32>,
        heads: &mut CudaViewMut<f32>,
        shape: GroupShape,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_group_sum";
        self.check_stream(K, stream)?;
        let Some(_) = shape.check(K, heads.len(), channels.len())? else {
            return Ok(());
        };
        let launch = Launch {
            kernel: K,
            func: &self.f.group_sum,
            grid: Grid::RowsByCols {
                rows: shape.rows,
                cols: shape.groups,
            },
            block: THREADS,
        };
        let mut args = [
            Arg::In(channels),
            Arg::Long("ld_channels", shape.ld_channels),
            Arg::Out(heads),
            Arg::Long("ld_heads", shape.ld_heads),
            Arg::Int("groups", shape.groups),
            Arg::Int("per", shape.per),
        ];
        // SAFETY: matches mamba_group_sum(const float* src, long long lds,
        // float* dst, long long ldd, int G, int P); a thread reads src[m *
        // lds + g * P + p] for p < P and writes dst[m * ldd + g], m < rows,
        // g < G, inside the matrices checked above (per >= 1 is checked, and
        // G >= 1 here: a zero width returned early).
        unsafe { self.launch(stream, launch, &mut args) }
    }
}

/// The host twin of [`MambaKernels::group_sum`] on dense rows: the same
/// additions in the same order, so the same bits.
pub fn group_sum_host(channels: &[f32], rows: usize, groups: usize, per: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * groups);
    for r in 0..rows {
        for g in 0..groups {
            let s = &channels[(r * groups + g) * per..(r * groups + g + 1) * per];
            out.push(s.split_first().map_or(0.0, |(&first, rest)| {
                rest.iter().fold(first, |acc, &v| acc + v)
            }));
        }
    }
    out
}
