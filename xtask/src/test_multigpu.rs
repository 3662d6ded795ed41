//! `cargo xtask test-multigpu`: build every test binary (kernels required),
//! then run them all with GPUs required through the bundle's runner, so a GPU
//! host with a toolchain and a bundle on a host without one run the very same
//! suite.

use std::process::Command;

use crate::util::{run_checked, workspace_root, TaskResult};

pub fn run() -> TaskResult {
    // Fail before a long release build when there is nothing to run on.
    let gpus = gpu_count();
    if gpus == 0 {
        return Err(
            "no GPU found (nvidia-smi -L lists none): test-multigpu runs the GPU suite \
                    and needs at least one GPU (two for the NCCL world tests); on a GPU host \
                    without Rust use `cargo xtask bundle DIR` here and `DIR/run.sh tests` there"
                .into(),
        );
    }
    eprintln!("test-multigpu: {gpus} GPU(s) found");
    let dir = workspace_root().join("target").join("multigpu-bundle");
    crate::bundle::run(&dir)?;
    run_checked(Command::new("bash").arg(dir.join("run.sh")).arg("tests"))
}

/// GPUs listed by `nvidia-smi -L` (0 when it is missing or fails).
fn gpu_count() -> usize {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.starts_with("GPU"))
                .count()
        })
        .unwrap_or(0)
}
