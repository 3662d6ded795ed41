//! [`CudaReplica`]: one rank's model replica on its GPU, as a
//! [`DpBackend`] over device arenas.

use std::path::{Path, PathBuf};

use cudarc::driver::CudaSlice;

use crate::checkpoint::{self, arena_digest, Checkpoint, CheckpointRef};
use crate::data::Dataset;
use crate::dp::DpBackend;
use crate::error::{Result, TrainError};
use crate::model::cuda::{CudaModel, CudaOptimizer};
use crate::model::Batch;
use crate::optim::{AdamW, Optimizer};
use crate::train::trainer::check_run_parts;
use crate::train::{evaluate_with, run_state, EvalReport, RunConfig, StepStats};

/// Weights, AdamW moments and data position of one run on one GPU.
///
/// Everything heavy lives on the device: the parameter arena, the moments
/// (inside [`CudaOptimizer`]) and the gradient arenas the loop allocates
/// through [`DpBackend::alloc_arena`]. The host sees the weights only for
/// the digest, checkpoints and the replica check (downloads), and sees
/// gradients never.
///
/// Streams: every operation is enqueued on the model's stream, which in a
/// world is the communicator's ([`CudaModel::with_stream`]), so the
/// reduction is ordered after the backward pass and the optimizer after the
/// reduction by the stream alone. Calls that return a host value (the loss,
/// the norm, a download) synchronize it.
///
/// Determinism: the model and the optimizer are deterministic run to run
/// (the model's docs), and the data is the rank-free seed law's, so the
/// same weights and reduced gradient give the same bits on every rank.
pub struct CudaReplica {
    model: CudaModel,
    cfg: RunConfig,
    data: Dataset,
    params: CudaSlice<f32>,
    opt: CudaOptimizer,
    step: u64,
    skipped: u64,
}

impl CudaReplica {
    /// A fresh run: the reference initialisation from the seed law (the
    /// CPU's, uploaded), zero moments, step 0.
    pub fn new(model: CudaModel, cfg: RunConfig, data: Dataset) -> Result<Self> {
        check_run_parts(model.config(), &cfg, &data)?;
        let params = model.init_params(cfg.seed)?;
        let opt = CudaOptimizer::new(&model, cfg.optimizer, cfg.schedule)?;
        Ok(CudaReplica {
            model,
            cfg,
            data,
            params,
            opt,
            step: 0,
            skipped: 0,
        })
    }

    /// Continue the run recorded in `ck` (weights and moments uploaded).
    /// `cfg` is the requested run; it must equal the recorded one (the
    /// error names every differing setting). A checkpoint written by the
    /// CPU trainer loads too (same format); the bits then follow the CUDA
    /// kernels from here on.
    pub fn resume(model: CudaModel, cfg: RunConfig, data: Dataset, ck: Checkpoint) -> Result<Self> {
        check_run_parts(model.config(), &cfg, &data)?;
        let path = ck.dir.display().to_string();
        cfg.mismatches(&ck.state.run)
            .map_err(|detail| TrainError::Checkpoint {
                path: path.clone(),
                detail,
            })?;
        let n = model.layout().len();
        if ck.params.len() != n {
            return Err(TrainError::Checkpoint {
                path,
                detail: format!(
                    "its weights have {} elements, the model {n}",
                    ck.params.len()
                ),
            });
        }
        let st = &ck.state;
        let adamw = AdamW::from_state(
            cfg.optimizer,
            model.layout(),
            ck.exp_avg,
            ck.exp_avg_sq,
            st.optimizer_updates,
        )?;
        let host_opt = Optimizer::from_parts(adamw, cfg.schedule)?;
        let opt = CudaOptimizer::from_host(&model, &host_opt)?;
        let params = model.upload(&ck.params)?;
        let (step, skipped) = (st.step, st.skipped_steps);
        Ok(CudaReplica {
            model,
            cfg,
            data,
            params,
            opt,
            step,
            skipped,
        })
    }

    /// The model (its stream, context, layout).
    pub fn model(&self) -> &CudaModel {
        &self.model
    }

    /// The weights on the host (synchronizes the stream).
    pub fn params_host(&self) -> Result<Vec<f32>> {
        self.model.download(&self.params)
    }

    /// The optimizer on the host: moments downloaded (synchronizes).
    pub fn optimizer_host(&self) -> Result<Optimizer> {
        self.opt.to_host()
    }
}

impl DpBackend for CudaReplica {
    type Buffer = CudaSlice<f32>;

    fn run_config(&self) -> &RunConfig {
        &self.cfg
    }

    fn step(&self) -> u64 {
        self.step
    }

    fn skipped_steps(&self) -> u64 {
        self.skipped
    }

    fn arena_len(&self) -> usize {
        self.model.layout().len()
    }

