//! `cargo xtask test-multigpu`: build every test binary (kernels required),
//! then run them all with GPUs required through the bundle's runner, so a GPU
//! host with a toolchain and a bundle on a host without one run the very same
//! suite.

use std::process::Command;

use crate::util::{run_checked, workspace_root, TaskResult};

pub fn run() -> TaskResult {
    let dir = workspace_root().join("target").join("multigpu-bundle");
    crate::bundle::run(&dir)?;
    run_checked(Command::new("bash").arg(dir.join("run.sh")).arg("tests"))
}
