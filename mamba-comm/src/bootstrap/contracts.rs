//! Each launcher's environment contract read into an [`Identity`] (rank,
//! world, local rank, job): `MAMBA_*`, torchrun, OpenMPI, SLURM, and the
//! strict parsers they share (empty is unset; a half-set pair is an error).

use super::env::EnvSource;
use super::ids::validate_id;
use super::place::Launcher;
use super::vars::*;
use crate::{CommError, Result};

pub(super) struct Identity {
    pub(super) launcher: Launcher,
    pub(super) rank: usize,
    pub(super) world: usize,
    pub(super) local_rank: usize,
    pub(super) launch_id: Option<String>,
    /// A job id derived from the launcher, and the variable it came from.
    pub(super) derived_job: Option<(&'static str, String)>,
}

/// Read one launcher's contract, if present.
pub(super) fn contract<E: EnvSource + ?Sized>(
    env: &E,
    launcher: Launcher,
) -> Result<Option<Identity>> {
    match launcher {
        Launcher::Mamba => mamba_contract(env),
        Launcher::Torchrun => torchrun_contract(env),
        Launcher::OpenMpi => ompi_contract(env),
        Launcher::Slurm => slurm_contract(env),
    }
}

pub(super) fn mamba_contract<E: EnvSource + ?Sized>(env: &E) -> Result<Option<Identity>> {
    if let Some((rank, world)) = pair(env, MAMBA_RANK, MAMBA_WORLD_SIZE, true)? {
        let local_rank = optional_count(env, MAMBA_LOCAL_RANK)?.unwrap_or(rank);
        let launch_id = env.var(MAMBA_LAUNCH_ID);
        if let Some(l) = &launch_id {
            validate_id(MAMBA_LAUNCH_ID, l)?;
        }
        return Ok(Some(Identity {
            launcher: Launcher::Mamba,
            rank,
            world,
            local_rank,
            launch_id,
            derived_job: None,
        }));
    }
    for var in [MAMBA_LOCAL_RANK, MAMBA_LAUNCH_ID] {
        if env.var(var).is_some() {
            return Err(CommError::env(
                var,
                format!(
                    "set without {MAMBA_RANK} and {MAMBA_WORLD_SIZE}: a half-set override; set \
                     all of them or none"
                ),
            ));
        }
    }
    Ok(None)
}

pub(super) fn torchrun_contract<E: EnvSource + ?Sized>(env: &E) -> Result<Option<Identity>> {
    if let Some((rank, world)) = pair(env, RANK, WORLD_SIZE, true)? {
        let local_rank = optional_count(env, LOCAL_RANK)?.unwrap_or(rank);
        let derived_job = env
            .var(TORCHELASTIC_RUN_ID)
            .map(|id| (TORCHELASTIC_RUN_ID, format!("torchrun-{id}")));
        return Ok(Some(Identity {
            launcher: Launcher::Torchrun,
            rank,
            world,
            local_rank,
            launch_id: None,
            derived_job,
        }));
    }
    Ok(None)
}

pub(super) fn ompi_contract<E: EnvSource + ?Sized>(env: &E) -> Result<Option<Identity>> {
    if let Some((rank, world)) = pair(env, OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE, true)? {
        let local_rank = optional_count(env, OMPI_COMM_WORLD_LOCAL_RANK)?.unwrap_or(rank);
        let derived_job = [OMPI_MCA_ESS_BASE_JOBID, PMIX_NAMESPACE]
            .into_iter()
            .find_map(|v| env.var(v).map(|id| (v, format!("ompi-{id}"))));
        return Ok(Some(Identity {
            launcher: Launcher::OpenMpi,
            rank,
            world,
            local_rank,
            launch_id: None,
            derived_job,
        }));
    }
    Ok(None)
}

pub(super) fn slurm_contract<E: EnvSource + ?Sized>(env: &E) -> Result<Option<Identity>> {
    // `SLURM_NTASKS` alone is an allocation shell (salloc/sbatch), not a task.
    if let Some((rank, world)) = pair(env, SLURM_PROCID, SLURM_NTASKS, false)? {
        let local_rank = optional_count(env, SLURM_LOCALID)?.unwrap_or(rank);
        let derived_job = env.var(SLURM_JOB_ID).map(|job| {
            let step = env
                .var(SLURM_STEP_ID)
                .unwrap_or_else(|| "batch".to_string());
            (SLURM_JOB_ID, format!("slurm-{job}.{step}"))
        });
        return Ok(Some(Identity {
            launcher: Launcher::Slurm,
            rank,
            world,
            local_rank,
            launch_id: None,
            derived_job,
        }));
    }
    Ok(None)
}

/// Read a (rank, world) pair. Both set: parse both. Rank alone: error.
/// World alone: error when `world_alone_is_error`, otherwise "absent".
pub(super) fn pair<E: EnvSource + ?Sized>(
    env: &E,
    rank_var: &str,
    world_var: &str,
    world_alone_is_error: bool,
) -> Result<Option<(usize, usize)>> {
    match (env.var(rank_var), env.var(world_var)) {
        (Some(r), Some(w)) => {
            let world = parse_count(world_var, &w)?;
            let rank = parse_usize(rank_var, &r)?;
            Ok(Some((rank, world)))
        }
        (Some(r), None) => Err(CommError::env(
            world_var,
            format!("unset while {rank_var}={r} is set: a rank needs a world size; set both or neither"),
        )),
        (None, Some(w)) if world_alone_is_error => Err(CommError::env(
            rank_var,
            format!("unset while {world_var}={w} is set: a world size needs a rank; set both or neither"),
        )),
        _ => Ok(None),
    }
}

pub(super) fn master<E: EnvSource + ?Sized>(env: &E) -> Result<Option<(String, u16)>> {
    let store_port = match env.var(MAMBA_STORE_PORT) {
        Some(p) => Some(parse_port(MAMBA_STORE_PORT, &p)?),
        None => None,
    };
    match (env.var(MASTER_ADDR), env.var(MASTER_PORT)) {
        (Some(addr), Some(p)) => {
            let port = parse_port(MASTER_PORT, &p)?;
            let port = match store_port {
                Some(s) => s,
                None if env.var(TORCHELASTIC_USE_AGENT_STORE).as_deref() == Some("True") => {
                    port.checked_add(1).ok_or_else(|| {
                        CommError::env(
                            MASTER_PORT,
                            format!(
                                "torchrun's agent store occupies port {port} and there is no port \
                                 above it for ours; set {MAMBA_STORE_PORT}"
                            ),
                        )
                    })?
                }
                None => port,
            };
            Ok(Some((addr, port)))
        }
        (Some(addr), None) => match store_port {
            Some(s) => Ok(Some((addr, s))),
            None => Err(CommError::env(
                MASTER_PORT,
                format!("unset while {MASTER_ADDR}={addr} is set: a TCP rendezvous needs both"),
            )),
        },
        (None, Some(p)) => Err(CommError::env(
            MASTER_ADDR,
            format!("unset while {MASTER_PORT}={p} is set: a TCP rendezvous needs both"),
        )),
        (None, None) => match store_port {
            Some(_) => Err(CommError::env(
                MASTER_ADDR,
                format!("unset while {MAMBA_STORE_PORT} is set: the store needs a host"),
            )),
            None => Ok(None),
        },
    }
}

pub(super) fn digits(var: &str, s: &str) -> Result<()> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(CommError::env(
            var,
            format!("{s:?} is not a non-negative decimal integer"),
        ));
    }
    Ok(())
}

