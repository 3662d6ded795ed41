//! Real-process worlds inside `cargo test`.
//!
//! A test that needs real processes calls [`test_world`] on the supervisor
//! side; the helper re-executes the current test binary once per rank with
//! `<test_name> --exact --nocapture --test-threads=1`, so each rank runs the
//! same `#[test]` function, where [`is_rank_process`] is true:
//!
//! ```no_run
//! use mamba_comm::bootstrap::is_rank_process;
//! use mamba_comm::supervisor::test_world;
//!
//! #[test]
//! fn my_world_test() {
//!     if is_rank_process() {
//!         // rank side: detect the place, open the rendezvous, do the work;
//!         // panic (or exit non-zero) to fail.
//!         return;
//!     }
//!     let report = test_world("my_world_test", 4, &[]).expect("spawn");
//!     report.check().expect("every rank succeeded");
//! }
//! ```
//!
//! [`is_rank_process`]: crate::bootstrap::is_rank_process

use std::process::Command;
use std::time::Duration;

use super::{SpawnOptions, Supervisor, WorldReport};
use crate::{CommError, Result};

/// Default deadline of a test world: a hung test fails instead of hanging
/// `cargo test`.
pub const TEST_WORLD_DEADLINE: Duration = Duration::from_secs(60);

/// Run `world` ranks of the test `test_name` (its full libtest name, e.g.
/// `my_test` in an integration test file or `module::my_test` in a unit
/// test) with `extra_env` added, and wait for them. Job id
/// `test-<name>-<pid>`, deadline [`TEST_WORLD_DEADLINE`], no grace.
pub fn test_world(
    test_name: &str,
    world: usize,
    extra_env: &[(&str, &str)],
) -> Result<WorldReport> {
    let mut opts = SpawnOptions::default();
    for (k, v) in extra_env {
        opts = opts.env(*k, *v);
    }
    test_world_with(test_name, world, opts)
}

/// [`test_world`] with full control of the options; `program` and `args`
/// are replaced by this test binary and the libtest filter, `job_id` and
/// `deadline` get the test defaults when unset.
///
/// First checks that this binary has a test of exactly that name, so a
/// typo cannot turn into a world of ranks that ran nothing and "passed".
pub fn test_world_with(test_name: &str, world: usize, opts: SpawnOptions) -> Result<WorldReport> {
    test_spawn(test_name, world, opts)?.wait()
}

/// Start the ranks of [`test_world_with`] without waiting: the test gets
/// the [`Supervisor`] (pids, launch directory) to inject faults from
/// outside, then calls [`Supervisor::wait`]. Call `wait` on the same thread
/// (the children's parent-death signal is tied to it).
pub fn test_spawn(test_name: &str, world: usize, mut opts: SpawnOptions) -> Result<Supervisor> {
    let exe = std::env::current_exe()
        .map_err(|e| CommError::config(format!("cannot find the test binary: {e}")))?;
    let listed = Command::new(&exe)
        .args([test_name, "--exact", "--list"])
        .output()
        .map_err(|e| {
            CommError::config(format!("cannot list the tests of {}: {e}", exe.display()))
        })?;
    let wanted = format!("{test_name}: test");
    if !String::from_utf8_lossy(&listed.stdout)
        .lines()
        .any(|l| l.trim() == wanted)
    {
        return Err(CommError::config(format!(
            "{} has no test named exactly {test_name:?}; pass the full libtest name",
            exe.display()
        )));
    }
    opts.program = Some(exe);
    opts.args = Some(
        [test_name, "--exact", "--nocapture", "--test-threads=1"]
            .iter()
            .map(Into::into)
            .collect(),
    );
    if opts.job_id.is_none() {
        let clean: String = test_name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .take(80)
            .collect();
        opts.job_id = Some(format!("test-{clean}-{}", std::process::id()));
    }
    opts.deadline = opts.deadline.or(Some(TEST_WORLD_DEADLINE));
    Supervisor::spawn(world, opts)
}
