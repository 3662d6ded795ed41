//! [`Trainer`]: the one training engine, over any [`Backend`] (the CPU
//! model over host arenas, the CUDA model over device arenas).
//!
//! It owns one replica of a run: weights, optimizer state, data position,
//! and the step and skip counters; it starts fresh or resumes a checkpoint,
//! computes micro-batch gradients, applies a reduced gradient, writes
//! checkpoints and evaluates. A step is two calls with the reduction in
//! between, which is the data-parallel loop's ([`crate::dp::DataParallel`]):
//! 1. [`Trainer::micro_gradient`] for each of the step's logical
//!    micro-batches this process holds, each into its own arena;
//! 2. a reducer replaces them with the mean over all `L`, folded in
//!    ascending logical order;
//! 3. [`Trainer::apply`]: clip + AdamW with the step's learning rate (or a
//!    skip, agreed by every rank), then the step counter advances.
//!
//! A single process is a one-rank world of the same loop
//! ([`crate::dp::host::local`]), so there is one path to every result.

use std::path::{Path, PathBuf};

use crate::checkpoint::{self, arena_digest, Checkpoint, CheckpointMeta, DataPosition, RunState};
use crate::config::ModelConfig;
use crate::data::{accuracy, Accuracy, Dataset};
use crate::error::{Result, TrainError};
use crate::model::Backend;
use crate::model::{Batch, IGNORE};
use crate::optim::{AdamW, Optimizer};
use crate::run_config::RunConfig;

mod zero;

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

/// Model, weights, optimizer and data position of one run, on the
/// backend's device.
///
/// Everything heavy lives where the backend keeps its arenas: the weights,
/// the moments (inside the [`Optimizer`]) and the gradient arenas the
/// caller allocates through [`Backend::zeros`]. The host sees the weights
/// only for the digest, checkpoints and the replica check.
pub struct Trainer<B: Backend> {
    backend: B,
    cfg: RunConfig,
    data: Dataset,
    params: B::Arena,
    opt: Optimizer<B::Arena>,
    step: u64,
    skipped: u64,
}

impl<B: Backend> Trainer<B> {
    /// A fresh run: weights from the seed law, zero moments, step 0.
    pub fn new(backend: B, cfg: RunConfig) -> Result<Self> {
        let data = Dataset::new(cfg.task.clone(), cfg.batch)?;
        Self::with_dataset(backend, cfg, data)
    }

    /// A fresh run over an already built dataset (e.g. a loaded corpus).
    pub fn with_dataset(mut backend: B, cfg: RunConfig, data: Dataset) -> Result<Self> {
        check_run_parts(backend.config(), &cfg, &data)?;
        let params = backend.init_params(cfg.seed)?;
        let opt = fresh_optimizer(&mut backend, &cfg)?;
        Ok(Self::assemble(backend, cfg, data, params, opt, 0, 0))
    }

    /// A fresh run (step 0, zero moments) that starts from `weights`, e.g. a
    /// pretrained model's (`--init-from`), instead of the seed law's
    /// initialisation; the data stream still follows `cfg.seed`.
    pub fn from_weights(
        mut backend: B,
        cfg: RunConfig,
        data: Dataset,
        weights: &[f32],
    ) -> Result<Self> {
        check_run_parts(backend.config(), &cfg, &data)?;
        let params = upload_weights(&mut backend, weights, "the initial weights")?;
        let opt = fresh_optimizer(&mut backend, &cfg)?;
        Ok(Self::assemble(backend, cfg, data, params, opt, 0, 0))
    }

