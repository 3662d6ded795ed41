//! The rank's side of `mamba-train train`, generic over the model backend
//! and the reducer: the step loop, rank 0's run directory (metrics,
//! checkpoints, plot), progress, and the end-of-run protocol.
//!
//! Every rank makes the same collective calls in the same order: the steps,
//! the replica checks (every `--replica-check-every` steps, before every
//! checkpoint, at the end) and the final barrier. Only rank 0 touches the
//! file system or stdout.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mamba_reduce::Reducer;

use super::args::TrainArgs;
use super::progress::{human, stderr_line, Progress};
use super::run::{contract_note, TrainOutcome};
use crate::checkpoint::{self, atomic, CHECKPOINTS_DIR};
use crate::data::TaskSpec;
use crate::dp::{DataParallel, DpBackend};
use crate::error::{Result, TrainError};
use crate::metrics::{read_records, MetricsLog, MetricsRecord};
use crate::plot::loss_svg;
use crate::train::RunConfig;

/// Metrics file name in the run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// Loss plot file name in the run directory.
pub const PLOT_FILE: &str = "loss.svg";
/// Rows per held-out evaluation batch.
const EVAL_ROWS: usize = 32;

/// What a finished `train` command reports on rank 0 (also printed to
/// stdout).
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
    /// Hex SHA-256 of the final weights (the same on every rank).
    pub weights_digest: String,
    /// Processes in the world.
    pub world: usize,
    /// Logical world L.
    pub logical_world: usize,
    /// Replica checks run (all passed).
    pub replica_checks: u64,
}

/// What the loop needs to know besides the world.
pub struct RankContext<'a> {
    /// The command line.
    pub args: &'a TrainArgs,
    /// The step the loop stops after.
    pub end: u64,
    /// The checkpoint the run resumed from, if any.
    pub resumed_from: Option<PathBuf>,
    /// `cpu` or `cuda`, for the description line.
    pub device: &'static str,
    /// Worker threads of this rank, for the description line.
    pub threads: usize,
}

