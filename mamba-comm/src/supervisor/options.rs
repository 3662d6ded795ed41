//! How the supervisor starts a world.

use std::ffi::OsString;
use std::path::PathBuf;
use std::time::Duration;

use crate::bootstrap::Overrides;

/// Settings of [`Supervisor::spawn`](super::Supervisor::spawn). The default
/// re-executes this program with its own arguments.
#[derive(Clone, Debug)]
pub struct SpawnOptions {
    /// Program run as every rank. Default: this process's executable.
    pub program: Option<PathBuf>,
    /// Its arguments. Default: this process's arguments (after argv\[0\]).
    pub args: Option<Vec<OsString>>,
    /// Rendezvous root. Default: `$TMPDIR/mamba-rdv-<uid>`.
    pub rendezvous_root: Option<PathBuf>,
    /// Job id (a directory under the root; purged before spawning).
    /// Default: `pid-<supervisor pid>`.
    pub job_id: Option<String>,
    /// Handed to every rank as `MAMBA_SEED`.
    pub seed: Option<u64>,
    /// Handed to every rank as `MAMBA_LOGICAL_WORLD`; must be a multiple of
    /// the world size.
    pub logical_world: Option<usize>,
    /// Extra variables for every rank, applied after the contract (so they
    /// can override it, which tests use to inject malformed contracts).
    pub env: Vec<(OsString, OsString)>,
    /// After the first failure, how long the other ranks may take to end by
    /// themselves (and log their own view of the failure) before they are
    /// killed. Default: zero, kill at once.
    pub grace: Duration,
    /// Kill the whole world if it runs longer than this. Default: none.
    pub deadline: Option<Duration>,
}

impl Default for SpawnOptions {
    fn default() -> Self {
        SpawnOptions {
            program: None,
            args: None,
            rendezvous_root: None,
            job_id: None,
            seed: None,
            logical_world: None,
            env: Vec::new(),
            grace: Duration::ZERO,
            deadline: None,
        }
    }
}

impl SpawnOptions {
    /// Carry a user's `MAMBA_JOB_ID`, `MAMBA_RENDEZVOUS_DIR`, `MAMBA_SEED`
    /// and `MAMBA_LOGICAL_WORLD` into the world (fields already set win).
    pub fn with_overrides(mut self, ov: &Overrides) -> Self {
        self.job_id = self.job_id.or_else(|| ov.job_id.clone());
        self.rendezvous_root = self.rendezvous_root.or_else(|| ov.rendezvous_dir.clone());
        self.seed = self.seed.or(ov.seed);
        self.logical_world = self.logical_world.or(ov.logical_world);
        self
    }

    /// Add one variable for every rank.
    pub fn env(mut self, key: impl Into<OsString>, value: impl Into<OsString>) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }
}