    /// Continue the run recorded in `ck` (weights and moments moved to the
    /// backend's memory). `cfg` is the requested run; it must equal the
    /// recorded one (the error names every differing setting). A
    /// checkpoint written on another device loads too (same format); the
    /// bits then follow this backend from here on.
    pub fn resume(mut backend: B, cfg: RunConfig, data: Dataset, ck: Checkpoint) -> Result<Self> {
        check_run_parts(backend.config(), &cfg, &data)?;
        // Another precision is refused (its bits are another run's); another
        // device only earns the note the CLI prints.
        crate::checkpoint::check_resume(&ck, backend.device_name(), backend.precision_name())?;
        let path = ck.dir.display().to_string();
        cfg.mismatches(&ck.state.run)
            .map_err(|detail| TrainError::Checkpoint {
                path: path.clone(),
                detail,
            })?;
        let st = &ck.state;
        let adamw = AdamW::from_state(
            cfg.optimizer,
            backend.layout(),
            ck.exp_avg,
            ck.exp_avg_sq,
            st.optimizer_updates,
        )?
        .map_arenas(|host| backend.upload(&host))?;
        let opt = Optimizer::from_parts(adamw, cfg.schedule)?;
        let params = upload_weights(&mut backend, &ck.params, &path)?;
        let (step, skipped) = (st.step, st.skipped_steps);
        Ok(Self::assemble(
            backend, cfg, data, params, opt, step, skipped,
        ))
    }

    /// Continue from `ck`'s weights and step but with *fresh* optimizer
    /// moments. Not a faithful resume: it exists as the negative control
    /// that shows the moments matter (its bits differ from the unbroken run).
    pub fn resume_weights_only(
        mut backend: B,
        cfg: RunConfig,
        data: Dataset,
        ck: Checkpoint,
    ) -> Result<Self> {
        check_run_parts(backend.config(), &cfg, &data)?;
        let opt = fresh_optimizer(&mut backend, &cfg)?;
        let params = upload_weights(&mut backend, &ck.params, &ck.dir.display().to_string())?;
        let (step, skipped) = (ck.state.step, ck.state.skipped_steps);
        Ok(Self::assemble(
            backend, cfg, data, params, opt, step, skipped,
        ))
    }

    fn assemble(
        backend: B,
        cfg: RunConfig,
        data: Dataset,
        params: B::Arena,
        opt: Optimizer<B::Arena>,
        step: u64,
        skipped: u64,
    ) -> Self {
        Trainer {
            backend,
            cfg,
            data,
            params,
            opt,
            step,
            skipped,
        }
    }

