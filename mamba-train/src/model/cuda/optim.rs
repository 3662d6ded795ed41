//! AdamW, gradient clipping and the schedule on the device, bit-identical to
//! [`crate::optim`] (the CPU optimizer): the same global-norm association
//! (f64 chunks of `NORM_CHUNK`, summed in order), the same clip factor (from
//! [`crate::optim::clip_scale`] on the host), and the same per-element
//! AdamW arithmetic with the same per-step constants ([`AdamWStep`]).
//! Moments live on the device next to the parameters; they are copied to the
//! host only for checkpoints ([`CudaOptimizer::to_host`]).

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kernels::mamba::{check_decay_ranges, AdamWStep, MambaKernels, NORM_CHUNK};

use super::{cuda, CudaModel};
use crate::error::{Result, TrainError};
use crate::optim::{clip_scale, AdamW, AdamWConfig, Optimizer, Schedule, StepOutcome};
use crate::params::{ParamKind, ParamLayout};

/// AdamW state on the device.
pub struct CudaAdamW {
    cfg: AdamWConfig,
    stream: Arc<CudaStream>,
    kernels: MambaKernels,
    m: CudaSlice<f32>,
    v: CudaSlice<f32>,
    t: u64,
    n: usize,
    starts: CudaSlice<u64>,
    ends: CudaSlice<u64>,
    nranges: usize,
    norm_part: CudaSlice<f64>,
    norm_out: CudaSlice<f64>,
}

impl CudaAdamW {
    /// Fresh state (zero moments, `t = 0`) for `model`'s arena, on its stream.
    pub fn new(model: &CudaModel, cfg: AdamWConfig) -> Result<Self> {
        let n = model.layout().len();
        Self::from_state(model, cfg, &vec![0.0; n], &vec![0.0; n], 0)
    }

    /// State restored from host moments (e.g. a checkpoint) after `t` updates.
    pub fn from_state(
        model: &CudaModel,
        cfg: AdamWConfig,
        m: &[f32],
        v: &[f32],
        t: u64,
    ) -> Result<Self> {
        cfg.validate()?;
        let layout = model.layout();
        let n = layout.len();
        if m.len() != n || v.len() != n {
            return Err(TrainError::Config(format!(
                "optimizer moments have {} and {} elements; the model has {n}",
                m.len(),
                v.len()
            )));
        }
        let (starts, ends) = decayed_ranges(layout);
        check_decay_ranges(&starts, &ends, n)?;
        let s = model.stream().clone();
        let up_u64 = |x: &[u64], what: &str| {
            let data = if x.is_empty() { &[0u64][..] } else { x };
            s.clone_htod(data).map_err(|e| cuda(what, e))
        };
        Ok(CudaAdamW {
            cfg,
            kernels: model.kernels().clone(),
            m: s.clone_htod(m)
                .map_err(|e| cuda("uploading the first moments", e))?,
            v: s.clone_htod(v)
                .map_err(|e| cuda("uploading the second moments", e))?,
            t,
            n,
            nranges: starts.len(),
            starts: up_u64(&starts, "uploading the decay ranges")?,
            ends: up_u64(&ends, "uploading the decay ranges")?,
            norm_part: s
                .alloc_zeros::<f64>(MambaKernels::grad_sumsq_scratch_len(n))
                .map_err(|e| cuda("allocating the norm partials", e))?,
            norm_out: s
                .alloc_zeros::<f64>(1)
                .map_err(|e| cuda("allocating the norm", e))?,
            stream: s,
        })
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &AdamWConfig {
        &self.cfg
    }
    /// Updates applied so far.
    pub fn updates(&self) -> u64 {
        self.t
    }

    /// Euclidean norm of `grads`, the CPU's `global_norm` bit for bit.
    /// Synchronizes the stream.
    pub fn global_norm(&mut self, grads: &CudaSlice<f32>) -> Result<f64> {
        self.check("grads", grads.len())?;
        self.kernels.grad_sumsq(
            &self.stream,
            &grads.as_view(),
            self.n,
            &mut self.norm_part.as_view_mut(),
            &mut self.norm_out.as_view_mut(),
        )?;
        let sum = self
            .stream
            .clone_dtoh(&self.norm_out)
            .map_err(|e| cuda("reading the gradient norm", e))?;
        Ok(sum[0].sqrt())
    }

    /// One update with learning rate `lr`, using `grads * clip_scale`.
    pub fn update(
        &mut self,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        clip_scale: f32,
        lr: f32,
    ) -> Result<()> {
        self.check("params", params.len())?;
        self.check("grads", grads.len())?;
        let c = self.cfg;
        let step = AdamWStep::new(
            c.beta1,
            c.beta2,
            c.eps,
            c.weight_decay,
            lr,
            self.t + 1,
            clip_scale,
        );
        self.kernels.adamw(
            &self.stream,
            &mut params.as_view_mut(),
            &grads.as_view(),
            &mut self.m.as_view_mut(),
            &mut self.v.as_view_mut(),
            self.n,
            &self.starts.as_view(),
            &self.ends.as_view(),
            self.nranges,
            &step,
        )?;
        self.t += 1;
        Ok(())
    }

    /// The moments on the host (synchronizes the stream).
    pub fn moments(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        let m = self
            .stream
            .clone_dtoh(&self.m)
            .map_err(|e| cuda("downloading the first moments", e))?;
        let v = self
            .stream
            .clone_dtoh(&self.v)
            .map_err(|e| cuda("downloading the second moments", e))?;
        Ok((m, v))
    }

    fn check(&self, what: &str, len: usize) -> Result<()> {
        if len != self.n {
            return Err(TrainError::Config(format!(
                "{what} has {len} elements; the optimizer state has {}",
                self.n
            )));
        }
        Ok(())
    }
}

/// [`crate::optim::Optimizer`] on the device: schedule, clipping, AdamW.
pub struct CudaOptimizer {
    adamw: CudaAdamW,
    schedule: Schedule,
    layout: ParamLayout,
}

impl CudaOptimizer {
    /// Fresh state for `model`.
    pub fn new(model: &CudaModel, cfg: AdamWConfig, schedule: Schedule) -> Result<Self> {
        schedule.validate()?;
        Ok(CudaOptimizer {
            adamw: CudaAdamW::new(model, cfg)?,
            schedule,
            layout: model.layout().clone(),
        })
    }

