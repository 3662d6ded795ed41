//! `cargo xtask ...`: the project's build and test tasks.
//!
//! Each subcommand lives in its own module; this file only parses the
//! command line and dispatches.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

mod bench;
mod bindgen;
mod bundle;
mod kernels;
mod test_multigpu;
mod util;

#[derive(Parser)]
#[command(
    name = "cargo xtask",
    about = "Project tasks for the mamba deterministic trainer"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Compile every CUDA kernel with nvcc and print ptxas resource usage.
    Kernels,
    /// Regenerate nccl-sys-min's committed bindings from a real nccl.h.
    Bindgen {
        /// Path to nccl.h (the GPU machines have /usr/include/nccl.h).
        #[arg(long)]
        header: std::path::PathBuf,
    },
    /// Build and run every GPU and multi-GPU test; fails when no GPU is found.
    TestMultigpu,
    /// Write prebuilt test and bench binaries plus a runner script to DIR.
    Bundle {
        /// Output folder (created; existing contents are replaced).
        dir: std::path::PathBuf,
    },
    /// Run a benchmark and print times and ratios against its reference.
    Bench {
        /// Which benchmark.
        #[arg(value_enum)]
        which: bench::Which,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Kernels => kernels::run(),
        Task::Bindgen { header } => bindgen::run(&header),
        Task::TestMultigpu => test_multigpu::run(),
        Task::Bundle { dir } => bundle::run(&dir),
        Task::Bench { which } => bench::run(which),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
