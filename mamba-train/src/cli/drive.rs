//! The rank's side of `mamba-train train`, generic over the model backend
//! and the reducer: the step loop, rank 0's run directory (metrics,
//! checkpoints, plot), progress, and the end-of-run protocol.
//!
//! Every rank makes the same collective calls in the same order: the steps,
//! the replica checks (every `--replica-check-every` steps, before every
//! checkpoint, at the end) and the final barrier. Only rank 0 touches the
//! file system or stdout.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use mamba_comm::stop_signal::StopSignal;
use mamba_reduce::Reducer;

pub use super::context::RankContext;
use super::progress::{human, stderr_line, Progress};
use super::report::{contract_note, describe, plural, TrainOutcome, TrainSummary};
use super::run_dir::{io_err, write_plot, RunDir};
use crate::dp::DataParallel;
use crate::error::{Result, TrainError};
use crate::metrics::MetricsRecord;
use crate::train::Backend;

/// Rows per held-out evaluation batch (also `eval`'s, so its numbers are
/// the final evaluation's).
pub(crate) const EVAL_ROWS: usize = 32;

/// Train this rank to the end (see the module docs) and report.
pub fn drive<B, R>(
    dp: &mut DataParallel<B, R>,
    ctx: &RankContext<'_>,
    out: &mut dyn Write,
) -> Result<TrainOutcome>
where
    B: Backend,
    R: Reducer<Buffer = B::Arena>,
{
    let args = ctx.args;
    let (rank, world) = (dp.rank(), dp.world());
    let lead = rank == 0;
    let run = dp.trainer().run_config().clone();
    let first_step = dp.trainer().step();
    let mut dir = if lead {
        Some(RunDir::open(ctx, first_step)?)
    } else {
        None
    };
    if lead {
        stderr_line(&describe(
            &run,
            dp.trainer().arena_len(),
            dp.trainer().backend().device_name(),
            &ctx.out,
            first_step,
            world,
            ctx,
        ));
        if let Some(note) = contract_note(run.contract, world, run.logical_world) {
            stderr_line(&note);
        }
        if args.shard_optimizer {
            stderr_line(&match dp.optimizer_shards() {
                Some(z) => format!(
                    "note: --shard-optimizer: each of the {world} processes keeps and updates its \
                     shard of the optimizer state (rank 0: elements {:?} of {})",
                    z.range(0),
                    dp.trainer().arena_len()
                ),
                None => "note: --shard-optimizer with one process: the optimizer state stays \
                         whole (there is nothing to shard)"
                    .to_string(),
            });
        }
    }
    let total = run.schedule.total_steps;
    let mut progress = lead.then(|| Progress::new(first_step, total, args.log_every));
    let started = Instant::now();
    let mut final_loss = f32::NAN;
    // SIGTERM/SIGINT (to this rank or, forwarded, to the supervisor): the
    // world stops at the next step boundary, in agreement (one small
    // collective per step), and rank 0 checkpoints that step below.
    let stop = StopSignal::install()?;
    let mut stopped = None;
    // The step of the last checkpoint, known to every rank (saving may be
    // collective, so every rank decides alike whether the end needs one).
    let mut saved_at: Option<u64> = None;
    while dp.trainer().step() < ctx.end {
        if let Some(request) = dp.stop_requests(stop.requested())? {
            stopped = Some(request);
            break;
        }
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
            // Every rank: a sharded optimizer's moments are gathered first.
            let saved = dp.save_checkpoint(
                dir.as_ref().map(|d| d.path.as_path()),
                args.keep_checkpoints,
                &ctx.meta,
            )?;
            saved_at = Some(s.step);
            if let Some(d) = dir.as_mut() {
                d.last_ck = saved;
                write_plot(&d.path, &run)?;
            }
        }
    }
    if let Some(p) = &progress {
        p.finish();
    }
    let elapsed = started.elapsed().as_secs_f64();
    let step = dp.trainer().step();
    let agreed = dp.replica_check(&format!("at the end (step {step})"))?;
    let mut checkpoint = PathBuf::new();
    let last_ck = dir.as_mut().and_then(|d| d.last_ck.take());
    let saved = if saved_at == Some(step) {
        last_ck
    } else {
        dp.save_checkpoint(
            dir.as_ref().map(|d| d.path.as_path()),
            args.keep_checkpoints,
            &ctx.meta,
        )?
    };
    if let Some(d) = dir.as_mut() {
        checkpoint = saved.unwrap_or_default();
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
    if let Some((by, signal)) = stopped {
        let detail = if lead {
            format!(
                "checkpoint {}; continue with: mamba-train train --resume {}{}",
                checkpoint.display(),
                ctx.out.display(),
                resume_flags(args, world)
            )
        } else {
            "rank 0 wrote the checkpoint".to_string()
        };
        return Err(TrainError::Stopped {
            signal,
            rank: by,
            step,
            detail,
        });
    }
    if !lead {
        return Ok(TrainOutcome::Replica {
            rank,
            steps: step,
            weights_digest: agreed.digest,
        });
    }

    let eval = dp
        .trainer_mut()
        .evaluate(args.eval_batches.max(1), EVAL_ROWS)?;
    let ran = step - first_step;
    let tokens = ran as f64 * run.tokens_per_step() as f64;
    let summary = TrainSummary {
        steps: step,
        skipped: dp.trainer().skipped_steps(),
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
                ctx.out.display()
            ),
        )?;
    }
    if world > 1 || run.logical_world > 1 {
        w(
            out,
            format!(
                "world: {world} {} x {} {} = logical world {} ({}); {} replica checks passed",
                plural(world, "process"),
                run.logical_world / world,
                plural(run.logical_world / world, "micro-batch"),
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
            ctx.out.display()
        ),
    )?;
    w(out, format!("checkpoint: {}", summary.checkpoint.display()))?;
    w(out, format!("weights-digest: {}", summary.weights_digest))?;
    out.flush().map_err(|e| io_err(Path::new("<stdout>"), e))?;
    Ok(TrainOutcome::Summary(summary))
}

/// The flags, besides `--resume`, that a stopped run's continuation needs
/// to run where it ran (the run itself comes from the checkpoint).
fn resume_flags(args: &super::args::TrainArgs, world: usize) -> String {
    let mut flags = String::new();
    if args.device == super::args::Device::Cuda {
        flags.push_str(" --device cuda");
    }
    if world > 1 && args.world.is_some() {
        flags.push_str(&format!(" --world {world}"));
    }
    flags
}
