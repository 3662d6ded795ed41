//! `mamba-train eval`: held-out loss, perplexity and accuracy of a
//! checkpoint, on the CPU or a GPU.
//!
//! One evaluation path: the task and seed come from the checkpoint's run,
//! and the numbers from [`evaluate_with`] — what
//! [`Trainer::evaluate`](crate::train::Trainer::evaluate) and the end of
//! `train` run — over the same held-out batches (`Domain::Eval`, rows of
//! `EVAL_ROWS` = 32). So `eval --batches N` of a run's last checkpoint gives
//! the held-out loss that `train --eval-batches N` printed, bit for bit on
//! the same device.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Args;

use super::arch::cpu_model;
use super::args::Device;
use super::drive::EVAL_ROWS;
use super::progress::stderr_line;
use super::run_dir::io_err;
use super::source::load_model;
use crate::data::Dataset;
use crate::error::{Result, TrainError};
use crate::model::cuda::CudaModel;
use crate::model::Backend;
use crate::train::{evaluate_with, EvalReport, RunConfig};

/// `mamba-train eval` flags.
#[derive(Clone, Debug, Args)]
pub struct EvalArgs {
    /// A mamba-train run directory or checkpoint directory (its run
    /// records the task to evaluate on).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: PathBuf,
    /// Held-out batches (of 32 rows) to score; the default is train's
    /// --eval-batches default, so the numbers match its final evaluation.
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub batches: usize,
    /// Where to run (cuda: GPU 0).
    #[arg(long, value_enum, default_value_t = Device::Cpu)]
    pub device: Device,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// What `eval` measured.
#[derive(Clone, Debug, PartialEq)]
pub struct EvalOutcome {
    /// The checkpoint directory evaluated.
    pub dir: PathBuf,
    /// Its step.
    pub step: u64,
    /// Loss, accuracy, chance.
    pub report: EvalReport,
    /// `exp(loss)`.
    pub perplexity: f64,
}

/// Run `eval`, writing the result to `out` (stdout in the binary).
pub fn eval(args: &EvalArgs, out: &mut dyn Write) -> Result<EvalOutcome> {
    if args.batches == 0 {
        return Err(TrainError::Config(
            "--batches must be at least 1 held-out batch, got 0".into(),
        ));
    }
    let model = load_model(&args.checkpoint, None)?;
    let Some((run, step)) = model.run.clone() else {
        return Err(TrainError::Config(format!(
            "--checkpoint {}: Hugging Face weights without a mamba-train run; eval reads the task \
             to score from a checkpoint's state.json, so pass a run or checkpoint directory",
            model.dir.display()
        )));
    };
    let data = Dataset::new(run.task.clone(), run.batch)?;
    stderr_line(&format!(
        "mamba-train eval: {} on {}; {} held-out {} of {EVAL_ROWS} rows",
        model.describe(),
        device_name(args.device),
        args.batches,
        if args.batches == 1 {
            "batch"
        } else {
            "batches"
        }
    ));
    let report = match args.device {
        Device::Cpu => score(cpu_model(&run.model)?, &model.params, &data, &run, args)?,
        Device::Cuda => {
            let m = CudaModel::new(run.model.clone(), 0).map_err(|e| {
                TrainError::Config(format!(
                    "--device cuda: {e}; on a machine without a GPU use --device cpu"
                ))
            })?;
            score(m, &model.params, &data, &run, args)?
        }
    };
    let outcome = EvalOutcome {
        dir: model.dir,
        step,
        perplexity: report.loss.exp(),
        report,
    };
    write_outcome(&outcome, &run, args, out)?;
    Ok(outcome)
}

fn device_name(d: Device) -> &'static str {
    match d {
        Device::Cpu => "cpu",
        Device::Cuda => "cuda",
    }
}

/// The evaluation of `params` on `backend` (the one path of the module docs).
fn score<B: Backend>(
    mut backend: B,
    params: &[f32],
    data: &Dataset,
    run: &RunConfig,
    args: &EvalArgs,
) -> Result<EvalReport> {
    let arena = backend.upload(params)?;
    evaluate_with(data, run, args.batches, EVAL_ROWS, |b| {
        backend.logits(&arena, b)
    })
}

fn write_outcome(
    o: &EvalOutcome,
    run: &RunConfig,
    args: &EvalArgs,
    out: &mut dyn Write,
) -> Result<()> {
    let r = &o.report;
    let text = if args.json {
        serde_json::json!({
            "checkpoint": o.dir.display().to_string(),
            "step": o.step,
            "task": run.task.kind().name(),
            "device": device_name(args.device),
            "batches": args.batches,
            "rows": EVAL_ROWS,
            "loss": r.loss,
            "perplexity": o.perplexity,
            "accuracy": r.accuracy.fraction(),
            "scored": r.accuracy.total,
            "chance": r.chance,
        })
        .to_string()
    } else {
        format!(
            "held-out loss: {:.6} (perplexity {:.4})\naccuracy: {:.1}% on {} held-out {} (chance {:.1}%)",
            r.loss,
            o.perplexity,
            100.0 * r.accuracy.fraction(),
            r.accuracy.total,
            run.task.scored_positions(),
            100.0 * r.chance
        )
    };
    let stdout = Path::new("<stdout>");
    writeln!(out, "{text}").map_err(|e| io_err(stdout, e))?;
    out.flush().map_err(|e| io_err(stdout, e))
}
