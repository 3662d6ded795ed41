//! `mamba-train train`: set up, loop, checkpoint, report.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::args::{Device, TrainArgs};
use super::progress::{human, Progress};
use super::resolve::resolve_run;
use crate::checkpoint::{self, atomic, CHECKPOINTS_DIR};
use crate::data::{Dataset, TaskSpec};
use crate::error::{Result, TrainError};
use crate::metrics::{read_records, MetricsLog, MetricsRecord};
use crate::model::cpu::CpuModel;
use crate::plot::loss_svg;
use crate::train::{RunConfig, Trainer};

/// Metrics file name in the run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// Loss plot file name in the run directory.
pub const PLOT_FILE: &str = "loss.svg";
/// Rows per held-out evaluation batch.
const EVAL_ROWS: usize = 32;

/// What a finished `train` command reports (also printed to stdout).
#[derive(Clone, Debug)]
pub struct TrainSummary {
    /// Steps completed.
    pub steps: u64,
    /// Steps skipped.
    pub skipped: u64,
    /// Loss of the last step run here (NaN when none ran).
    pub final_loss: f32,
    /// Held-out loss.
    pub eval_loss: f64,
    /// Held-out accuracy on scored positions.
    pub accuracy: f64,
    /// Accuracy of uniform guessing.
    pub chance: f64,
    /// The last checkpoint written.
    pub checkpoint: PathBuf,
    /// Hex SHA-256 of the final weights.
    pub weights_digest: String,
}

