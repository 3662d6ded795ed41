//! A process's place in its world, as the bootstrap found it.

use std::path::PathBuf;

use super::vars;
use crate::{CommError, Result};

/// Which contract told this process its place.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Launcher {
    /// The project's own `MAMBA_*` variables (the self-spawn supervisor, or
    /// a hand-made launch).
    Mamba,
    /// torchrun / torch elastic (`RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ...).
    Torchrun,
    /// Open MPI's `mpirun` (`OMPI_COMM_WORLD_*`).
    OpenMpi,
    /// SLURM's `srun` (`SLURM_PROCID`, `SLURM_NTASKS`, ...).
    Slurm,
}

impl Launcher {
    /// The variable that carries the rank under this contract.
    pub fn rank_var(self) -> &'static str {
        match self {
            Launcher::Mamba => vars::MAMBA_RANK,
            Launcher::Torchrun => vars::RANK,
            Launcher::OpenMpi => vars::OMPI_COMM_WORLD_RANK,
            Launcher::Slurm => vars::SLURM_PROCID,
        }
    }

    /// The variable that carries the world size under this contract.
    pub fn world_var(self) -> &'static str {
        match self {
            Launcher::Mamba => vars::MAMBA_WORLD_SIZE,
            Launcher::Torchrun => vars::WORLD_SIZE,
            Launcher::OpenMpi => vars::OMPI_COMM_WORLD_SIZE,
            Launcher::Slurm => vars::SLURM_NTASKS,
        }
    }

    /// The variable that carries the node-local rank (the device index).
    pub fn local_rank_var(self) -> &'static str {
        match self {
            Launcher::Mamba => vars::MAMBA_LOCAL_RANK,
            Launcher::Torchrun => vars::LOCAL_RANK,
            Launcher::OpenMpi => vars::OMPI_COMM_WORLD_LOCAL_RANK,
            Launcher::Slurm => vars::SLURM_LOCALID,
        }
    }
}

/// Where this process stands: its rank, the world, and how the ranks of
/// this launch meet.
///
/// Invariants (checked by [`detect`](fn@super::detect)): `rank < world`,
/// `local_rank < world`, `logical_world` (when set) is a multiple of
/// `world`, `job_id` is a valid id or empty, and a multi-rank world that
/// meets through a directory has a non-empty `job_id`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WorldPlace {
    /// This process's rank in `0..world`.
    pub rank: usize,
    /// Number of processes (the physical world P).
    pub world: usize,
    /// Rank within this node; also the CUDA device index this rank uses.
    pub local_rank: usize,
    /// The job's id (names the rendezvous directory `<root>/<job_id>`).
    /// May be empty for a world of one or a world that meets over TCP.
    pub job_id: String,
    /// A per-launch nonce chosen by the supervisor (`MAMBA_LAUNCH_ID`).
    /// `None` under external launchers: the file rendezvous then agrees on
    /// a fresh one by handshake, and the TCP store lives only as long as the
    /// launch, so a reused job id can never hand out stale values.
    pub launch_id: Option<String>,
    /// Root of the file rendezvous (`MAMBA_RENDEZVOUS_DIR`, or a private
    /// default under the temporary directory when no TCP store is given).
    pub rendezvous_dir: Option<PathBuf>,
    /// Address of the TCP store that rank 0 serves: `MASTER_ADDR` and
    /// `MAMBA_STORE_PORT`, else `MASTER_PORT` (plus one under torchrun's
    /// agent store, which already occupies `MASTER_PORT`).
    pub master: Option<(String, u16)>,
    /// Master seed (`MAMBA_SEED`), if given.
    pub seed: Option<u64>,
    /// Configured logical world L (`MAMBA_LOGICAL_WORLD`), if given.
    pub logical_world: Option<usize>,
    /// The contract that supplied rank and world.
    pub launcher: Launcher,
}

impl WorldPlace {
    /// A world of one: this process alone, no rendezvous needed.
    pub fn single() -> WorldPlace {
        WorldPlace {
            rank: 0,
            world: 1,
            local_rank: 0,
            job_id: String::new(),
            launch_id: None,
            rendezvous_dir: None,
            master: None,
            seed: None,
            logical_world: None,
            launcher: Launcher::Mamba,
        }
    }

    /// The CUDA device this rank drives (its local rank).
    pub fn device(&self) -> usize {
        self.local_rank
    }

    /// Check a logical world L chosen elsewhere (e.g. on the command line)
    /// against this physical world P: P must divide L. The error names the
    /// launcher's world variable, since that is what contradicts L.
    pub fn check_logical_world(&self, logical: usize) -> Result<()> {
        if logical == 0 || logical % self.world != 0 {
            return Err(CommError::env(
                self.launcher.world_var(),
                format!(
                    "the physical world of {} processes must divide the logical world {logical} \
                     (each process holds logical/physical logical ranks)",
                    self.world
                ),
            ));
        }
        Ok(())
    }

    /// The `MAMBA_*` variables that give a child process exactly this place
    /// (what the supervisor sets for each rank). [`detect`](fn@super::detect)
    /// of these variables alone returns this place with
    /// [`Launcher::Mamba`].
    pub fn contract_env(&self) -> Vec<(String, String)> {
        let mut env = vec![
            (vars::MAMBA_RANK.to_string(), self.rank.to_string()),
            (vars::MAMBA_WORLD_SIZE.to_string(), self.world.to_string()),
            (
                vars::MAMBA_LOCAL_RANK.to_string(),
                self.local_rank.to_string(),
            ),
        ];
        let mut put = |k: &str, v: String| env.push((k.to_string(), v));
        if !self.job_id.is_empty() {
            put(vars::MAMBA_JOB_ID, self.job_id.clone());
        }
        if let Some(l) = &self.launch_id {
            put(vars::MAMBA_LAUNCH_ID, l.clone());
        }
        if let Some(d) = &self.rendezvous_dir {
            put(vars::MAMBA_RENDEZVOUS_DIR, d.to_string_lossy().into_owned());
        }
        if let Some((addr, port)) = &self.master {
            put(vars::MASTER_ADDR, addr.clone());
            put(vars::MASTER_PORT, port.to_string());
            put(vars::MAMBA_STORE_PORT, port.to_string());
        }
        if let Some(s) = self.seed {
            put(vars::MAMBA_SEED, s.to_string());
        }
        if let Some(l) = self.logical_world {
            put(vars::MAMBA_LOGICAL_WORLD, l.to_string());
        }
        env
    }
}
