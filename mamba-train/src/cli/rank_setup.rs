//! The part of a rank's start that does not depend on its device: the
//! checkpoint to resume and its checks, the run plan (with `--extend`),
//! `--init-from` weights, the data, the precision, worker threads and the
//! options of the data-parallel loop ([`prepare_rank`]), and the engine
//! started from them ([`start_trainer`]). `run.rs` then builds the CPU or
//! CUDA model and the reducer around it.

use std::path::PathBuf;
use std::time::Duration;

#[cfg(feature = "fault-injection")]
use mamba_comm::bootstrap::ProcessEnv;
use mamba_comm::bootstrap::{Launcher, WorldPlace};
use mamba_reduce::RunIdentity;

use super::args::{Device, TrainArgs};
use super::plan::{plan_run, EnvRun, Plan};
use super::progress::stderr_line;
use super::run::check_cuda_only_flags;
use super::run_dir::run_dir_of;
use crate::checkpoint::{self, Checkpoint, CheckpointMeta, InitRecord};
use crate::config::Precision;
use crate::data::Dataset;
use crate::dp::DpOptions;
#[cfg(feature = "fault-injection")]
use crate::dp::FaultHooks;
use crate::error::{Result, TrainError};
use crate::train::{Backend, RunConfig, Trainer};

/// The run's precision: `--precision`, else (on --resume) the checkpoint's
/// on a GPU run, else f32. The CPU trains in f32 whatever the checkpoint
/// says (a checkpoint in another precision is then refused by
/// [`checkpoint::check_resume`], naming the flag).
fn run_precision(args: &TrainArgs, ck: Option<&Checkpoint>) -> Result<Precision> {
    check_cuda_only_flags(args)?;
    if let Some(p) = args.precision {
        return Ok(p);
    }
    match (args.device, ck) {
        (Device::Cuda, Some(c)) => c.meta.precision.parse().map_err(|e: String| {
            TrainError::Config(format!(
                "--resume {}: the checkpoint's precision: {e}",
                c.dir.display()
            ))
        }),
        _ => Ok(Precision::F32),
    }
}

/// Worker threads of this rank: `--threads`, else the cores shared among
/// the ranks this program started on this machine, else all cores. The
/// bits do not depend on it.
fn configure_threads(args: &TrainArgs, place: &WorldPlace) {
    let n = args.threads.or_else(|| {
        (place.world > 1 && place.launcher == Launcher::Mamba).then(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / place.world).max(1)
        })
    });
    if let Some(n) = n {
        // Fails only if the global pool was already built (a second call in
        // one process, e.g. from tests); the bits do not depend on it.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global();
    }
}

/// A fingerprint of the settings that decide when ranks make collective
/// calls (checkpoint and replica-check periods, the last step), for the
/// agreement check.
fn schedule_fingerprint(args: &TrainArgs, end: u64) -> u64 {
    RunIdentity::fingerprint_of(
        format!(
            "checkpoint_every={} replica_check_every={} end={end}",
            args.checkpoint_every, args.replica_check_every
        )
        .as_bytes(),
    )
}

/// What every rank sets up the same way whatever its device: the
/// checkpoint to resume, the resolved run, its data, the test hooks and
/// the options of its data-parallel loop.
pub(super) struct RankSetup {
    pub(super) ck: Option<Checkpoint>,
    pub(super) plan: Plan,
    pub(super) data: Dataset,
    pub(super) resumed_from: Option<PathBuf>,
    pub(super) opts: DpOptions,
    pub(super) timeout: Duration,
    pub(super) out: PathBuf,
    pub(super) meta: CheckpointMeta,
    /// The pretrained weights of `--init-from` (a fresh run only).
    pub(super) init: Option<Vec<f32>>,
    /// The precision of the training step (`--precision`, or the
    /// checkpoint's on --resume).
    pub(super) precision: Precision,
}

