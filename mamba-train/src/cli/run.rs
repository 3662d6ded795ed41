//! `mamba-train train`: find this process's place in the world (or start
//! the world), set up the rank, run the loop ([`super::drive`]).
//!
//! One process or many, the same path: a world of one is a one-rank host
//! world, so `--world 1 --logical-world 4` runs the same reducer as four
//! processes and lands on the same bits.
//!
//! Output protocol: only rank 0 writes the run directory (checkpoints,
//! metrics, plot), the progress display and stdout. Every other rank
//! prints `[rank R of P] weights-digest: <hex>` on stderr at the end; then
//! all ranks pass a barrier and rank 0 prints its summary, whose last
//! stdout line is `weights-digest: <hex>`. The digests are compared across
//! ranks before any is printed, so they are all the same. A supervising
//! process (self-spawn) writes nothing to stdout.
//!
//! The rank setup that CPU and CUDA ranks share is `rank_setup.rs`.

use std::io::Write;
use std::time::Duration;

use mamba_comm::bootstrap::{detect, overrides, ProcessEnv, WorldPlace};
use mamba_comm::supervisor::{start_world, Role, SpawnOptions};

use super::arch::cpu_model;
use super::args::{CliArch, Device, TrainArgs};
use super::context::RankContext;
use super::drive::drive;
use super::plan::{plan_run, read_state, EnvRun};
use super::progress::stderr_line;
use super::rank_setup::{prepare_rank, start_trainer, RankSetup};
use super::report::plural;
use super::run_dir::{check_run_dir, run_dir_of, RunLock};
use crate::config::Precision;
use crate::dp::{self, DataParallel};
use crate::error::{Result, TrainError};
use crate::model::cuda::CudaModel;

pub use super::report::{TrainOutcome, TrainSummary};
pub use super::run_dir::{METRICS_FILE, PLOT_FILE};

/// After the first failed rank, how long the others may take to notice
/// (their transports fail at once when a peer's socket closes) and log
/// their own error before the supervisor kills them.
pub const FAILURE_GRACE: Duration = Duration::from_secs(2);

/// The `[rank R of P] ` prefix for messages of a rank in a world of more
/// than one process (empty otherwise, or when the environment is invalid).
pub fn rank_prefix() -> String {
    match detect(&ProcessEnv) {
        Ok(Some(p)) if p.world > 1 => format!("[rank {} of {}] ", p.rank, p.world),
        _ => String::new(),
    }
}

