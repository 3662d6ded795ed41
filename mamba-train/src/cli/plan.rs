//! The resolved run of `mamba-train train` as every rank (and the
//! supervisor) computes it from the flags, the environment contract and the
//! checkpoint to resume, validated before anything starts.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::args::TrainArgs;
use super::resolve::resolve_run_in;
use crate::checkpoint::{self, state::RunState, ScheduleChange, STATE_FILE};
use crate::data::Corpus;
use crate::error::{Result, TrainError};
use crate::train::RunConfig;

/// Run settings from the environment contract (`MAMBA_SEED`,
/// `MAMBA_LOGICAL_WORLD`), which act as flags when the flag is absent.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct EnvRun {
    pub(super) seed: Option<u64>,
    pub(super) logical_world: Option<usize>,
}

/// The resolved run and what it needs, as every rank (and the supervisor)
/// computes it.
pub(super) struct Plan {
    pub(super) run: RunConfig,
    pub(super) corpus: Option<Arc<Corpus>>,
    /// Where the loop ends (`--stop-at` or the run's steps).
    pub(super) end: u64,
    /// The schedule's extension (`--extend`), if any.
    pub(super) extension: Option<ScheduleChange>,
}

/// Resolve and validate the run for a world of `world` processes, given
/// the recorded state of the checkpoint to resume.
pub(super) fn plan_run(
    args: &TrainArgs,
    recorded: Option<&(PathBuf, RunState)>,
    world: usize,
    env: EnvRun,
) -> Result<Plan> {
    if let (Some(init), Some(_)) = (&args.init_from, recorded) {
        return Err(TrainError::Config(format!(
            "--init-from {} starts a new run from pretrained weights, --resume continues a run \
             from its checkpoint; give one of them",
            init.display()
        )));
    }
    let rec_run = recorded.map(|(_, st)| &st.run);
    // `MAMBA_SEED` acts as `--seed` when the flag is absent.
    let mut with_seed;
    let args = match (args.seed, env.seed) {
        (None, Some(seed)) => {
            with_seed = args.clone();
            with_seed.seed = Some(seed);
            &with_seed
        }
        _ => args,
    };
    let resolved = resolve_run_in(args, rec_run, world, env.logical_world)?;
    let run = resolved.run;
    let extension = match (args.extend, recorded) {
        (false, _) => None,
        (true, None) => {
            return Err(TrainError::Config(
                "--extend continues a resumed run past its planned steps; it needs --resume".into(),
            ))
        }
        (true, Some((_, st))) => {
            let old = st.run.schedule.total_steps;
            match args.steps {
                Some(n) if n > old => Some(ScheduleChange {
                    at_step: st.step,
                    old_total: old,
                    new_total: n,
                }),
                Some(n) => {
                    return Err(TrainError::Config(format!(
                        "--extend needs --steps larger than the run's planned {old} steps, got --steps {n}"
                    )))
                }
                None => {
                    return Err(TrainError::Config(format!(
                        "--extend needs the new total as --steps N, larger than the run's planned {old} steps"
                    )))
                }
            }
        }
    };
    if let Some((dir, st)) = recorded {
        let mut rec = st.run.clone();
        if let Some(x) = &extension {
            rec.schedule.total_steps = x.new_total;
        }
        run.mismatches(&rec).map_err(|mut detail| {
            if run.schedule.total_steps != rec.schedule.total_steps {
                detail.push_str(
                    "; to train a resumed run past its planned steps, pass --extend with the new --steps",
                );
            }
            TrainError::Checkpoint {
                path: dir.display().to_string(),
                detail,
            }
        })?;
    }
    if let Some(stop) = args.stop_at {
        if stop == 0 || stop > run.schedule.total_steps {
            return Err(TrainError::Config(format!(
                "--stop-at must be within 1..={} (the run's steps), got {stop}",
                run.schedule.total_steps
            )));
        }
        if let Some((_, st)) = recorded {
            if stop <= st.step {
                return Err(TrainError::Config(format!(
                    "--stop-at {stop} is not after the checkpoint's step {}",
                    st.step
                )));
            }
        }
    }
    Ok(Plan {
        end: args.stop_at.unwrap_or(run.schedule.total_steps),
        run,
        corpus: resolved.corpus,
        extension,
    })
}

/// The state of the checkpoint `path` resolves to (without its tensors).
pub(super) fn read_state(path: &Path) -> Result<(PathBuf, RunState)> {
    let dir = checkpoint::resolve(path)?;
    let file = dir.join(STATE_FILE);
    let bytes = std::fs::read(&file).map_err(|e| TrainError::Checkpoint {
        path: file.display().to_string(),
        detail: format!("cannot read: {e}"),
    })?;
    let st: RunState = serde_json::from_slice(&bytes).map_err(|e| TrainError::Checkpoint {
        path: file.display().to_string(),
        detail: format!("not a valid state file: {e}"),
    })?;
    Ok((dir, st))
}