fn io_err(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Rank 0's run directory: metrics log and where checkpoints go.
struct RunDir {
    path: PathBuf,
    metrics: MetricsLog,
    last_ck: Option<PathBuf>,
}

impl RunDir {
    /// Open (resumed in place) or start fresh (replacing a previous run's
    /// artifacts) the run directory of `ctx`, at `step`.
    fn open(ctx: &RankContext<'_>, step: u64) -> Result<RunDir> {
        let path = ctx.args.out.clone();
        fs::create_dir_all(&path).map_err(|e| io_err(&path, e))?;
        let in_place = ctx
            .resumed_from
            .as_ref()
            .is_some_and(|ck| same_run_dir(ck, &path));
        let metrics_path = path.join(METRICS_FILE);
        let metrics = if in_place {
            MetricsLog::resume(&metrics_path, step)?
        } else {
            clear_run_dir(&path)?;
            MetricsLog::create(&metrics_path)?
        };
        // A run resumed in its own directory already has this step's
        // checkpoint.
        let last_ck = ctx.resumed_from.clone().filter(|_| in_place);
        Ok(RunDir {
            path,
            metrics,
            last_ck,
        })
    }
}

/// Train this rank to the end (see the module docs) and report.
pub fn drive<B, R>(
    dp: &mut DataParallel<B, R>,
    ctx: &RankContext<'_>,
    out: &mut dyn Write,
) -> Result<TrainOutcome>
where
    B: DpBackend,
    R: Reducer<Buffer = B::Buffer>,
{
    let args = ctx.args;
    let (rank, world) = (dp.rank(), dp.world());
    let lead = rank == 0;
    let run = dp.backend().run_config().clone();
    let first_step = dp.backend().step();
    let mut dir = if lead {
        Some(RunDir::open(ctx, first_step)?)
    } else {
        None
    };
    if lead {
        stderr_line(&describe(
            &run,
            dp.backend().arena_len(),
            &args.out,
            first_step,
            world,
            ctx,
        ));
        if let Some(note) = contract_note(run.contract, world, run.logical_world) {
            stderr_line(&note);
        }
    }
    let total = run.schedule.total_steps;
    let mut progress = lead.then(|| Progress::new(first_step, total, args.log_every));
    let started = Instant::now();
    let mut final_loss = f32::NAN;
    while dp.backend().step() < ctx.end {
        let t0 = Instant::now();
        let s = dp.step()?;
        let secs = t0.elapsed().as_secs_f64();
        final_loss = s.loss;
        if let (Some(d), Some(p)) = (dir.as_mut(), progress.as_mut()) {
            d.metrics.append(&MetricsRecord {
                step: s.step,
                loss: s.loss as f64,
                lr: s.lr as f64,
                grad_norm: s.grad_norm,
                tokens_per_s: s.tokens as f64 / secs.max(1e-9),
                skipped: s.skipped,
                skipped_steps: s.skipped_total,
            })?;
            p.step(&s, secs);
        }
        if args.checkpoint_every > 0 && s.step % args.checkpoint_every == 0 && s.step < ctx.end {
            // Every rank: a checkpoint holds weights every rank agreed on.
            dp.replica_check(&format!("before the checkpoint of step {}", s.step))?;
            if let Some(d) = dir.as_mut() {
                d.last_ck = Some(
                    dp.backend_mut()
                        .save_checkpoint(&d.path, args.keep_checkpoints)?,
                );
                write_plot(&d.path, &run)?;
            }
        }
    }
    if let Some(p) = &progress {
        p.finish();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let step = dp.backend().step();
    let agreed = dp.replica_check(&format!("at the end (step {step})"))?;
    let mut checkpoint = PathBuf::new();
    if let Some(d) = dir.as_mut() {
        checkpoint = match d.last_ck.take() {
            Some(p) if p.ends_with(checkpoint::step_dir_name(step)) => p,
            _ => dp
                .backend_mut()
                .save_checkpoint(&d.path, args.keep_checkpoints)?,
        };
        write_plot(&d.path, &run)?;
    }
    if !lead {
        stderr_line(&format!(
            "[rank {rank} of {world}] weights-digest: {}",
            agreed.digest
        ));
    }
    // Rank 0 prints last: after every other rank printed its digest.
    dp.barrier()?;
    if !lead {
        return Ok(TrainOutcome::Replica {
            rank,
            steps: step,
            weights_digest: agreed.digest,
        });
    }

    let eval = dp
        .backend_mut()
        .evaluate(args.eval_batches.max(1), EVAL_ROWS)?;
    let ran = step - first_step;
    let tokens = ran as f64 * run.tokens_per_step() as f64;
    let summary = TrainSummary {
        steps: step,
        skipped: dp.backend().skipped_steps(),
        final_loss,
        eval_loss: eval.loss,
        accuracy: eval.accuracy.fraction(),
        chance: eval.chance,
        checkpoint,
        weights_digest: agreed.digest,
        world,
        logical_world: run.logical_world,
        replica_checks: dp.replica_checks(),
    };
    let w = |out: &mut dyn Write, line: String| -> Result<()> {
        writeln!(out, "{line}").map_err(|e| io_err(Path::new("<stdout>"), e))
    };
    w(
        out,
        format!(
            "steps: {} of {} ({} run here, {} skipped), {} tokens in {:.1} s ({} tokens/s)",
            summary.steps,
            total,
            ran,
            summary.skipped,
            human(tokens),
            elapsed,
            human(tokens / elapsed.max(1e-9))
        ),
    )?;
    if step < total {
        w(
            out,
            format!(
                "stopped at step {step} (--stop-at); continue with --resume {}",
                args.out.display()
            ),
        )?;
    }
    if world > 1 || run.logical_world > 1 {
        w(
            out,
            format!(
                "world: {world} process{} x {} micro-batch{} = logical world {} ({}); {} replica \
                 checks passed",
                if world == 1 { "" } else { "es" },
                run.logical_world / world,
                if run.logical_world / world == 1 {
                    ""
                } else {
                    "es"
                },
                run.logical_world,
                run.contract,
                summary.replica_checks
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
            args.out.display()
        ),
    )?;
    w(out, format!("checkpoint: {}", summary.checkpoint.display()))?;
    w(out, format!("weights-digest: {}", summary.weights_digest))?;
    out.flush().map_err(|e| io_err(Path::new("<stdout>"), e))?;
    Ok(TrainOutcome::Summary(summary))
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
        stderr_line(&format!(
            "note: starting a fresh run in {} (the previous run's checkpoints and metrics there are replaced; use --resume to continue one)",
            run_dir.display()
        ));
    }
    Ok(())
}

fn write_plot(run_dir: &Path, run: &RunConfig) -> Result<()> {
    let records = read_records(&run_dir.join(METRICS_FILE))?;
    let pts: Vec<(u64, f64)> = records.iter().map(|r| (r.step, r.loss)).collect();
    let title = format!(
        "{}: d_model {}, {} layers, batch {} x {}, seed {}",
        run.task.kind(),
        run.model.d_model,
        run.model.n_layer,
        run.batch,
        run.logical_world,
        run.seed
    );
    let path = run_dir.join(PLOT_FILE);
    atomic::replace_file(&path, loss_svg(&title, &pts).as_bytes()).map_err(|e| io_err(&path, e))
}

fn describe(
    run: &RunConfig,
    n_params: usize,
    run_dir: &Path,
    step: u64,
    world: usize,
    ctx: &RankContext<'_>,
) -> String {
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
    let layout = if world > 1 || run.logical_world > 1 {
        format!(
            "; {world} {} process{} x {} micro-batch{} (logical world {}, {})",
            ctx.device,
            if world == 1 { "" } else { "es" },
            run.logical_world / world,
            if run.logical_world / world == 1 {
                ""
            } else {
                "es"
            },
            run.logical_world,
            run.contract
        )
    } else {
        String::new()
    };
    format!(
        "mamba-train: {task}; d_model {} x {} layers ({} params); batch {}{layout}; {} steps, lr {}, warmup {}; seed {}; {} thread{}{}; out {}{from}",
        run.model.d_model,
        run.model.n_layer,
        n_params,
        run.batch,
        run.schedule.total_steps,
        run.schedule.peak_lr,
        run.schedule.warmup_steps,
        run.seed,
        ctx.threads,
        if ctx.threads == 1 { "" } else { "s" },
        if world > 1 { " per process" } else { "" },
        run_dir.display()
    )
}