/// Run `mamba-train train`, writing rank 0's summary to `out` (stdout in
/// the binary); the digest line is written last.
///
/// Without a launcher and with `--world P > 1`, this process validates the
/// run, starts `P` copies of this program as ranks, waits, and returns
/// [`TrainOutcome::Supervised`] (or the error naming the first failed
/// rank). Otherwise it is a rank and trains.
pub fn train(args: &TrainArgs, out: &mut dyn Write) -> Result<TrainOutcome> {
    if args.threads == Some(0) {
        return Err(TrainError::Config(
            "--threads must be at least 1, got 0".into(),
        ));
    }
    if args.world == Some(0) {
        return Err(TrainError::Config(
            "--world must be at least 1 process, got 0".into(),
        ));
    }
    if args.comm_timeout == 0 {
        return Err(TrainError::Config(
            "--comm-timeout must be at least 1 second, got 0".into(),
        ));
    }
    check_cuda_only_flags(args)?;
    check_arch_device(args)?;
    let env = ProcessEnv;
    let place = detect(&env)?;
    let ov = overrides(&env)?;
    let world = match &place {
        Some(p) => {
            if let Some(w) = args.world.filter(|&w| w != p.world) {
                return Err(TrainError::Config(format!(
                    "--world {w} was requested but the launcher ({}) started {} processes; \
                     request {} or launch {w}",
                    p.launcher.world_var(),
                    p.world,
                    p.world
                )));
            }
            p.world
        }
        None => args.world.unwrap_or(1),
    };
    // Every process (supervisor, rank) checks the GPU side first: without a
    // driver, kernels or NCCL it is one clear error before anything starts.
    let gpu = match args.device {
        Device::Cuda => Some(dp::cuda::preflight()?),
        Device::Cpu => None,
    };
    let mut opts = SpawnOptions {
        grace: FAILURE_GRACE,
        ..SpawnOptions::default()
    };
    if place.is_none() && world > 1 {
        // About to spawn: validate the whole run first, so a bad flag is
        // one error from this process rather than one per rank. (A rank
        // validates it again, from its own checkpoint load.)
        let recorded = match &args.resume {
            Some(dir) => Some(read_state(dir)?),
            None => None,
        };
        let env_run = EnvRun {
            seed: ov.seed,
            logical_world: ov.logical_world,
        };
        let plan = plan_run(args, recorded.as_ref(), world, env_run)?;
        // The run directory too (rank 0 checks it again, under its lock).
        let out = run_dir_of(args)?;
        RunLock::check_free(&out)?;
        check_run_dir(
            &out,
            recorded.as_ref().map(|(d, _)| d.as_path()),
            args.overwrite,
        )?;
        let (l, blocks) = (plan.run.logical_world, plan.run.logical_world / world);
        if let Some(host) = &gpu {
            dp::cuda::check_world_fits(host, world, l)?;
        }
        let kind = match args.device {
            Device::Cpu => "CPU processes (",
            Device::Cuda => "GPU processes (one GPU each, ",
        };
        stderr_line(&format!(
            "mamba-train: starting {world} {kind}logical world {l}, {blocks} {} each, \
             contract {})",
            plural(blocks, "micro-batch"),
            plan.run.contract
        ));
        opts.logical_world = Some(l);
    }
    match start_world(&env, Some(world), opts)? {
        Role::Supervised(report) => {
            report.check()?;
            stderr_line(&format!(
                "mamba-train: all {world} ranks finished in {:.1} s",
                report.elapsed.as_secs_f64()
            ));
            Ok(TrainOutcome::Supervised(report))
        }
        Role::Rank(place) => match gpu {
            None => run_cpu_rank(args, place, out),
            Some(host) => run_cuda_rank(args, place, &host, out),
        },
    }
}

/// `--precision` other than f32, `--recompute`, `--no-cuda-graph` and `--peer-fold` need
/// `--device cuda` (the CPU model trains in f32 and keeps its activations;
/// CPU worlds reduce over the host transport), and `--peer-fold` excludes
/// `--shard-optimizer`: refused by name otherwise.
pub fn check_cuda_only_flags(args: &TrainArgs) -> Result<()> {
    match (args.device, args.precision) {
        (Device::Cpu, Some(p)) if p != Precision::F32 => Err(TrainError::Config(format!(
            "--precision {p} needs --device cuda: the CPU model trains in f32 only; \
             add --device cuda or drop --precision"
        ))),
        _ if args.device == Device::Cpu && args.recompute => Err(TrainError::Config(
            "--recompute needs --device cuda: the CPU model keeps its activations (its \
             backward already recomputes the scan states); add --device cuda or drop \
             --recompute"
                .into(),
        )),
        _ if args.device == Device::Cpu && args.no_cuda_graph => Err(TrainError::Config(
            "--no-cuda-graph needs --device cuda: the CPU model has no CUDA graph to turn off; \
             add --device cuda or drop --no-cuda-graph"
                .into(),
        )),
        _ if args.device == Device::Cpu && args.peer_fold => Err(TrainError::Config(
            "--peer-fold needs --device cuda: it maps the GPU ranks' gradient arenas into each \
             other; CPU worlds reduce over the host transport; add --device cuda or drop \
             --peer-fold"
                .into(),
        )),
        _ if args.peer_fold && args.shard_optimizer => Err(TrainError::Config(
            "--peer-fold and --shard-optimizer cannot be combined yet: the peer fold has no \
             reduce-scatter or all-gather of the weight shards; drop one of them"
                .into(),
        )),
        _ => Ok(()),
    }
}

