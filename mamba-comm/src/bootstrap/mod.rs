//! How a process learns its place in the world.
//!
//! The environment contract, in order of precedence (see [`detect()`]):
//!
//! | contract | rank | world | local rank / device | job | other |
//! |---|---|---|---|---|---|
//! | project (`MAMBA_*`) | `MAMBA_RANK` | `MAMBA_WORLD_SIZE` | `MAMBA_LOCAL_RANK` | `MAMBA_JOB_ID` | `MAMBA_LAUNCH_ID` (per-launch nonce, set by the supervisor) |
//! | torchrun | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` | `TORCHELASTIC_RUN_ID` | `MASTER_ADDR`, `MASTER_PORT` |
//! | Open MPI | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` | `OMPI_MCA_ess_base_jobid` / `PMIX_NAMESPACE` | |
//! | SLURM | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` | `SLURM_JOB_ID` + `SLURM_STEP_ID` | |
//!
//! With any of them (or none): `MAMBA_RENDEZVOUS_DIR` (absolute root of the
//! file rendezvous, shared by all ranks), `MAMBA_JOB_ID` (overrides the
//! launcher's job id), `MAMBA_SEED`, `MAMBA_LOGICAL_WORLD` (the physical
//! world must divide it), `MASTER_ADDR`/`MASTER_PORT` (TCP rendezvous), and
//! `MAMBA_STORE_PORT` (port of our TCP store when `MASTER_PORT` is taken).
//! An empty value counts as unset.

mod contracts;
mod detect;
mod env;
mod ids;
mod place;

pub use detect::{default_rendezvous_root, detect, overrides, Overrides};
pub use env::{EnvSource, ProcessEnv};
pub(crate) use ids::current_uid;
pub use ids::{new_launch_id, random_bytes, validate_id, MAX_ID_LEN};
pub use place::{Launcher, WorldPlace};

/// Names of every variable the bootstrap reads or sets.
pub mod vars {
    /// This process's rank (project contract).
    pub const MAMBA_RANK: &str = "MAMBA_RANK";
    /// Number of ranks (project contract).
    pub const MAMBA_WORLD_SIZE: &str = "MAMBA_WORLD_SIZE";
    /// Node-local rank, also the CUDA device index (project contract).
    pub const MAMBA_LOCAL_RANK: &str = "MAMBA_LOCAL_RANK";
    /// Absolute root directory of the file rendezvous.
    pub const MAMBA_RENDEZVOUS_DIR: &str = "MAMBA_RENDEZVOUS_DIR";
    /// Job id (a directory name under the rendezvous root).
    pub const MAMBA_JOB_ID: &str = "MAMBA_JOB_ID";
    /// Per-launch nonce chosen by the supervisor.
    pub const MAMBA_LAUNCH_ID: &str = "MAMBA_LAUNCH_ID";
    /// Master seed of the run.
    pub const MAMBA_SEED: &str = "MAMBA_SEED";
    /// Logical world size L.
    pub const MAMBA_LOGICAL_WORLD: &str = "MAMBA_LOGICAL_WORLD";
    /// `0`/`off` turns the flight recorder off (default on; see
    /// [`crate::flight`]).
    pub const MAMBA_FLIGHT_RECORDER: &str = "MAMBA_FLIGHT_RECORDER";
    /// Port of the TCP store served by rank 0 (default: `MASTER_PORT`).
    pub const MAMBA_STORE_PORT: &str = "MAMBA_STORE_PORT";
    /// torchrun: global rank.
    pub const RANK: &str = "RANK";
    /// torchrun: world size.
    pub const WORLD_SIZE: &str = "WORLD_SIZE";
    /// torchrun: rank on this node.
    pub const LOCAL_RANK: &str = "LOCAL_RANK";
    /// Host of rank 0's store.
    pub const MASTER_ADDR: &str = "MASTER_ADDR";
    /// Port of rank 0's store.
    pub const MASTER_PORT: &str = "MASTER_PORT";
    /// torchrun: the run id (`--rdzv-id`).
    pub const TORCHELASTIC_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
    /// torchrun: "True" when the agent already serves a store at `MASTER_PORT`.
    pub const TORCHELASTIC_USE_AGENT_STORE: &str = "TORCHELASTIC_USE_AGENT_STORE";
    /// SLURM: task rank.
    pub const SLURM_PROCID: &str = "SLURM_PROCID";
    /// SLURM: number of tasks.
    pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
    /// SLURM: task rank on this node.
    pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
    /// SLURM: job id.
    pub const SLURM_JOB_ID: &str = "SLURM_JOB_ID";
    /// SLURM: step id (each `srun` in a job is a new step).
    pub const SLURM_STEP_ID: &str = "SLURM_STEP_ID";
    /// Open MPI: rank.
    pub const OMPI_COMM_WORLD_RANK: &str = "OMPI_COMM_WORLD_RANK";
    /// Open MPI: size.
    pub const OMPI_COMM_WORLD_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
    /// Open MPI: rank on this node.
    pub const OMPI_COMM_WORLD_LOCAL_RANK: &str = "OMPI_COMM_WORLD_LOCAL_RANK";
    /// Open MPI 4: job id.
    pub const OMPI_MCA_ESS_BASE_JOBID: &str = "OMPI_MCA_ess_base_jobid";
    /// Open MPI 5 / PMIx: namespace of the launch.
    pub const PMIX_NAMESPACE: &str = "PMIX_NAMESPACE";
}

/// True in a process started by the self-spawn supervisor (or by hand with
/// the project contract): `MAMBA_RANK` is set. Lets one `#[test]` function
/// (or one `main`) branch between the supervisor side and the rank side.
pub fn is_rank_process() -> bool {
    ProcessEnv.var(vars::MAMBA_RANK).is_some()
}
