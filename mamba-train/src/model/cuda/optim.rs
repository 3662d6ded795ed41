//! The optimizer's arithmetic on the device ([`ArenaMath`] for
//! [`CudaModel`]), bit-identical to the CPU's ([`crate::optim::HostMath`]):
//! the same global-norm association (f64 chunks of `NORM_CHUNK`, summed in
//! order) and the same per-element AdamW arithmetic with the same per-step
//! constants ([`AdamWStep`], computed on the host by the one optimizer).
//! Their file (`mamba_optim.cu`) is built with `--fmad=false` for exactly
//! this contract (the `--fmad` table in `kernels/README.md`).
//!
//! Both operations take a shard of the arena (ZeRO-1): they run the same
//! kernels over views into the whole arenas (`grads[shard]`,
//! `params[shard]`), the norm shard starting on a chunk boundary so its
//! chunk sums are the arena's, the decay ranges shifted to the shard. No
//! kernel knows about shards.
//!
//! Scratch ([`OptimScratch`]: the norm partials, the decay ranges) is
//! allocated on first use and kept with the model; the ranges are uploaded
//! again only if the optimizer passes other ones.

use std::ops::Range;

use cudarc::driver::CudaSlice;
use kernels::mamba::{check_decay_ranges, AdamWStep, MambaKernels, NORM_CHUNK};

use super::{cuda, CudaModel};
use crate::error::{Result, TrainError};
use crate::optim::math::{check_norm_shard, decayed_within};
use crate::optim::ArenaMath;

/// Device scratch of the optimizer's kernels.
pub(crate) struct OptimScratch {
    norm_part: CudaSlice<f64>,
    /// The decay ranges as uploaded, to detect a change.
    ranges: Vec<Range<usize>>,
    starts: CudaSlice<u64>,
    ends: CudaSlice<u64>,
}

impl CudaModel {
    /// The optimizer scratch, with `ranges` (within `0..within`) uploaded
    /// (allocated or re-uploaded only when needed).
    fn optim_scratch(
        &mut self,
        ranges: Option<&[Range<usize>]>,
        within: usize,
    ) -> Result<&mut OptimScratch> {
        let n = self.layout.len();
        let s = self.engine.stream.clone();
        let upload = |r: &[Range<usize>]| -> Result<(CudaSlice<u64>, CudaSlice<u64>)> {
            let starts: Vec<u64> = r.iter().map(|r| r.start as u64).collect();
            let ends: Vec<u64> = r.iter().map(|r| r.end as u64).collect();
            check_decay_ranges(&starts, &ends, within)?;
            // A zero-length device buffer cannot be allocated: pad with one
            // entry the kernel never reads (it reads `nranges` entries).
            let pad = |x: Vec<u64>| if x.is_empty() { vec![0] } else { x };
            Ok((
                s.clone_htod(&pad(starts))
                    .map_err(|e| cuda("uploading the decay ranges", e))?,
                s.clone_htod(&pad(ends))
                    .map_err(|e| cuda("uploading the decay ranges", e))?,
            ))
        };
        if self.optim.is_none() {
            let (starts, ends) = upload(ranges.unwrap_or(&[]))?;
            self.optim = Some(OptimScratch {
                norm_part: s
                    .alloc_zeros::<f64>(MambaKernels::grad_sumsq_chunks_len(n).max(1))
                    .map_err(|e| cuda("allocating the norm partials", e))?,
                ranges: ranges.unwrap_or(&[]).to_vec(),
                starts,
                ends,
            });
        }
        let scratch = self
            .optim
            .as_mut()
            .ok_or_else(|| cuda("preparing the optimizer scratch", "it was not built"))?;
        if let Some(r) = ranges.filter(|r| *r != scratch.ranges.as_slice()) {
            let (starts, ends) = upload(r)?;
            scratch.starts = starts;
            scratch.ends = ends;
            scratch.ranges = r.to_vec();
        }
        Ok(scratch)
    }

    fn check_len(&self, what: &str, len: usize) -> Result<()> {
        let n = self.layout.len();
        if len != n {
            return Err(TrainError::Config(format!(
                "{what} has {len} elements; the optimizer state has {n}"
            )));
        }
        Ok(())
    }
}

impl ArenaMath for CudaModel {
    type Arena = CudaSlice<f32>;

    /// The CPU's chunk sums bit for bit: the chunk kernel over
    /// `grads[shard]` (which starts on a chunk boundary, so its chunks are
    /// the arena's), the sums downloaded in chunk order. Synchronizes the
    /// stream.
    fn norm_partials(&mut self, grads: &CudaSlice<f32>, shard: Range<usize>) -> Result<Vec<f64>> {
        self.check_len("grads", grads.len())?;
        let n = self.layout.len();
        check_norm_shard(&shard, n)?;
        let chunks = shard.len().div_ceil(NORM_CHUNK);
        if chunks == 0 {
            return Ok(Vec::new());
        }
        let (stream, kernels) = (self.engine.stream.clone(), self.engine.kernels.clone());
        let sc = self.optim_scratch(None, n)?;
        let mut part = sc.norm_part.slice_mut(0..chunks);
        kernels.grad_sumsq_chunks(&stream, &grads.slice(shard.clone()), shard.len(), &mut part)?;
        stream
            .clone_dtoh(&sc.norm_part.slice(0..chunks))
            .map_err(|e| cuda("reading the gradient norm's chunk sums", e))
    }

    /// The update of `params[shard]` as views into the whole arenas, with
    /// the decay ranges shifted to the shard (uploaded again only when
    /// they change, i.e. once per shard).
    fn adamw(
        &mut self,
        k: &AdamWStep,
        decayed: &[Range<usize>],
        shard: Range<usize>,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        m: &mut CudaSlice<f32>,
        v: &mut CudaSlice<f32>,
    ) -> Result<()> {
        for (what, len) in [("params", params.len()), ("grads", grads.len())] {
            self.check_len(what, len)?;
        }
        let n = self.layout.len();
        // Device shard arenas hold at least one element (see
        // `Backend::upload_shard`), so the moments may be longer than an
        // empty shard, never shorter than the shard.
        if shard.start > shard.end
            || shard.end > n
            || m.len() < shard.len()
            || v.len() < shard.len()
        {
            return Err(TrainError::Config(format!(
                "AdamW update of elements {shard:?} of a {n}-element arena with moments of {} \
                 and {} elements",
                m.len(),
                v.len()
            )));
        }
        if shard.is_empty() {
            return Ok(());
        }
        let local = decayed_within(decayed, &shard);
        let len = shard.len();
        let (stream, kernels) = (self.engine.stream.clone(), self.engine.kernels.clone());
        let sc = self.optim_scratch(Some(&local), len)?;
        kernels.adamw(
            &stream,
            &mut params.slice_mut(shard.clone()),
            &grads.slice(shard),
            &mut m.slice_mut(0..len),
            &mut v.slice_mut(0..len),
            len,
            &sc.starts.as_view(),
            &sc.ends.as_view(),
            local.len(),
            k,
        )?;
        Ok(())
    }
}

/// The CPU optimizer's norm chunk must equal the kernels': the two sides
/// group their sums identically only then.
const _: () = assert!(NORM_CHUNK == crate::optim::clip::NORM_CHUNK);