/// A `--d-state` above the CUDA Mamba-1 scan's limit on `--device cuda` is
/// refused before anything starts, naming the flag (Mamba-2 takes any
/// d_state). Without `--arch`, the run is Mamba-1 unless it continues a
/// checkpoint, whose architecture is not known yet: the model's own check
/// then refuses a Mamba-1 one.
pub fn check_arch_device(args: &TrainArgs) -> Result<()> {
    if args.device != Device::Cuda {
        return Ok(());
    }
    let mamba1 = match args.arch {
        Some(CliArch::Mamba1) => true,
        Some(CliArch::Mamba2) => false,
        None => args.resume.is_none() && args.init_from.is_none(),
    };
    let most = kernels::mamba::MAX_D_STATE;
    if let Some(n) = args.d_state.filter(|&n| mamba1 && n > most) {
        return Err(TrainError::Config(format!(
            "--d-state {n}: --device cuda takes at most {most} for --arch mamba1 (its scan's \
             limit); use a smaller --d-state, --arch mamba2 or --device cpu"
        )));
    }
    Ok(())
}

/// One rank of a CPU world: the engine over the CPU model (host arenas),
/// the host reducer over loopback sockets.
fn run_cpu_rank(args: &TrainArgs, place: WorldPlace, out: &mut dyn Write) -> Result<TrainOutcome> {
    let RankSetup {
        ck,
        plan,
        data,
        resumed_from,
        opts,
        timeout,
        out: run_dir,
        meta,
        init,
        precision: _,
    } = prepare_rank(args, &place)?;
    let run = plan.run.clone();
    let trainer = start_trainer(cpu_model(&run.model)?, &run, data, ck, init)?;
    let link = dp::host::connect(&place, timeout, trainer.arena_len())?;
    let reducer = dp::host::reducer(link.transport, &run);
    let mut world = DataParallel::new(trainer, reducer, opts)?;
    let ctx = RankContext {
        args,
        end: plan.end,
        resumed_from,
        threads: rayon::current_num_threads(),
        out: run_dir,
        meta,
    };
    let outcome = drive(&mut world, &ctx, out);
    // The rendezvous outlives the transport (rank 0 may serve it).
    drop(world);
    drop(link.rendezvous);
    outcome
}

/// Drive `trainer` with `reducer` to the end; the outcome with the parts
/// back, for the caller to free in its order.
fn train_on<R>(
    trainer: crate::train::Trainer<CudaModel>,
    reducer: R,
    opts: dp::DpOptions,
    ctx: &RankContext<'_>,
    out: &mut dyn Write,
) -> Result<(Result<TrainOutcome>, crate::train::Trainer<CudaModel>, R)>
where
    R: mamba_reduce::Reducer<Buffer = cudarc::driver::CudaSlice<f32>>,
{
    let mut world = DataParallel::new(trainer, reducer, opts)?;
    let outcome = drive(&mut world, ctx, out);
    let (trainer, reducer) = world.into_parts();
    Ok((outcome, trainer, reducer))
}