/// The engine for a rank: resumed from `ck`, else started from `init`'s
/// weights, else from the seed law.
pub(super) fn start_trainer<B: Backend>(
    model: B,
    run: &RunConfig,
    data: Dataset,
    ck: Option<Checkpoint>,
    init: Option<Vec<f32>>,
) -> Result<Trainer<B>> {
    match (ck, init) {
        (Some(c), _) => Trainer::resume(model, run.clone(), data, c),
        (None, Some(w)) => Trainer::from_weights(model, run.clone(), data, &w),
        (None, None) => Trainer::with_dataset(model, run.clone(), data),
    }
}

/// Everything a rank sets up before its device: threads, the checkpoint to
/// resume, the run plan, `--init-from` weights, the data, the loop options.
pub(super) fn prepare_rank(args: &TrainArgs, place: &WorldPlace) -> Result<RankSetup> {
    configure_threads(args, place);
    let lead = place.rank == 0;
    let device = match args.device {
        Device::Cpu => "cpu",
        Device::Cuda => "cuda",
    };
    let mut ck: Option<Checkpoint> = match &args.resume {
        Some(dir) => Some(checkpoint::load(dir)?),
        None => None,
    };
    let precision = run_precision(args, ck.as_ref())?;
    let mut meta = CheckpointMeta {
        device: device.into(),
        precision: precision.name().into(),
        schedule_changes: Vec::new(),
        init_from: None,
    };
    if let Some(c) = &ck {
        if let Some(note) = checkpoint::check_resume(c, device, precision.name())? {
            if lead {
                stderr_line(&note);
            }
        }
        meta.schedule_changes = c.meta.schedule_changes.clone();
        meta.init_from = c.meta.init_from.clone();
    }
    let recorded = ck.as_ref().map(|c| (c.dir.clone(), c.state.clone()));
    let env_run = EnvRun {
        seed: place.seed,
        logical_world: place.logical_world,
    };
    let plan = plan_run(args, recorded.as_ref(), place.world, env_run)?;
    if let (Some(x), Some(c)) = (&plan.extension, ck.as_mut()) {
        // The engine resumes the extended run: the checkpoint's schedule
        // is the new one from this step on, and its checkpoints say so.
        c.state.run.schedule.total_steps = x.new_total;
        meta.schedule_changes.push(x.clone());
        if lead {
            stderr_line(&format!(
                "note: --extend: the run's schedule grows from {} to {} steps at step {}; from \
                 here the learning rate (and so the bits) follow the cosine schedule of {} steps",
                x.old_total, x.new_total, x.at_step, x.new_total
            ));
        }
    }
    let run = &plan.run;
    let init = match &args.init_from {
        Some(dir) => {
            let (model, weights) = checkpoint::load_hf(&checkpoint::hf_model_dir(dir)?)?;
            if model != run.model {
                return Err(TrainError::Config(format!(
                    "--init-from {}: the model changed while the run started",
                    dir.display()
                )));
            }
            meta.init_from = Some(InitRecord {
                source: dir.display().to_string(),
                weights_sha256: checkpoint::arena_digest(&weights),
            });
            Some(weights)
        }
        None => None,
    };
    let data = match plan.corpus.clone() {
        Some(corpus) => Dataset::with_corpus(run.task.clone(), corpus, run.batch)?,
        None => Dataset::new(run.task.clone(), run.batch)?,
    };
    #[cfg(feature = "fault-injection")]
    let hooks = FaultHooks::from_env(&ProcessEnv)?;
    #[cfg(feature = "fault-injection")]
    if hooks.any() && place.rank == 0 {
        stderr_line(&format!(
            "note: fault-injection hooks are set ({hooks:?}); this is a test run"
        ));
    }
    let opts = DpOptions {
        replica_check_every: args.replica_check_every,
        #[cfg(feature = "fault-injection")]
        hooks,
        schedule_fingerprint: schedule_fingerprint(args, plan.end),
        shard_optimizer: args.shard_optimizer,
    };
    Ok(RankSetup {
        resumed_from: ck.as_ref().map(|c| c.dir.clone()),
        ck,
        plan,
        data,
        opts,
        timeout: Duration::from_secs(args.comm_timeout),
        out: run_dir_of(args)?,
        meta,
        init,
        precision,
    })
}
