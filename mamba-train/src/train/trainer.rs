//! The single-process training loop, with the seam data-parallel training
//! needs.
//!
//! A step is three separate calls:
//! 1. [`Trainer::micro_gradient`] / [`Trainer::backward`]: gradients of the
//!    step's logical micro-batches into a gradient arena;
//! 2. a reducer ([`crate::dp`]) replaces that arena with the mean over all
//!    L logical micro-batches, folded in ascending logical order;
//! 3. [`Trainer::apply`] / [`Trainer::apply_external`]: clip + AdamW with the
//!    step's learning rate, then the step counter advances.
//!
//! [`Trainer::train_step`] is 1 then 3 in one call; the unit tests assert
//! it equals the split path, with an external copy in between, bit for bit.

use std::path::{Path, PathBuf};

use crate::checkpoint::{self, arena_digest, Checkpoint, CheckpointRef, DataPosition, RunState};
use crate::config::ModelConfig;
use crate::data::{accuracy, Accuracy, Dataset};
use crate::error::{Result, TrainError};
use crate::model::{Batch, IGNORE};
use crate::optim::{AdamW, Optimizer};
use crate::train::model::TrainModel;
use crate::train::run_config::RunConfig;

/// What one step did (for metrics).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepStats {
    /// Steps completed after this one (1 for the first step).
    pub step: u64,
    /// Mean loss of the step's micro-batches (before the update).
    pub loss: f32,
    /// Learning rate used.
    pub lr: f32,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// True when the update was skipped (non-finite loss or gradient).
    pub skipped: bool,
    /// Steps skipped so far in the run, this one included.
    pub skipped_total: u64,
    /// Tokens the step consumed.
    pub tokens: usize,
}

/// Held-out evaluation result.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct EvalReport {
    /// Mean cross-entropy over scored positions.
    pub loss: f64,
    /// Accuracy on scored positions.
    pub accuracy: Accuracy,
    /// Accuracy of uniform guessing.
    pub chance: f64,
}

/// Model, weights, optimizer and data position of one run.
pub struct Trainer<M: TrainModel> {
    model: M,
    cfg: RunConfig,
    data: Dataset,
    params: Vec<f32>,
    grads: Vec<f32>,
    scratch: Vec<f32>,
    opt: Optimizer,
    step: u64,
    skipped: u64,
}

impl<M: TrainModel> Trainer<M> {
    /// A fresh run: weights from the seed law, zero moments, step 0.
    pub fn new(model: M, cfg: RunConfig) -> Result<Self> {
        let data = Dataset::new(cfg.task.clone(), cfg.batch)?;
        Self::with_dataset(model, cfg, data)
    }

    /// A fresh run over an already built dataset (e.g. a loaded corpus).
    pub fn with_dataset(model: M, cfg: RunConfig, data: Dataset) -> Result<Self> {
        Self::check_parts(&model, &cfg, &data)?;
        let params = model.init_params(cfg.seed);
        let opt = Optimizer::new(cfg.optimizer, cfg.schedule, model.layout())?;
        Self::assemble(model, cfg, data, params, opt, 0, 0)
    }

    /// Continue the run recorded in `ck`. `cfg` is the requested run; it must
    /// equal the recorded one (the error names every differing setting).
    pub fn resume(model: M, cfg: RunConfig, data: Dataset, ck: Checkpoint) -> Result<Self> {
        Self::check_parts(&model, &cfg, &data)?;
        cfg.mismatches(&ck.state.run)
            .map_err(|detail| TrainError::Checkpoint {
                path: ck.dir.display().to_string(),
                detail,
            })?;
        let st = &ck.state;
        let adamw = AdamW::from_state(
            cfg.optimizer,
            model.layout(),
            ck.exp_avg,
            ck.exp_avg_sq,
            st.optimizer_updates,
        )?;
        let opt = Optimizer::from_parts(adamw, cfg.schedule)?;
        Self::assemble(model, cfg, data, ck.params, opt, st.step, st.skipped_steps)
    }

    /// Continue from `ck`'s weights and step but with *fresh* optimizer
    /// moments. Not a faithful resume: it exists as the negative control
    /// that shows the moments matter (its bits differ from the unbroken run).
    pub fn resume_weights_only(
        model: M,
        cfg: RunConfig,
        data: Dataset,
        ck: Checkpoint,
    ) -> Result<Self> {
        Self::check_parts(&model, &cfg, &data)?;
        let opt = Optimizer::new(cfg.optimizer, cfg.schedule, model.layout())?;
        let (step, skipped) = (ck.state.step, ck.state.skipped_steps);
        Self::assemble(model, cfg, data, ck.params, opt, step, skipped)
    }

    fn check_parts(model: &M, cfg: &RunConfig, data: &Dataset) -> Result<()> {
        check_run_parts(model.config(), cfg, data)
    }

