//! Small helpers shared by the tasks.

use std::path::PathBuf;
use std::process::Command;

/// Error type of the tasks: a message for the user.
pub type TaskResult = Result<(), String>;

/// The workspace root (the parent of `xtask/`).
pub fn workspace_root() -> PathBuf {
    // `cargo run` (the `cargo xtask` alias) sets CARGO_MANIFEST_DIR for the
    // run: the tree the command was given. The compile-time value names the
    // tree the binary was built from, which differs when two checkouts
    // share a target directory and cargo finds the other one's xtask fresh
    // (a bundle of the wrong tree, 2026-12-02); it is only the fallback.
    let here = std::env::var_os("CARGO_MANIFEST_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")));
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
