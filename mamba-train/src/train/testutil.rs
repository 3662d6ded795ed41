//! Test helpers: a small differentiable model over the real arena layout,
//! so the trainer, optimizer and checkpoints can be tested without the
//! Mamba model.
//!
//! Logits at position t: `z_v = sum_j E[x_t, j] * nf[j] * E[v, j]` (the
//! embedding `E` and `norm_f` weights `nf` of the layout; every other tensor
//! gets a zero gradient). It learns bigram statistics, which is enough to
//! make every optimizer path move the weights.

use crate::config::ModelConfig;
use crate::data::{SelectiveCopyConfig, TaskSpec};
use crate::error::{Result, TrainError};
use crate::model::HostModel;
use crate::model::{Batch, IGNORE};
use crate::optim::{AdamWConfig, Schedule};
use crate::params::ParamLayout;
use crate::run_config::{RunConfig, DEFAULT_CONTRACT};
use crate::seed::{self, Domain, Rng};

/// The bigram test model.
pub struct ToyModel {
    cfg: ModelConfig,
    layout: ParamLayout,
}

impl ToyModel {
    pub fn new(cfg: ModelConfig) -> Self {
        let layout = ParamLayout::new(&cfg);
        ToyModel { cfg, layout }
    }

    fn logits_of(&self, p: &[f32], x: u32, out: &mut [f32]) {
        let d = self.cfg.d_model;
        let e = &p[self.layout.embedding.clone()];
        let nf = &p[self.layout.norm_f.clone()];
        let ex = &e[x as usize * d..(x as usize + 1) * d];
        for (v, z) in out.iter_mut().enumerate() {
            let ev = &e[v * d..(v + 1) * d];
            *z = (0..d).map(|j| ex[j] * nf[j] * ev[j]).sum();
        }
    }
}

impl HostModel for ToyModel {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }
    fn layout(&self) -> &ParamLayout {
        &self.layout
    }
    fn init_params(&self, seed: u64) -> Vec<f32> {
        let mut r = Rng::new(seed::derive(seed, Domain::Init, &[]));
        let mut p: Vec<f32> = (0..self.layout.len())
            .map(|_| (r.normal() * 0.3) as f32)
            .collect();
        p[self.layout.norm_f.clone()].fill(1.0);
        p
    }
    fn forward_backward(&mut self, p: &[f32], batch: &Batch, g: &mut [f32]) -> Result<f32> {
        if g.len() != p.len() {
            return Err(TrainError::Config("grads length".into()));
        }
        let (v, d) = (self.cfg.vocab_size, self.cfg.d_model);
        g.fill(0.0);
        let count = batch.targets.iter().filter(|&&t| t != IGNORE).count();
        if count == 0 {
            return Ok(0.0);
        }
        let (er, nr) = (self.layout.embedding.clone(), self.layout.norm_f.clone());
        let mut z = vec![0.0f32; v];
        let mut loss = 0.0f64;
        for (pos, &t) in batch.targets.iter().enumerate() {
            if t == IGNORE {
                continue;
            }
            let x = batch.tokens[pos] as usize;
            self.logits_of(p, x as u32, &mut z);
            let max = z.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let s: f32 = z.iter().map(|&zi| (zi - max).exp()).sum();
            loss += (s.ln() + max - z[t as usize]) as f64;
            for (vi, zi) in z.iter().enumerate() {
                let dz = ((zi - max).exp() / s - if vi == t as usize { 1.0 } else { 0.0 })
                    / count as f32;
                for j in 0..d {
                    let ex = p[er.start + x * d + j];
                    let ev = p[er.start + vi * d + j];
                    let nf = p[nr.start + j];
                    g[er.start + vi * d + j] += dz * ex * nf;
                    g[er.start + x * d + j] += dz * ev * nf;
                    g[nr.start + j] += dz * ex * ev;
                }
            }
        }
        Ok((loss / count as f64) as f32)
    }
    fn logits(&mut self, p: &[f32], batch: &Batch) -> Result<Vec<f32>> {
        let v = self.cfg.vocab_size;
        let mut out = vec![0.0f32; batch.tokens.len() * v];
        for (pos, &x) in batch.tokens.iter().enumerate() {
            self.logits_of(p, x, &mut out[pos * v..(pos + 1) * v]);
        }
        Ok(out)
    }
}

/// A small selective-copy run for the toy model.
pub fn toy_run(steps: u64) -> RunConfig {
    let task = TaskSpec::SelectiveCopy(SelectiveCopyConfig {
        seq_len: 12,
        n_memorize: 3,
        alphabet: 5,
    });
    RunConfig {
        seed: 42,
        model: ModelConfig::new(task.vocab_size(), 8, 1),
        task,
        batch: 4,
        logical_world: 1,
        contract: DEFAULT_CONTRACT,
        optimizer: AdamWConfig::default(),
        schedule: Schedule {
            peak_lr: 5e-2,
            warmup_steps: 2,
            total_steps: steps,
            min_lr_frac: 0.1,
        },
    }
}

/// The toy model of a run.
pub fn toy_model(run: &RunConfig) -> ToyModel {
    ToyModel::new(run.model.clone())
}

/// `t` after at most `n` more steps in a one-process world (the library's
/// loop, [`crate::dp::host::local`]); `u64::MAX` trains to the end.
pub fn run_steps<M: HostModel>(t: crate::train::Trainer<M>, n: u64) -> crate::train::Trainer<M> {
    let mut w = crate::dp::host::local(t, crate::dp::DpOptions::default()).unwrap();
    for _ in 0..n {
        if w.finished() {
            break;
        }
        w.step().unwrap();
    }
    w.into_parts().0
}
