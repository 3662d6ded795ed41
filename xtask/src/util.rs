//! Small helpers shared by the tasks.

use std::path::PathBuf;
use std::process::Command;

/// Error type of the tasks: a message for the user.
pub type TaskResult = Result<(), String>;

/// The workspace root (the parent of `xtask/`).
pub fn workspace_root() -> PathBuf {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    here.parent().map(PathBuf::from).unwrap_or(here)
}

/// Run `cmd`, failing with its rendering when it does not exit 0.
pub fn run_checked(cmd: &mut Command) -> TaskResult {
    let shown = format!("{cmd:?}");
    let status = cmd
        .status()
        .map_err(|e| format!("could not start {shown}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{shown} failed with {status}"))
    }
}
