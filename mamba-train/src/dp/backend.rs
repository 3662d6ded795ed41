//! The model side of a data-parallel step: what [`DataParallel`] asks of
//! whatever holds the weights, computes gradients and steps the optimizer.
//!
//! The loop never touches an arena's contents itself, so the arenas may
//! live anywhere the backend and the reducer agree on
//! ([`DpBackend::Buffer`] = [`Reducer::Buffer`]): host `Vec<f32>` for the
//! CPU model with [`mamba_reduce::HostReducer`], device memory
//! (`CudaSlice<f32>`) for a CUDA model with [`mamba_reduce::NcclReducer`].
//!
//! [`DataParallel`]: super::DataParallel
//! [`Reducer::Buffer`]: mamba_reduce::Reducer::Buffer

use std::path::{Path, PathBuf};

use crate::error::Result;
use crate::train::{EvalReport, RunConfig, StepStats, TrainModel, Trainer};

/// One replica of the model: weights, optimizer state, data position.
///
/// Every rank holds one; the loop keeps them identical by handing each the
/// same reduced gradient and the same verdict every step. Implementations
/// must be deterministic: the same weights and micro-batch give the same
/// loss and gradient bits, and the same gradient gives the same update.
pub trait DpBackend {
    /// Where gradient arenas live; the reducer's buffer type.
    type Buffer;

    /// The run (seed, model, task, batch, L, contract, optimizer, schedule).
    fn run_config(&self) -> &RunConfig;

    /// Steps completed; the index of the next step.
    fn step(&self) -> u64;

    /// Steps skipped so far (non-finite loss or gradient on some rank).
    fn skipped_steps(&self) -> u64;

    /// Elements of the parameter (and every gradient) arena.
    fn arena_len(&self) -> usize;

    /// A zeroed gradient arena.
    fn alloc_arena(&mut self) -> Result<Self::Buffer>;

    /// Loss and gradient (into `grads`, overwritten) of logical micro-batch
    /// `micro` of the current step. Changes no training state.
    fn micro_gradient(&mut self, micro: u64, grads: &mut Self::Buffer) -> Result<f32>;

    /// Whether every element of `grads` is finite.
    fn all_finite(&mut self, grads: &Self::Buffer) -> Result<bool>;

    /// Finish the step with the world's `mean` gradient: clip and AdamW
    /// when `proceed` (every rank saw finite losses and gradients), skip the
    /// update otherwise (weights and moments untouched, the skip counted);
    /// the step advances either way. `loss` is the world's logged loss.
    fn apply(&mut self, mean: &Self::Buffer, loss: f32, proceed: bool) -> Result<StepStats>;

    /// Hex SHA-256 of the weight arena's little-endian bytes (the
    /// `weights-digest`).
    fn weights_digest(&mut self) -> Result<String>;

    /// Save a checkpoint of the current step under `run_dir`, keeping the
    /// newest `keep` (only rank 0 calls this).
    fn save_checkpoint(&mut self, run_dir: &Path, keep: usize) -> Result<PathBuf>;

    /// Held-out loss and accuracy (only rank 0 calls this).
    fn evaluate(&mut self, batches: usize, rows: usize) -> Result<EvalReport>;

    /// Test hook: make element 0 of `grads` a NaN.
    fn poison_gradient(&mut self, grads: &mut Self::Buffer) -> Result<()>;

    /// Test hook: add 1 to weight 0, so this replica differs from the
    /// others (by far more than rounding could ever absorb again).
    fn perturb_weights(&mut self) -> Result<()>;
}

/// The host-memory backend: the single-process [`Trainer`] over any
/// [`TrainModel`] (the CPU Mamba, or a test model).
impl<M: TrainModel> DpBackend for Trainer<M> {
    type Buffer = Vec<f32>;

    fn run_config(&self) -> &RunConfig {
        Trainer::run_config(self)
    }

    fn step(&self) -> u64 {
        Trainer::step(self)
    }

    fn skipped_steps(&self) -> u64 {
        Trainer::skipped_steps(self)
    }

    fn arena_len(&self) -> usize {
        self.params().len()
    }

    fn alloc_arena(&mut self) -> Result<Vec<f32>> {
        Ok(vec![0.0; self.params().len()])
    }

    fn micro_gradient(&mut self, micro: u64, grads: &mut Vec<f32>) -> Result<f32> {
        Trainer::micro_gradient(self, micro, grads)
    }

    fn all_finite(&mut self, grads: &Vec<f32>) -> Result<bool> {
        Ok(grads.iter().all(|g| g.is_finite()))
    }

    fn apply(&mut self, mean: &Vec<f32>, loss: f32, proceed: bool) -> Result<StepStats> {
        self.apply_with_verdict(mean, loss, proceed)
    }

    fn weights_digest(&mut self) -> Result<String> {
        Ok(Trainer::weights_digest(self))
    }

    fn save_checkpoint(&mut self, run_dir: &Path, keep: usize) -> Result<PathBuf> {
        Trainer::save_checkpoint(self, run_dir, keep)
    }

    fn evaluate(&mut self, batches: usize, rows: usize) -> Result<EvalReport> {
        Trainer::evaluate(self, batches, rows)
    }

    fn poison_gradient(&mut self, grads: &mut Vec<f32>) -> Result<()> {
        if let Some(g) = grads.first_mut() {
            *g = f32::NAN;
        }
        Ok(())
    }

    fn perturb_weights(&mut self) -> Result<()> {
        if let Some(w) = self.params_mut().first_mut() {
            *w += 1.0;
        }
        Ok(())
    }
}