    fn assemble(
        model: M,
        cfg: RunConfig,
        data: Dataset,
        params: Vec<f32>,
        opt: Optimizer,
        step: u64,
        skipped: u64,
    ) -> Result<Self> {
        let n = model.layout().len();
        if params.len() != n {
            return Err(TrainError::Config(format!(
                "weights have {} elements, the model {n}",
                params.len()
            )));
        }
        Ok(Trainer {
            model,
            cfg,
            data,
            params,
            grads: vec![0.0; n],
            // Allocated by the first fused step with L > 1; a data-parallel
            // run keeps its own per-logical-rank arenas and never needs it.
            scratch: Vec::new(),
            opt,
            step,
            skipped,
        })
    }

    /// The run's identity.
    pub fn run_config(&self) -> &RunConfig {
        &self.cfg
    }
    /// The model.
    pub fn model(&self) -> &M {
        &self.model
    }
    /// The dataset.
    pub fn dataset(&self) -> &Dataset {
        &self.data
    }
    /// The weight arena.
    pub fn params(&self) -> &[f32] {
        &self.params
    }
    /// Mutable weights (for a replica check or a test that corrupts them).
    pub fn params_mut(&mut self) -> &mut [f32] {
        &mut self.params
    }
    /// The optimizer.
    pub fn optimizer(&self) -> &Optimizer {
        &self.opt
    }
    /// Steps completed; also the index of the next step.
    pub fn step(&self) -> u64 {
        self.step
    }
    /// Steps skipped so far.
    pub fn skipped_steps(&self) -> u64 {
        self.skipped
    }
    /// True once the schedule's steps are done.
    pub fn finished(&self) -> bool {
        self.step >= self.cfg.schedule.total_steps
    }
    /// The gradient arena [`backward`](Self::backward) fills.
    pub fn grads(&self) -> &[f32] {
        &self.grads
    }
    /// The gradient arena, for a reducer to replace in place.
    pub fn grads_mut(&mut self) -> &mut [f32] {
        &mut self.grads
    }
    /// Hex SHA-256 of the weight arena.
    pub fn weights_digest(&self) -> String {
        arena_digest(&self.params)
    }

    /// Loss and gradient (into `grads`, overwritten) of logical micro-batch
    /// `micro` of the current step. Changes no training state (weights,
    /// moments, step): a process holding logical ranks `a..b` calls it for
    /// each of them.
    pub fn micro_gradient(&mut self, micro: u64, grads: &mut [f32]) -> Result<f32> {
        let batch = self.data.train_batch(self.cfg.seed, self.step, micro);
        self.model.forward_backward(&self.params, &batch, grads)
    }

    /// Fill the gradient arena with the mean gradient over all of the step's
    /// logical micro-batches, summed in ascending order `((g0 + g1) + g2)...`
    /// in f32 and then scaled by `1/L` (the fixed-order contract, as a
    /// reducer would produce it). Returns the mean loss (same order).
    pub fn backward(&mut self) -> Result<f32> {
        let mut grads = std::mem::take(&mut self.grads);
        let result = self.fold_micro_batches(&mut grads);
        self.grads = grads;
        result
    }

    fn fold_micro_batches(&mut self, acc: &mut [f32]) -> Result<f32> {
        let l = self.cfg.logical_world;
        let mut loss = self.micro_gradient(0, acc)?;
        if l == 1 {
            return Ok(loss);
        }
        let mut scratch = std::mem::take(&mut self.scratch);
        scratch.resize(acc.len(), 0.0);
        for micro in 1..l as u64 {
            match self.micro_gradient(micro, &mut scratch) {
                Ok(li) => loss += li,
                Err(e) => {
                    self.scratch = scratch;
                    return Err(e);
                }
            }
            for (a, s) in acc.iter_mut().zip(&scratch) {
                *a += *s;
            }
        }
        self.scratch = scratch;
        let inv = 1.0 / l as f32;
        for a in acc.iter_mut() {
            *a *= inv;
        }
        Ok(loss * inv)
    }

    /// Optimizer step on the gradient arena (after [`backward`](Self::backward)
    /// and any reduction); advances the step.
    pub fn apply(&mut self, loss: f32) -> Result<StepStats> {
        let grads = std::mem::take(&mut self.grads);
        let result = self.apply_external(&grads, loss);
        self.grads = grads;
        result
    }

    /// Optimizer step on `grads` (e.g. a reducer's output buffer); advances
    /// the step. A non-finite `loss` or gradient skips the update (the
    /// weights and moments stay) but the step still advances and is counted.
    pub fn apply_external(&mut self, grads: &[f32], loss: f32) -> Result<StepStats> {
        self.apply_with_verdict(grads, loss, loss.is_finite())
    }

