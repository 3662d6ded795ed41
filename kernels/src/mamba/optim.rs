//! Launchers of `kernels/cuda/mamba_optim.cu`: AdamW and the global gradient
//! norm's chunk sums, bit-identical to `mamba_train::optim` (the CPU optimizer) given the
//! same per-step constants.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut};

use super::check;
use super::launcher::{Arg, Grid, Launch};
use super::MambaKernels;
use crate::error::KernelError;

/// Elements per partial sum of the global norm. Must equal
/// `mamba_train::optim::clip::NORM_CHUNK` for the norm to have the CPU's bits.
pub const NORM_CHUNK: usize = 1 << 14;

/// Threads per block of the AdamW kernel, and its grid cap.
const ADAMW_THREADS: u32 = 256;
const ADAMW_MAX_BLOCKS: usize = 1 << 16;

/// The per-step constants of one AdamW update, computed on the host exactly
/// as the CPU optimizer computes them (bias corrections in f64, rounded to
/// f32), so that both sides apply the same arithmetic:
/// ```text
/// gi = g * scale;  m = b1 m + omb1 gi;  v = b2 v + (omb2 gi) gi
/// p = p * decay_factor                      (decayed ranges only)
/// p = p - step_size * (m / (sqrt(v) / bc2_sqrt + eps))
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWStep {
    pub b1: f32,
    pub b2: f32,
    /// `1 - b1` (rounded to f32 as the CPU does).
    pub omb1: f32,
    /// `1 - b2`.
    pub omb2: f32,
    pub eps: f32,
    /// `1 - lr * weight_decay`.
    pub decay_factor: f32,
    /// `(lr / (1 - b1^t))` in f64, rounded to f32.
    pub step_size: f32,
    /// `sqrt(1 - b2^t)` in f64, rounded to f32.
    pub bc2_sqrt: f32,
    /// Gradient multiplier (the clipping factor).
    pub scale: f32,
}

impl AdamWStep {
    /// The constants of update number `t` (1-based) with learning rate `lr`.
    pub fn new(
        beta1: f32,
        beta2: f32,
        eps: f32,
        weight_decay: f32,
        lr: f32,
        t: u64,
        scale: f32,
    ) -> AdamWStep {
        let ti = i32::try_from(t).unwrap_or(i32::MAX);
        let bc1 = 1.0 - (beta1 as f64).powi(ti);
        let bc2 = 1.0 - (beta2 as f64).powi(ti);
        AdamWStep {
            b1: beta1,
            b2: beta2,
            omb1: 1.0 - beta1,
            omb2: 1.0 - beta2,
            eps,
            decay_factor: 1.0 - lr * weight_decay,
            step_size: (lr as f64 / bc1) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            scale,
        }
    }
}

impl MambaKernels {
    /// One AdamW update of `n` elements, in place on `p`, `m`, `v`.
    /// Element `i` is decayed when `decay_starts[r] <= i < decay_ends[r]`
    /// for one of the `nranges` ranges (ascending, disjoint, within `n`;
    /// validate them on the host with [`check_decay_ranges`] before upload).
    #[allow(clippy::too_many_arguments)]
    pub fn adamw(
        &self,
        stream: &CudaStream,
        p: &mut CudaViewMut<f32>,
        g: &CudaView<f32>,
        m: &mut CudaViewMut<f32>,
        v: &mut CudaViewMut<f32>,
        n: usize,
        decay_starts: &CudaView<u64>,
        decay_ends: &CudaView<u64>,
        nranges: usize,
        step: &AdamWStep,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_adamw";
        self.check_stream(K, stream)?;
        for (what, have) in [
            ("p", p.len()),
            ("g", g.len()),
            ("m", m.len()),
            ("v", v.len()),
        ] {
            check::len(K, what, have, n)?;
        }
        check::len(K, "decay_starts", decay_starts.len(), nranges)?;
        check::len(K, "decay_ends", decay_ends.len(), nranges)?;
        if n == 0 {
            return Ok(());
        }
        let blocks = n.div_ceil(ADAMW_THREADS as usize).min(ADAMW_MAX_BLOCKS);
        let s = *step;
        let launch = Launch {
            kernel: K,
            func: &self.f.adamw,
            grid: Grid::Dims(blocks, 1, 1),
            block: ADAMW_THREADS,
        };
        let mut args = [
            Arg::Out(p),
            Arg::In(g),
            Arg::Out(m),
            Arg::Out(v),
            Arg::U64(n as u64),
            Arg::In(decay_starts),
            Arg::In(decay_ends),
            Arg::Int("nranges", nranges),
            Arg::F32(s.b1),
            Arg::F32(s.b2),
            Arg::F32(s.omb1),
            Arg::F32(s.omb2),
            Arg::F32(s.eps),
            Arg::F32(s.decay_factor),
            Arg::F32(s.step_size),
            Arg::F32(s.bc2_sqrt),
            Arg::F32(s.scale),
        ];
        // SAFETY: matches mamba_adamw(float* p, const float* g, float* m,
        // float* v, unsigned long long n, const unsigned long long* starts,
        // const unsigned long long* ends, int nranges, float x 9); the kernel
        // touches elements < n of p, g, m, v and entries < nranges of the
        // range arrays (checked above); range values are only compared.
        unsafe { self.launch(stream, launch, &mut args) }
    }