    fn alloc_arena(&mut self) -> Result<CudaSlice<f32>> {
        self.model.zeros_arena()
    }

    fn micro_gradient(&mut self, micro: u64, grads: &mut CudaSlice<f32>) -> Result<f32> {
        let batch = self.data.train_batch(self.cfg.seed, self.step, micro);
        self.model.forward_backward(&self.params, &batch, grads)
    }

    /// Always `true`, without reading the arena: a non-finite gradient
    /// element makes the reduced mean non-finite on every rank (NaN and
    /// infinity survive every sum and the `1/L` scale), so the optimizer's
    /// global-norm check skips that step on every rank alike, and the
    /// step is counted as skipped. A non-finite *loss* is still agreed on
    /// before the reduction (the loop checks it), which skips the
    /// reduction as well. This saves a pass and a host wait per
    /// micro-batch.
    fn all_finite(&mut self, _grads: &CudaSlice<f32>) -> Result<bool> {
        Ok(true)
    }

    fn apply(&mut self, mean: &CudaSlice<f32>, loss: f32, proceed: bool) -> Result<StepStats> {
        let out = self.opt.step(self.step, &mut self.params, mean, proceed)?;
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

    fn weights_digest(&mut self) -> Result<String> {
        Ok(arena_digest(&self.params_host()?))
    }

    /// Downloads the weights and moments and writes the same checkpoint
    /// the CPU trainer writes (format, names, state).
    fn save_checkpoint(&mut self, run_dir: &Path, keep: usize) -> Result<PathBuf> {
        let params = self.params_host()?;
        let host_opt = self.optimizer_host()?;
        let adamw = host_opt.adamw();
        let state = run_state(
            &self.cfg,
            self.step,
            adamw.updates(),
            self.skipped,
            arena_digest(&params),
        );
        let ck = CheckpointRef {
            state: &state,
            params: &params,
            exp_avg: adamw.exp_avg(),
            exp_avg_sq: adamw.exp_avg_sq(),
        };
        checkpoint::save(run_dir, &ck, keep)
    }

    /// As the CPU trainer's, with the logits computed in pieces of at most
    /// the training batch's rows: the activation workspace keeps the
    /// training shape (no reallocation, no larger peak), and the rows of a
    /// batch are independent, so the pieces make up the whole.
    fn evaluate(&mut self, batches: usize, rows: usize) -> Result<EvalReport> {
        let piece = self.cfg.batch.max(1);
        let (model, params) = (&mut self.model, &self.params);
        evaluate_with(&self.data, &self.cfg, batches, rows, |batch| {
            logits_in_pieces(model, params, batch, piece)
        })
    }

    fn poison_gradient(&mut self, grads: &mut CudaSlice<f32>) -> Result<()> {
        let stream = self.model.stream().clone();
        if let Some(mut head) = grads.try_slice_mut(0..1) {
            stream
                .memcpy_htod(&[f32::NAN], &mut head)
                .map_err(|e| cuda("poisoning a gradient (test hook)", e))?;
        }
        Ok(())
    }

    fn perturb_weights(&mut self) -> Result<()> {
        let stream = self.model.stream().clone();
        let Some(head) = self.params.try_slice(0..1) else {
            return Ok(());
        };
        let mut w = stream
            .clone_dtoh(&head)
            .map_err(|e| cuda("reading weight 0 (test hook)", e))?;
        w[0] += 1.0;
        if let Some(mut head) = self.params.try_slice_mut(0..1) {
            stream
                .memcpy_htod(&w, &mut head)
                .map_err(|e| cuda("writing weight 0 (test hook)", e))?;
        }
        Ok(())
    }
}

/// Logits of `batch` (`[batch, seq_len, vocab]`, host), computed `piece`
/// rows at a time.
fn logits_in_pieces(
    model: &mut CudaModel,
    params: &CudaSlice<f32>,
    batch: &Batch,
    piece: usize,
) -> Result<Vec<f32>> {
    let t = batch.seq_len;
    let n = batch.batch.saturating_mul(t);
    if batch.batch <= piece || batch.tokens.len() != n || batch.targets.len() != n {
        // One piece, or a malformed batch the model reports in full.
        return model.logits(params, batch);
    }
    let mut out = Vec::with_capacity(batch.batch * t * model.config().vocab_size);
    let mut row = 0;
    while row < batch.batch {
        let end = (row + piece).min(batch.batch);
        let part = Batch {
            tokens: batch.tokens[row * t..end * t].to_vec(),
            targets: batch.targets[row * t..end * t].to_vec(),
            batch: end - row,
            seq_len: t,
        };
        out.extend(model.logits(params, &part)?);
        row = end;
    }
    Ok(out)
}

fn cuda(what: &str, detail: impl std::fmt::Display) -> TrainError {
    TrainError::Cuda {
        what: what.to_string(),
        detail: detail.to_string(),
    }
}