    /// The device copy of a host optimizer (resuming from a checkpoint).
    pub fn from_host(model: &CudaModel, host: &Optimizer) -> Result<Self> {
        let a = host.adamw();
        Ok(CudaOptimizer {
            adamw: CudaAdamW::from_state(
                model,
                *a.config(),
                a.exp_avg(),
                a.exp_avg_sq(),
                a.updates(),
            )?,
            schedule: *host.schedule(),
            layout: model.layout().clone(),
        })
    }

    /// The host copy (for checkpoints); synchronizes the stream.
    pub fn to_host(&self) -> Result<Optimizer> {
        let (m, v) = self.adamw.moments()?;
        let a = AdamW::from_state(
            *self.adamw.config(),
            &self.layout,
            m,
            v,
            self.adamw.updates(),
        )?;
        Optimizer::from_parts(a, self.schedule)
    }

    /// The AdamW state.
    pub fn adamw(&self) -> &CudaAdamW {
        &self.adamw
    }

    /// Step `step` (0-based, selects the learning rate), exactly as
    /// [`Optimizer::step`]: a non-finite loss or gradient norm skips the
    /// step and leaves parameters and moments untouched; otherwise clip by
    /// the global norm, then AdamW. Synchronizes the stream (for the norm).
    pub fn step(
        &mut self,
        step: u64,
        params: &mut CudaSlice<f32>,
        grads: &CudaSlice<f32>,
        loss_finite: bool,
    ) -> Result<StepOutcome> {
        let lr = self.schedule.lr(step);
        let grad_norm = self.adamw.global_norm(grads)?;
        if !loss_finite || !grad_norm.is_finite() {
            return Ok(StepOutcome {
                lr,
                grad_norm,
                clip_scale: 1.0,
                skipped: true,
            });
        }
        let scale = clip_scale(grad_norm, self.adamw.config().clip_norm);
        self.adamw.update(params, grads, scale, lr)?;
        Ok(StepOutcome {
            lr,
            grad_norm,
            clip_scale: scale,
            skipped: false,
        })
    }
}

/// The arena ranges of `ParamKind::Matrix` tensors (decayed), merged where
/// adjacent, as `[start, end)` pairs.
fn decayed_ranges(layout: &ParamLayout) -> (Vec<u64>, Vec<u64>) {
    let (mut starts, mut ends): (Vec<u64>, Vec<u64>) = (Vec::new(), Vec::new());
    for e in layout.entries() {
        if e.kind != ParamKind::Matrix || e.is_empty() {
            continue;
        }
        let r = e.range();
        match ends.last_mut() {
            Some(end) if *end == r.start as u64 => *end = r.end as u64,
            _ => {
                starts.push(r.start as u64);
                ends.push(r.end as u64);
            }
        }
    }
    (starts, ends)
}

/// The CPU optimizer's norm chunk must equal the kernels': the two sides
/// group their sums identically only then.
const _: () = assert!(NORM_CHUNK == crate::optim::clip::NORM_CHUNK);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;

    #[test]
    fn decayed_ranges_are_the_matrices_merged() {
        let l = ParamLayout::new(&ModelConfig::new(11, 16, 2));
        let (s, e) = decayed_ranges(&l);
        check_decay_ranges(&s, &e, l.len()).unwrap();
        for entry in l.entries() {
            for i in [entry.offset, entry.offset + entry.len() - 1] {
                let inside = s
                    .iter()
                    .zip(&e)
                    .any(|(&a, &b)| (a..b).contains(&(i as u64)));
                assert_eq!(
                    inside,
                    entry.kind == ParamKind::Matrix,
                    "{} element {i}",
                    entry.name
                );
            }
        }
        // Embedding + layer 0's in_proj and conv weight are not adjacent
        // (norm lies between), so ranges are not all merged into one.
        assert!(s.len() > 1);
    }
}
