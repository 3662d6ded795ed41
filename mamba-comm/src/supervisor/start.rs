//! One entry point for programs: join a launched world, or launch one.

use super::{SpawnOptions, Supervisor, WorldReport};
use crate::bootstrap::{detect, overrides, EnvSource, WorldPlace};
use crate::{CommError, Result};

/// What this process is after [`start_world`].
#[derive(Debug)]
pub enum Role {
    /// This process is a rank: do the work.
    Rank(WorldPlace),
    /// This process supervised a world that has ended; its ranks did the
    /// work. Check the report.
    Supervised(WorldReport),
}

/// Decide from the environment what this process is.
///
/// - Under a launcher (or as a rank of our supervisor): `Rank(place)`. A
///   `requested` world that differs from the launcher's is an
///   [`CommError::EnvContract`] error naming the launcher's world variable.
/// - Without a launcher and `requested` > 1: spawn that many ranks of this
///   program (carrying `MAMBA_JOB_ID`, `MAMBA_RENDEZVOUS_DIR`, `MAMBA_SEED`,
///   `MAMBA_LOGICAL_WORLD` from the environment), wait, and return
///   `Supervised(report)`.
/// - Otherwise: `Rank` of a world of one.
///
/// A malformed environment is an error before anything is spawned.
pub fn start_world<E: EnvSource + ?Sized>(
    env: &E,
    requested: Option<usize>,
    opts: SpawnOptions,
) -> Result<Role> {
    let ov = overrides(env)?;
    if let Some(place) = detect(env)? {
        if let Some(n) = requested {
            if n != place.world {
                return Err(CommError::env(
                    place.launcher.world_var(),
                    format!(
                        "the launcher started a world of {} processes but {n} were requested; \
                         request {} or launch {n}",
                        place.world, place.world
                    ),
                ));
            }
        }
        return Ok(Role::Rank(place));
    }
    let n = requested.unwrap_or(1);
    if n <= 1 {
        let mut place = WorldPlace::single();
        place.seed = ov.seed;
        place.logical_world = ov.logical_world;
        return Ok(Role::Rank(place));
    }
    let report = Supervisor::spawn(n, opts.with_overrides(&ov))?.wait()?;
    Ok(Role::Supervised(report))
}