/// One rank of a GPU world: the engine over the CUDA model on this rank's
/// GPU, on the stream of its NCCL communicator, reducing
/// through the [`mamba_reduce::NcclReducer`] (with `--peer-fold`, the
/// [`mamba_reduce::PeerReducer`] over it: NCCL then carries only the host
/// collectives). A world of one is a 1-rank communicator, the same path.
///
/// A failure of this rank's own after the communicator exists is posted
/// to the world abort ([`dp::world_abort`]) before the rank returns, so
/// peers waiting in a collective fail at once naming this rank.
fn run_cuda_rank(
    args: &TrainArgs,
    place: WorldPlace,
    host: &dp::cuda::GpuHost,
    out: &mut dyn Write,
) -> Result<TrainOutcome> {
    let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let device = dp::cuda::rank_device(host, &place, visible.as_deref())?;
    let setup = prepare_rank(args, &place)?;
    if args.peer_fold {
        dp::cuda::check_peer_fold(&setup.plan.run)?;
    }
    let link = dp::cuda::connect(&place, device, setup.timeout)?;
    let rendezvous = link.rendezvous.clone();
    let outcome = train_cuda_rank(args, setup, link.comm, out);
    if let Err(e) = &outcome {
        if let Err(post) = dp::world_abort::post_failure(&*rendezvous, e) {
            stderr_line(&format!(
                "{}warning: could not tell the other ranks of this failure (they stop at their \
                 collective timeout): {post}",
                rank_prefix()
            ));
        }
    }
    // The rendezvous outlives the communicator (rank 0 may serve it).
    drop(link.rendezvous);
    drop(rendezvous);
    outcome
}

/// [`run_cuda_rank`] once the communicator exists: the model, the trainer
/// and the reducer on `comm`, the run, the teardown.
///
/// Teardown: after a successful run the communicator is shut down in
/// order (finalize, destroy); a failure there is reported as a warning,
/// since every rank has already agreed on the final weights. After a
/// failed run it is dropped, which aborts it (peers may be gone).
fn train_cuda_rank(
    args: &TrainArgs,
    setup: RankSetup,
    comm: mamba_comm::nccl::NcclComm,
    out: &mut dyn Write,
) -> Result<TrainOutcome> {
    let RankSetup {
        ck,
        plan,
        data,
        resumed_from,
        opts,
        timeout,
        out: run_dir,
        meta,
        init,
        precision,
    } = setup;
    let run = plan.run.clone();
    if args.peer_fold {
        // Before the model allocates: the arenas the peers map must come
        // from the shareable pool.
        dp::cuda::share_arenas(&comm)?;
    }
    let mut model = CudaModel::with_stream_in(run.model.clone(), precision, comm.stream().clone())?;
    model.set_recompute(args.recompute);
    // SAFETY: the model, the reducer (NCCL and the peer fold) and the
    // optimizer all work on the communicator's one stream, and this rank's
    // other threads (the abort watch, the progress bar) touch no device
    // buffer, so nothing relies on cudarc's cross-stream event tracking
    // that set_cuda_graph turns off.
    unsafe { model.set_cuda_graph(!args.no_cuda_graph)? };
    let trainer = start_trainer(model, &run, data, ck, init)?;
    let stream = comm.stream().clone();
    let reducer = dp::cuda::reducer(comm, &run)?;
    let ctx = RankContext {
        args,
        end: plan.end,
        resumed_from,
        threads: rayon::current_num_threads(),
        out: run_dir,
        meta,
    };
    // Device memory before the communicator: the trainer's, after (with
    // the peer fold) the mappings of the peers' arenas.
    let (outcome, reducer) = if args.peer_fold {
        let peer = dp::cuda::peer_reducer(reducer, stream, timeout)?;
        let (outcome, trainer, mut peer) = train_on(trainer, peer, opts, &ctx, out)?;
        match &outcome {
            // Peers already in a peer-fold barrier learn of it there (the
            // world abort reaches those in an NCCL wait).
            Err(e) if dp::world_abort::is_own_failure(e) => peer.abort(&e.to_string()),
            _ => {}
        }
        let reducer = peer.into_control();
        drop(trainer);
        (outcome, reducer)
    } else {
        let (outcome, trainer, reducer) = train_on(trainer, reducer, opts, &ctx, out)?;
        drop(trainer);
        (outcome, reducer)
    };
    if outcome.is_ok() {
        if let Err(e) = dp::cuda::shutdown(reducer) {
            stderr_line(&format!(
                "{}warning: the NCCL communicator did not shut down cleanly after the run: {e}",
                rank_prefix()
            ));
        }
    } else {
        drop(reducer);
    }
    outcome
}
