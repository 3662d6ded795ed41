//! Reading the environment contract.
//!
//! Precedence of the contracts that supply rank and world, most specific
//! first: the project's own `MAMBA_*` (set per process by our supervisor or
//! by hand), torchrun (set per worker by its agent), Open MPI (set per
//! process by `mpirun`), SLURM (set per task by `srun`). Launchers nest —
//! torchrun or `mpirun` inside a SLURM allocation leave the allocation's
//! `SLURM_*` in every worker's environment — so the more specific contract
//! wins, and a less specific one is ignored where it can be such an outer
//! launcher:
//! - Open MPI or SLURM beside torchrun: always outer (torchrun forks its
//!   workers; no launcher starts a torchrun worker directly);
//! - SLURM beside Open MPI or `MAMBA_*`: outer when it has no
//!   `SLURM_STEP_ID` (a batch script or allocation shell running `mpirun`)
//!   or its step has fewer tasks than the inner world (`mpirun`'s daemons,
//!   one task per node).
//!
//! Everywhere else both contracts describe this very process — torchrun or
//! Open MPI beside `MAMBA_*` (our supervisor spawns only where no launcher
//! is present and removes launcher rank variables from its ranks), SLURM
//! with a step of at least as many tasks as Open MPI's or our world — and
//! their rank and world must agree: a contradiction is a
//! [`CommError::EnvContract`] naming both variables and both values.
//!
//! torchrun's rank and world without `MASTER_ADDR`/`MASTER_PORT` are an
//! error unless `MAMBA_RENDEZVOUS_DIR` names the (shared) directory to meet
//! in: torchrun sets both itself, and its ranks may be on several nodes,
//! where the node-local default directory would only time out.
//!
//! Within a contract nothing is guessed: rank without world (or world
//! without rank), half of an address, an override without the variables it
//! overrides, rank >= world, a number that does not parse, a logical world
//! the physical world does not divide — each is a
//! [`CommError::EnvContract`] naming the variable. Empty counts as unset.

use std::path::PathBuf;

use super::contracts::{contract, master, parse_count, parse_u64, Identity};
use super::env::EnvSource;
use super::ids::{current_uid, validate_id};
use super::place::{Launcher, WorldPlace};
use super::vars::*;
use crate::{CommError, Result};

/// Settings of the project's own contract that may accompany any launcher
/// (or none): they do not say where a process stands, only how the world
/// meets and runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Overrides {
    /// `MAMBA_JOB_ID`, validated.
    pub job_id: Option<String>,
    /// `MAMBA_RENDEZVOUS_DIR` (an absolute path).
    pub rendezvous_dir: Option<PathBuf>,
    /// `MAMBA_SEED`.
    pub seed: Option<u64>,
    /// `MAMBA_LOGICAL_WORLD` (at least 1).
    pub logical_world: Option<usize>,
}

/// Read and validate the [`Overrides`]. The supervisor uses this to carry a
/// user's job id, directory and seed into the world it spawns.
pub fn overrides<E: EnvSource + ?Sized>(env: &E) -> Result<Overrides> {
    let job_id = env.var(MAMBA_JOB_ID);
    if let Some(id) = &job_id {
        validate_id(MAMBA_JOB_ID, id)?;
    }
    let rendezvous_dir = match env.var(MAMBA_RENDEZVOUS_DIR) {
        Some(d) => {
            let p = PathBuf::from(&d);
            if !p.is_absolute() {
                return Err(CommError::env(
                    MAMBA_RENDEZVOUS_DIR,
                    format!("{d:?} is relative; expected an absolute path that every rank sees"),
                ));
            }
            Some(p)
        }
        None => None,
    };
    let seed = match env.var(MAMBA_SEED) {
        Some(s) => Some(parse_u64(MAMBA_SEED, &s)?),
        None => None,
    };
    let logical_world = match env.var(MAMBA_LOGICAL_WORLD) {
        Some(s) => Some(parse_count(MAMBA_LOGICAL_WORLD, &s)?),
        None => None,
    };
    Ok(Overrides {
        job_id,
        rendezvous_dir,
        seed,
        logical_world,
    })
}