pub(super) fn parse_u64(var: &str, s: &str) -> Result<u64> {
    digits(var, s)?;
    s.parse::<u64>()
        .map_err(|_| CommError::env(var, format!("{s:?} does not fit in 64 bits")))
}

pub(super) fn parse_usize(var: &str, s: &str) -> Result<usize> {
    let v = parse_u64(var, s)?;
    usize::try_from(v).map_err(|_| CommError::env(var, format!("{s:?} is too large")))
}

/// A count that must be at least 1 (world sizes).
pub(super) fn parse_count(var: &str, s: &str) -> Result<usize> {
    let v = parse_usize(var, s)?;
    if v == 0 {
        return Err(CommError::env(var, "0 ranks: expected at least 1"));
    }
    Ok(v)
}

pub(super) fn parse_port(var: &str, s: &str) -> Result<u16> {
    let v = parse_u64(var, s)?;
    match u16::try_from(v) {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(CommError::env(
            var,
            format!("{s:?} is not a TCP port (expected 1..=65535)"),
        )),
    }
}

pub(super) fn optional_count<E: EnvSource + ?Sized>(env: &E, var: &str) -> Result<Option<usize>> {
    match env.var(var) {
        Some(s) => Ok(Some(parse_usize(var, &s)?)),
        None => Ok(None),
    }
}