fn io_err(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Run `mamba-train train`, writing the summary to `out` (stdout in the
/// binary); the digest line is written last.
pub fn train(args: &TrainArgs, out: &mut dyn Write) -> Result<TrainSummary> {
    if args.device == Device::Cuda {
        return Err(TrainError::Config(
            "--device cuda is not supported yet: the CUDA model is not built into this version; use --device cpu"
                .into(),
        ));
    }
    if let Some(n) = args.threads {
        if n == 0 {
            return Err(TrainError::Config(
                "--threads must be at least 1, got 0".into(),
            ));
        }
        // Fails only if the global pool was already built (a second call in
        // one process, e.g. from tests); the bits do not depend on it.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }

    let ck = match &args.resume {
        Some(dir) => Some(checkpoint::load(dir)?),
        None => None,
    };
    let resolved = resolve_run(args, ck.as_ref().map(|c| &c.state.run))?;
    let run = resolved.run;
    if let Some(c) = &ck {
        run.mismatches(&c.state.run)
            .map_err(|detail| TrainError::Checkpoint {
                path: c.dir.display().to_string(),
                detail,
            })?;
    }
    if let Some(stop) = args.stop_at {
        if stop == 0 || stop > run.schedule.total_steps {
            return Err(TrainError::Config(format!(
                "--stop-at must be within 1..={} (the run's steps), got {stop}",
                run.schedule.total_steps
            )));
        }
    }
    let data = match (&run.task, resolved.corpus) {
        (TaskSpec::Text(t), Some(bytes)) => Dataset::with_corpus(t.clone(), bytes, run.batch)?,
        _ => Dataset::new(run.task.clone(), run.batch)?,
    };
    let model = CpuModel::new(run.model.clone())?;

    let run_dir = args.out.clone();
    fs::create_dir_all(&run_dir).map_err(|e| io_err(&run_dir, e))?;
    let in_place = match &ck {
        Some(c) => same_run_dir(&c.dir, &run_dir),
        None => false,
    };
    let metrics_path = run_dir.join(METRICS_FILE);
    if let (Some(stop), Some(c)) = (args.stop_at, &ck) {
        if stop <= c.state.step {
            return Err(TrainError::Config(format!(
                "--stop-at {stop} is not after the checkpoint's step {}",
                c.state.step
            )));
        }
    }
    // A run resumed in its own directory already has this step's checkpoint.
    let mut last_ck: Option<PathBuf> = ck.as_ref().filter(|_| in_place).map(|c| c.dir.clone());
    let mut trainer = match ck {
        Some(c) => Trainer::resume(model, run.clone(), data, c)?,
        None => Trainer::new(model, run.clone())?,
    };
    let mut metrics = if in_place {
        MetricsLog::resume(&metrics_path, trainer.step())?
    } else {
        clear_run_dir(&run_dir)?;
        MetricsLog::create(&metrics_path)?
    };

    eprintln!(
        "{}",
        describe(
            &run,
            trainer.model().layout().len(),
            &run_dir,
            trainer.step()
        )
    );
    let end = args.stop_at.unwrap_or(run.schedule.total_steps);
    let mut progress = Progress::new(trainer.step(), run.schedule.total_steps, args.log_every);
    let started = Instant::now();
    let first_step = trainer.step();
    let mut final_loss = f32::NAN;
    while trainer.step() < end {
        let t0 = Instant::now();
        let s = trainer.train_step()?;
        let secs = t0.elapsed().as_secs_f64();
        final_loss = s.loss;
        metrics.append(&MetricsRecord {
            step: s.step,
            loss: s.loss as f64,
            lr: s.lr as f64,
            grad_norm: s.grad_norm,
            tokens_per_s: s.tokens as f64 / secs.max(1e-9),
            skipped: s.skipped,
            skipped_steps: s.skipped_total,
        })?;
        progress.step(&s, secs);
        if args.checkpoint_every > 0 && s.step % args.checkpoint_every == 0 && s.step < end {
            last_ck = Some(trainer.save_checkpoint(&run_dir, args.keep_checkpoints)?);
            write_plot(&run_dir, &run)?;
        }
    }
    progress.finish();
    let elapsed = started.elapsed().as_secs_f64();
    let checkpoint = match last_ck {
        Some(p) if p.ends_with(checkpoint::step_dir_name(trainer.step())) => p,
        _ => trainer.save_checkpoint(&run_dir, args.keep_checkpoints)?,
    };
    write_plot(&run_dir, &run)?;
    let eval = trainer.evaluate(args.eval_batches.max(1), EVAL_ROWS)?;

    let ran = trainer.step() - first_step;
    let tokens = ran as f64 * run.tokens_per_step() as f64;
    let summary = TrainSummary {
        steps: trainer.step(),
        skipped: trainer.skipped_steps(),
        final_loss,
        eval_loss: eval.loss,
        accuracy: eval.accuracy.fraction(),
        chance: eval.chance,
        checkpoint,
        weights_digest: trainer.weights_digest(),
    };
    let w = |out: &mut dyn Write, line: String| -> Result<()> {
        writeln!(out, "{line}").map_err(|e| io_err(Path::new("<stdout>"), e))
    };
    w(
        out,
        format!(
            "steps: {} of {} ({} run here, {} skipped), {} tokens in {:.1} s ({} tokens/s)",
            summary.steps,
            run.schedule.total_steps,
            ran,
            summary.skipped,
            human(tokens),
            elapsed,
            human(tokens / elapsed.max(1e-9))
        ),
    )?;
    if trainer.step() < run.schedule.total_steps {
        w(
            out,
            format!(
                "stopped at step {} (--stop-at); continue with --resume {}",
                trainer.step(),
                run_dir.display()
            ),
        )?;
    }
    let last = if ran > 0 {
        format!("{:.4} (last step)", summary.final_loss)
    } else {
        "n/a (no step run)".into()
    };
    w(
        out,
        format!("final loss: {last}, held-out loss {:.4}", summary.eval_loss),
    )?;
    w(
        out,
        format!(
            "accuracy: {:.1}% on {} held-out {} (chance {:.1}%)",
            100.0 * summary.accuracy,
            eval.accuracy.total,
            run.task.scored_positions(),
            100.0 * summary.chance
        ),
    )?;
    w(
        out,
        format!(
            "run directory: {} (metrics.jsonl, loss.svg)",
            run_dir.display()
        ),
    )?;
    w(out, format!("checkpoint: {}", summary.checkpoint.display()))?;
    w(out, format!("weights-digest: {}", summary.weights_digest))?;
    out.flush().map_err(|e| io_err(Path::new("<stdout>"), e))?;
    Ok(summary)
}

/// True when the checkpoint `ck_dir` lives in `run_dir`'s checkpoints, i.e.
/// the run continues in its own directory.
fn same_run_dir(ck_dir: &Path, run_dir: &Path) -> bool {
    match (
        ck_dir.canonicalize(),
        run_dir.join(CHECKPOINTS_DIR).canonicalize(),
    ) {
        (Ok(a), Ok(b)) => a.starts_with(b),
        _ => false,
    }
}

/// A fresh run in an existing directory replaces the previous run's
/// artifacts (only the files this program writes; anything else stays).
fn clear_run_dir(run_dir: &Path) -> Result<()> {
    let ck = run_dir.join(CHECKPOINTS_DIR);
    let had = ck.exists() || run_dir.join(METRICS_FILE).exists();
    if ck.exists() {
        fs::remove_dir_all(&ck).map_err(|e| io_err(&ck, e))?;
    }
    for f in [METRICS_FILE, PLOT_FILE] {
        let p = run_dir.join(f);
        if p.exists() {
            fs::remove_file(&p).map_err(|e| io_err(&p, e))?;
        }
    }
    if had {
        eprintln!(
            "note: starting a fresh run in {} (the previous run's checkpoints and metrics there are replaced; use --resume to continue one)",
            run_dir.display()
        );
    }
    Ok(())
}

fn write_plot(run_dir: &Path, run: &RunConfig) -> Result<()> {
    let records = read_records(&run_dir.join(METRICS_FILE))?;
    let pts: Vec<(u64, f64)> = records.iter().map(|r| (r.step, r.loss)).collect();
    let title = format!(
        "{}: d_model {}, {} layers, batch {}, seed {}",
        run.task.kind(),
        run.model.d_model,
        run.model.n_layer,
        run.batch,
        run.seed
    );
    let path = run_dir.join(PLOT_FILE);
    atomic::replace_file(&path, loss_svg(&title, &pts).as_bytes()).map_err(|e| io_err(&path, e))
}

fn describe(run: &RunConfig, n_params: usize, run_dir: &Path, step: u64) -> String {
    let task = match &run.task {
        TaskSpec::SelectiveCopy(c) => format!(
            "selective-copy (seq {}, remember {} of {} symbols)",
            c.seq_len, c.n_memorize, c.alphabet
        ),
        TaskSpec::Induction(c) => format!("induction (seq {}, {} symbols)", c.seq_len, c.alphabet),
        TaskSpec::Text(c) => format!(
            "text {} ({} bytes, seq {})",
            c.path.display(),
            c.file_len,
            c.seq_len
        ),
    };
    let from = if step > 0 {
        format!(", resuming at step {step}")
    } else {
        String::new()
    };
    format!(
        "mamba-train: {task}; d_model {} x {} layers ({} params); batch {}; {} steps, lr {}, warmup {}; seed {}; {} threads; out {}{from}",
        run.model.d_model,
        run.model.n_layer,
        n_params,
        run.batch,
        run.schedule.total_steps,
        run.schedule.peak_lr,
        run.schedule.warmup_steps,
        run.seed,
        rayon::current_num_threads(),
        run_dir.display()
    )
}