/// Find this process's place in its world from the environment.
///
/// `Ok(None)`: no launcher contract is present (a plain single process, or
/// a program about to self-spawn); the overrides are still validated.
pub fn detect<E: EnvSource + ?Sized>(env: &E) -> Result<Option<WorldPlace>> {
    let ov = overrides(env)?;
    let Some(id) = identity(env)? else {
        return Ok(None);
    };
    let master = master(env)?;
    if id.rank >= id.world {
        return Err(CommError::env(
            id.launcher.rank_var(),
            format!(
                "rank {} is not below the world size {} given by {}",
                id.rank,
                id.world,
                id.launcher.world_var()
            ),
        ));
    }
    if id.local_rank >= id.world {
        return Err(CommError::env(
            id.launcher.local_rank_var(),
            format!(
                "local rank {} is not below the world size {} given by {}",
                id.local_rank,
                id.world,
                id.launcher.world_var()
            ),
        ));
    }
    if let Some(l) = ov.logical_world {
        if l % id.world != 0 {
            return Err(CommError::env(
                format!("{}/{MAMBA_LOGICAL_WORLD}", id.launcher.world_var()),
                format!(
                    "the launcher's world of {} processes does not divide the configured logical \
                     world {l}; expected a physical world that divides it",
                    id.world
                ),
            ));
        }
    }
    let job_id = match (&ov.job_id, &id.derived_job) {
        (Some(j), _) => j.clone(),
        (None, Some((var, j))) => {
            validate_id(var, j)?;
            j.clone()
        }
        (None, None) => String::new(),
    };
    let rendezvous_dir = match (&ov.rendezvous_dir, &master) {
        (Some(d), _) => Some(d.clone()),
        (None, None) if id.world > 1 && id.launcher == Launcher::Torchrun => {
            // torchrun always sets both; without them this is a hand-made
            // or broken environment whose ranks may well sit on several
            // nodes, where a node-local directory would only time out.
            return Err(CommError::env(
                format!("{MASTER_ADDR}/{MASTER_PORT}"),
                format!(
                    "unset while torchrun's {RANK}/{WORLD_SIZE} describe a world of {} ranks: \
                     set {MASTER_ADDR} and {MASTER_PORT} to rank 0's host and a free port (what \
                     torchrun itself sets), or set {MAMBA_RENDEZVOUS_DIR} to a directory every \
                     rank sees (a shared filesystem)",
                    id.world
                ),
            ));
        }
        (None, None) if id.world > 1 => Some(default_rendezvous_root(env)),
        _ => None,
    };
    if id.world > 1 && rendezvous_dir.is_some() && job_id.is_empty() {
        return Err(CommError::env(
            MAMBA_JOB_ID,
            format!(
                "a world of {} ranks meeting through a directory needs a job id: set \
                 {MAMBA_JOB_ID} (or run under a launcher that provides one: {SLURM_JOB_ID}, \
                 {TORCHELASTIC_RUN_ID}), or give {MASTER_ADDR}/{MASTER_PORT} for a TCP rendezvous",
                id.world
            ),
        ));
    }
    Ok(Some(WorldPlace {
        rank: id.rank,
        world: id.world,
        local_rank: id.local_rank,
        job_id,
        launch_id: id.launch_id,
        rendezvous_dir,
        master,
        seed: ov.seed,
        logical_world: ov.logical_world,
        launcher: id.launcher,
    }))
}

/// The private default root of file rendezvous on one host:
/// `$TMPDIR/mamba-rdv-<uid>` (`/tmp` when `TMPDIR` is unset or relative).
pub fn default_rendezvous_root<E: EnvSource + ?Sized>(env: &E) -> PathBuf {
    let tmp = env
        .var("TMPDIR")
        .map(PathBuf::from)
        .filter(|p| p.is_absolute());
    let uid = current_uid();
    tmp.unwrap_or_else(|| PathBuf::from("/tmp"))
        .join(format!("mamba-rdv-{uid}"))
}

