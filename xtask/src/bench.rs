//! `cargo xtask bench reduce|train`.
use std::process::Command;

use crate::util::{run_checked, workspace_root, TaskResult};

/// The benchmarks.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Which {
    /// FixedOrder and NcclSum against NCCL's own all-reduce.
    Reduce,
    /// The training step against its references.
    Train,
}

pub fn run(which: Which) -> TaskResult {
    match which {
        Which::Reduce => reduce(),
        Which::Train => Err("bench train is not implemented yet".into()),
    }
}

/// Build `mamba-reduce`'s `bench_reduce` example in release and run it: a
/// 2-process world (one GPU each) that prints FixedOrder and NcclSum times
/// against NCCL's own all-reduce, 4 MiB to 1 GiB, as a plain and a markdown
/// table. Extra flags for the example (see its docs: `--sizes-mib`,
/// `--reps`, `--chunk-elems`, `--pipeline`, ...) come from
/// `MAMBA_BENCH_REDUCE_ARGS` (split on whitespace). On a GPU host without
/// cargo, run `run.sh bench reduce` from a bundle instead.
fn reduce() -> TaskResult {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let extra = std::env::var("MAMBA_BENCH_REDUCE_ARGS").unwrap_or_default();
    let mut cmd = Command::new(cargo);
    cmd.current_dir(workspace_root())
        .args([
            "run",
            "--release",
            "-p",
            "mamba-reduce",
            "--example",
            "bench_reduce",
            "--",
        ])
        .args(extra.split_whitespace())
        // The GPU machines require NVLink SHARP off; the ranks inherit it.
        .env("NCCL_NVLS_ENABLE", "0");
    run_checked(&mut cmd)
}