    /// The run's identity.
    pub fn run_config(&self) -> &RunConfig {
        &self.cfg
    }
    /// The backend (the model on its device).
    pub fn backend(&self) -> &B {
        &self.backend
    }
    /// The backend, mutable (e.g. to allocate an arena).
    pub fn backend_mut(&mut self) -> &mut B {
        &mut self.backend
    }
    /// The dataset.
    pub fn dataset(&self) -> &Dataset {
        &self.data
    }
    /// The weight arena.
    pub fn params(&self) -> &B::Arena {
        &self.params
    }
    /// The weights on the host (a borrow on the CPU, a download on a GPU).
    pub fn params_host(&mut self) -> Result<Vec<f32>> {
        Ok(self.backend.to_host(&self.params)?.into_owned())
    }
    /// The optimizer.
    pub fn optimizer(&self) -> &Optimizer<B::Arena> {
        &self.opt
    }
    /// The optimizer with its moments on the host (for checkpoints and
    /// comparisons across devices; a ZeRO-1 shard's moments only).
    pub fn optimizer_host(&mut self) -> Result<Optimizer> {
        let backend = &mut self.backend;
        let len = self.opt.adamw().shard().len();
        let adamw = self
            .opt
            .adamw()
            .try_map_ref(|a| Ok(backend.shard_to_host(a, len)?.into_owned()))?;
        Optimizer::from_parts(adamw, *self.opt.schedule())
    }
    /// Elements of the parameter (and every gradient) arena.
    pub fn arena_len(&self) -> usize {
        self.backend.layout().len()
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
    /// Hex SHA-256 of the weight arena's little-endian bytes (the
    /// `weights-digest`).
    pub fn weights_digest(&mut self) -> Result<String> {
        Ok(arena_digest(&self.backend.to_host(&self.params)?))
    }

    /// Loss and gradient (into `grads`, overwritten) of logical micro-batch
    /// `micro` of the current step. Changes no training state (weights,
    /// moments, step): a process holding logical ranks `a..b` calls it for
    /// each of them.
    pub fn micro_gradient(&mut self, micro: u64, grads: &mut B::Arena) -> Result<f32> {
        let batch = self.data.train_batch(self.cfg.seed, self.step, micro)?;
        self.backend.forward_backward(&self.params, &batch, grads)
    }

    /// Finish the step with the world's `mean` gradient: clip and AdamW
    /// when `proceed` (every rank saw finite losses and gradients), skip the
    /// update otherwise (weights and moments untouched, the skip counted);
    /// a non-finite gradient norm skips as well. The step advances either
    /// way. `loss` is the world's logged loss.
    pub fn apply(&mut self, mean: &B::Arena, loss: f32, proceed: bool) -> Result<StepStats> {
        self.apply_gathered(mean, loss, proceed, &mut |own| Ok(own))
    }

    /// Loss and accuracy on `batches` held-out batches of `rows` rows each
    /// (`Domain::Eval`, independent of training samples and of the step).
    pub fn evaluate(&mut self, batches: usize, rows: usize) -> Result<EvalReport> {
        let (backend, params) = (&mut self.backend, &self.params);
        evaluate_with(&self.data, &self.cfg, batches, rows, |batch| {
            backend.logits(params, batch)
        })
    }

    /// The checkpoint state of the current step.
    pub fn run_state(&mut self) -> Result<RunState> {
        let digest = self.weights_digest()?;
        Ok(run_state(
            &self.cfg,
            self.step,
            self.opt.adamw().updates(),
            self.skipped,
            digest,
        ))
    }

    /// Save a checkpoint of the current step under `run_dir` (atomically;
    /// see [`checkpoint`]), keeping the newest `keep`, recording this
    /// backend's device and precision. Weights and moments are read
    /// on the host (downloaded from a device).
    pub fn save_checkpoint(&mut self, run_dir: &Path, keep: usize) -> Result<PathBuf> {
        let meta = CheckpointMeta {
            device: self.backend.device_name().to_string(),
            precision: self.backend.precision_name().to_string(),
            ..CheckpointMeta::default()
        };
        self.save_checkpoint_with_meta(run_dir, keep, &meta)
    }

    /// [`Self::save_checkpoint`] recording `meta` (device, precision,
    /// schedule changes) as given.
    pub fn save_checkpoint_with_meta(
        &mut self,
        run_dir: &Path,
        keep: usize,
        meta: &CheckpointMeta,
    ) -> Result<PathBuf> {
        if self.optimizer_is_sharded() {
            return Err(TrainError::Config(
                "the optimizer state is sharded (ZeRO-1): save through \
                 DataParallel::save_checkpoint, which gathers the moments of every shard"
                    .into(),
            ));
        }
        let (exp_avg, exp_avg_sq) = self.shard_moments_host()?;
        self.save_checkpoint_with_moments(run_dir, keep, meta, &exp_avg, &exp_avg_sq)
    }

    /// Replace the weights with `host` (same length). For fault-injection
    /// tests and tools that edit weights; not part of training.
    pub fn set_params_host(&mut self, host: &[f32]) -> Result<()> {
        self.params = self.backend.upload(host)?;
        Ok(())
    }
}

/// Zero moments on `backend` for `cfg`'s optimizer and schedule.
fn fresh_optimizer<B: Backend>(backend: &mut B, cfg: &RunConfig) -> Result<Optimizer<B::Arena>> {
    let (m, v) = (backend.zeros()?, backend.zeros()?);
    Optimizer::fresh(cfg.optimizer, cfg.schedule, backend.layout(), m, v)
}

/// A checkpoint's weights on `backend`, after checking their length.
fn upload_weights<B: Backend>(backend: &mut B, host: &[f32], path: &str) -> Result<B::Arena> {
    let n = backend.layout().len();
    if host.len() != n {
        return Err(TrainError::Checkpoint {
            path: path.to_string(),
            detail: format!("its weights have {} elements, the model {n}", host.len()),
        });
    }
    backend.upload(host)
}

/// Check that a model of shape `model` and `data` are the parts `cfg`
/// asks for (and that `cfg` itself is valid): what every backend checks
/// before it holds a replica of the run.
fn check_run_parts(model: &ModelConfig, cfg: &RunConfig, data: &Dataset) -> Result<()> {
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
        let batch = data.eval_batch(cfg.seed, index, rows)?;
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