/// The contract that tells this process its place: the most specific one
/// present, after checking it against every less specific one that cannot
/// be a launcher around it (see the [module docs](self)).
fn identity<E: EnvSource + ?Sized>(env: &E) -> Result<Option<Identity>> {
    const ORDER: [Launcher; 4] = [
        Launcher::Mamba,
        Launcher::Torchrun,
        Launcher::OpenMpi,
        Launcher::Slurm,
    ];
    let mut chosen = None;
    let mut rest = ORDER.iter();
    for &l in rest.by_ref() {
        if let Some(id) = contract(env, l)? {
            chosen = Some(id);
            break;
        }
    }
    let Some(chosen) = chosen else {
        return Ok(None);
    };
    // The innermost view of this process so far, as (launcher, rank, world).
    let mut inner = (chosen.launcher, chosen.rank, chosen.world);
    for &outer in rest {
        if !describes_same_process(env, inner.0, inner.2, outer)? {
            continue;
        }
        let Some(other) = contract(env, outer)? else {
            continue;
        };
        check_agree(env, inner, (other.launcher, other.rank, other.world))?;
        inner = (other.launcher, other.rank, other.world);
    }
    Ok(Some(chosen))
}

/// Whether contract `outer` (less specific than `inner`, whose world is
/// `inner_world`), when present, must describe the same process as `inner`
/// (so their rank and world must agree) rather than a launcher around it
/// whose variables leaked into this process:
/// - torchrun and Open MPI never run inside our own ranks (the supervisor
///   spawns only where no launcher is present, and scrubs launcher rank
///   variables from its children), so beside `MAMBA_*` they describe the
///   same process;
/// - torchrun always forks its workers, so Open MPI or SLURM beside torchrun
///   describe its agent, never the worker: always outer;
/// - SLURM beside Open MPI or `MAMBA_*` is outer when it is a batch script or
///   allocation shell (no `SLURM_STEP_ID`) or a step of fewer tasks than the
///   inner world (e.g. `mpirun`'s daemons, one task per node); a step of at
///   least as many tasks as the inner world launched these very processes.
fn describes_same_process<E: EnvSource + ?Sized>(
    env: &E,
    inner: Launcher,
    inner_world: usize,
    outer: Launcher,
) -> Result<bool> {
    Ok(match (inner, outer) {
        (Launcher::Mamba, Launcher::Torchrun | Launcher::OpenMpi) => true,
        (Launcher::Mamba | Launcher::OpenMpi, Launcher::Slurm) => {
            if env.var(SLURM_STEP_ID).is_none() || env.var(SLURM_PROCID).is_none() {
                false
            } else {
                match env.var(SLURM_NTASKS) {
                    Some(n) => parse_count(SLURM_NTASKS, &n)? >= inner_world,
                    None => false,
                }
            }
        }
        _ => false,
    })
}

/// Two contracts that describe the same process must give it the same rank
/// and world.
fn check_agree<E: EnvSource + ?Sized>(
    env: &E,
    (a, a_rank, a_world): (Launcher, usize, usize),
    (b, b_rank, b_world): (Launcher, usize, usize),
) -> Result<()> {
    if a_rank == b_rank && a_world == b_world {
        return Ok(());
    }
    let why = if b == Launcher::Slurm {
        format!(
            "SLURM step {} has {b_world} tasks, at least as many as {}, so srun started these very \
             processes",
            env.var(SLURM_STEP_ID).unwrap_or_default(),
            a.world_var()
        )
    } else {
        format!(
            "{} cannot come from a launcher around this one, so both describe this very process",
            b.rank_var()
        )
    };
    let var = if a_world != b_world {
        format!("{}/{}", a.world_var(), b.world_var())
    } else {
        format!("{}/{}", a.rank_var(), b.rank_var())
    };
    Err(CommError::env(
        var,
        format!(
            "{}={a_rank} {}={a_world} but {}={b_rank} {}={b_world}: {why}, and they contradict \
             each other; unset the stray variables (e.g. `env -u {} -u {}` in the launch \
             command) so that one launcher describes each process",
            a.rank_var(),
            a.world_var(),
            b.rank_var(),
            b.world_var(),
            b.rank_var(),
            b.world_var()
        ),
    ))
}