    /// Length of [`Self::grad_sumsq_chunks`]' output for `n` elements.
    pub fn grad_sumsq_chunks_len(n: usize) -> usize {
        n.div_ceil(NORM_CHUNK)
    }

    /// `partial[c] = sum of g[i]^2` over chunk `c` (elements `c *
    /// NORM_CHUNK .. min(n, (c + 1) * NORM_CHUNK)`), in f64 and serially in
    /// ascending `i`: the CPU's chunk sums bit for bit. The CPU's
    /// `global_norm` adds them in chunk order and takes the root, which is
    /// where the chunk sums go (the host), so the device has no second stage.
    pub fn grad_sumsq_chunks(
        &self,
        stream: &CudaStream,
        g: &CudaView<f32>,
        n: usize,
        partial: &mut CudaViewMut<f64>,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_sumsq_chunks";
        self.check_stream(K, stream)?;
        check::len(K, "g", g.len(), n)?;
        let chunks = Self::grad_sumsq_chunks_len(n);
        check::len(K, "partial", partial.len(), chunks)?;
        if chunks == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.f.sumsq_chunks,
            grid: Grid::Flat { n: chunks },
            block: 128,
        };
        let mut args = [
            Arg::In(g),
            Arg::U64(n as u64),
            Arg::U64(NORM_CHUNK as u64),
            Arg::Out(partial),
            Arg::U64(chunks as u64),
        ];
        // SAFETY: matches mamba_sumsq_chunks(const float* g, unsigned long
        // long n, unsigned long long chunk, double* partial, unsigned long
        // long nchunks); reads g[< n], writes partial[< chunks].
        unsafe { self.launch(stream, launch, &mut args) }
    }
}

/// Validate AdamW decay ranges for an arena of `n` elements: each range
/// non-empty, within `n`, ascending and disjoint.
pub fn check_decay_ranges(starts: &[u64], ends: &[u64], n: usize) -> Result<(), KernelError> {
    const K: &str = "mamba_adamw";
    if starts.len() != ends.len() {
        return Err(KernelError::invalid(
            K,
            format!("{} range starts but {} ends", starts.len(), ends.len()),
        ));
    }
    let mut prev_end = 0u64;
    for (i, (&s, &e)) in starts.iter().zip(ends).enumerate() {
        if s >= e || e > n as u64 || s < prev_end {
            return Err(KernelError::invalid(
                K,
                format!(
                    "decay range {i} is {s}..{e}; ranges must be non-empty, ascending, disjoint \
                     and within the arena of {n} elements"
                ),
            ));
        }
        prev_end = e;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn step_constants_follow_the_cpu_recipe() {
        let s = AdamWStep::new(0.9, 0.95, 1e-8, 0.1, 1e-3, 1, 0.5);
        assert_eq!(s.step_size, (1e-3f32 as f64 / (1.0 - 0.9f32 as f64)) as f32);
        assert_eq!(s.bc2_sqrt, ((1.0 - 0.95f32 as f64).sqrt()) as f32);
        assert_eq!(s.decay_factor, 1.0 - 1e-3f32 * 0.1);
        assert_eq!(s.omb1, 1.0 - 0.9f32);
        assert_eq!(s.scale, 0.5);
    }

    #[test]
    fn decay_ranges_are_validated() {
        assert!(check_decay_ranges(&[0, 5], &[3, 9], 9).is_ok());
        assert!(check_decay_ranges(&[], &[], 0).is_ok());
        assert!(check_decay_ranges(&[0, 2], &[3, 9], 9).is_err(), "overlap");
        assert!(check_decay_ranges(&[0], &[10], 9).is_err(), "past the end");
        assert!(check_decay_ranges(&[4], &[4], 9).is_err(), "empty");
        assert!(check_decay_ranges(&[0], &[], 9).is_err(), "unpaired");
    }
}