    /// [`apply_external`](Self::apply_external) with the finiteness verdict
    /// decided by the caller, e.g. a world that agreed (through the
    /// reducer's `any`) that some rank saw a non-finite loss: every rank then
    /// passes `losses_finite = false` and all skip the same step. A
    /// non-finite gradient norm skips as well.
    pub fn apply_with_verdict(
        &mut self,
        grads: &[f32],
        loss: f32,
        losses_finite: bool,
    ) -> Result<StepStats> {
        let out = self
            .opt
            .step(self.step, &mut self.params, grads, losses_finite)?;
        self.step += 1;
        if out.skipped {
            self.skipped += 1;
        }
        Ok(StepStats {
            step: self.step,
            loss,
            lr: out.lr,
            grad_norm: out.grad_norm,
            skipped: out.skipped,
            skipped_total: self.skipped,
            tokens: self.cfg.tokens_per_step(),
        })
    }

    /// One whole step: [`backward`](Self::backward) then [`apply`](Self::apply).
    pub fn train_step(&mut self) -> Result<StepStats> {
        let loss = self.backward()?;
        self.apply(loss)
    }

    /// Loss and accuracy on `batches` held-out batches of `rows` rows each
    /// (`Domain::Eval`, independent of training samples and of the step).
    pub fn evaluate(&mut self, batches: usize, rows: usize) -> Result<EvalReport> {
        let (model, params) = (&mut self.model, &self.params);
        evaluate_with(&self.data, &self.cfg, batches, rows, |batch| {
            model.logits(params, batch)
        })
    }

    /// The checkpoint state of the current step.
    pub fn run_state(&self) -> RunState {
        run_state(
            &self.cfg,
            self.step,
            self.opt.adamw().updates(),
            self.skipped,
            self.weights_digest(),
        )
    }

    /// Save a checkpoint of the current step under `run_dir` (atomically;
    /// see [`checkpoint`]), keeping the newest `keep`.
    pub fn save_checkpoint(&self, run_dir: &Path, keep: usize) -> Result<PathBuf> {
        let state = self.run_state();
        let adamw = self.opt.adamw();
        let ck = CheckpointRef {
            state: &state,
            params: &self.params,
            exp_avg: adamw.exp_avg(),
            exp_avg_sq: adamw.exp_avg_sq(),
        };
        checkpoint::save(run_dir, &ck, keep)
    }
}

/// Check that a model of shape `model` and `data` are the parts `cfg`
/// asks for (and that `cfg` itself is valid): what every backend checks
/// before it holds a replica of the run.
pub(crate) fn check_run_parts(model: &ModelConfig, cfg: &RunConfig, data: &Dataset) -> Result<()> {
    cfg.validate()?;
    if model != &cfg.model {
        return Err(TrainError::Config(format!(
            "the model has shape {model:?} but the run asks for {:?}",
            cfg.model
        )));
    }
    if data.spec() != &cfg.task || data.batch_rows() != cfg.batch {
        return Err(TrainError::Config(
            "the dataset does not match the run's task and batch".into(),
        ));
    }
    Ok(())
}

/// The checkpoint state of `cfg` after `step` steps, `optimizer_updates`
/// AdamW updates and `skipped` skipped steps, for weights with hex SHA-256
/// `weights_digest` (any backend's: the CPU trainer's, or a device model's
/// after downloading its arena).
pub fn run_state(
    cfg: &RunConfig,
    step: u64,
    optimizer_updates: u64,
    skipped: u64,
    weights_digest: String,
) -> RunState {
    RunState {
        format_version: checkpoint::FORMAT_VERSION,
        step,
        optimizer_updates,
        skipped_steps: skipped,
        data_position: DataPosition {
            next_step: step,
            micro_batches_per_step: cfg.logical_world,
            rows_per_micro_batch: cfg.batch,
        },
        weights_digest,
        run: cfg.clone(),
    }
}

/// Loss and accuracy on `batches` held-out batches of `rows` rows each
/// (`Domain::Eval`: independent of training samples and of the step), with
/// the logits from `logits` (`[batch, seq_len, vocab]` on the host). The
/// loss is the mean cross-entropy over scored positions, in f64.
pub fn evaluate_with(
    data: &Dataset,
    cfg: &RunConfig,
    batches: usize,
    rows: usize,
    mut logits: impl FnMut(&Batch) -> Result<Vec<f32>>,
) -> Result<EvalReport> {
    let vocab = cfg.model.vocab_size;
    let mut acc = Accuracy::default();
    let mut nll = 0.0f64;
    for index in 0..batches as u64 {
        let batch = data.eval_batch(cfg.seed, index, rows);
        let logits = logits(&batch)?;
        acc = acc.merge(accuracy(&logits, &batch, vocab)?);
        for (pos, &t) in batch.targets.iter().enumerate() {
            if t == IGNORE {
                continue;
            }
            let row = &logits[pos * vocab..(pos + 1) * vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b)) as f64;
            let lse = max
                + row
                    .iter()
                    .map(|&z| (z as f64 - max).exp())
                    .sum::<f64>()
                    .ln();
            nll += lse - row[t as usize] as f64;
        }
    }
    let loss = if acc.total == 0 {
        0.0
    } else {
        nll / acc.total as f64
    };
    Ok(EvalReport {
        loss,
        accuracy: acc,
        chance: cfg.task.chance_accuracy(),
    })
}
