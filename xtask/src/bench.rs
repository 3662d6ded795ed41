//! `cargo xtask bench reduce|train`.
use std::path::{Path, PathBuf};
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
        Which::Train => train(),
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

/// Sizes both training-step benchmarks run unless `MAMBA_BENCH_TRAIN_SIZES`
/// says otherwise (see `bench_cuda_step.rs` for their shapes).
const TRAIN_SIZES: &str = "small,130m,long";

/// Precisions `bench_cuda_step` runs each size in unless
/// `MAMBA_BENCH_TRAIN_PRECISIONS` says otherwise.
const TRAIN_PRECISIONS: &str = "f32,tf32,bf16";

/// The 2-GPU scaling program's slot: an example of `mamba-train` that
/// measures the data-parallel CUDA trainer's step at P = 2 against P = 1 at a
/// fixed per-GPU batch. Run when its source exists.
const SCALING_EXAMPLE: &str = "dp_scaling";

/// The training step against its references, on one GPU (two for scaling):
///
/// 1. `bench_cuda_step` (release): ours at each size in each precision
///    ([`TRAIN_PRECISIONS`]), with its floor and memory high-water mark,
///    JSON lines to `target/bench-train/cuda_step.jsonl`;
/// 2. `scripts/bench_torch_step.py`: the same step through
///    transformers' pure-PyTorch path, JSON lines to
///    `target/bench-train/torch_step.jsonl` (it halves the batch of a size
///    that runs out of memory; the table then compares tokens/s);
/// 3. the side-by-side table (plain and markdown) and the goals,
///    printed by `bench_torch_step.py --report` from the two files;
/// 4. the 2-GPU scaling slot: the [`SCALING_EXAMPLE`] example, when it
///    exists (`MAMBA_BENCH_TRAIN_SCALING=0` skips it).
///
/// Environment: `MAMBA_BENCH_TRAIN_SIZES` and `MAMBA_BENCH_TRAIN_PRECISIONS`
/// (comma lists), `MAMBA_BENCH_CUDA_ARGS`
/// and `MAMBA_BENCH_TORCH_ARGS` (extra flags of each side, split on
/// whitespace), `MAMBA_BENCH_SCALING_ARGS` (flags of the scaling example),
/// `PYTHON` (default `python3`, which needs torch and transformers). On a GPU
/// host without cargo, run the same steps from a bundle (docs/HF_CROSSCHECK.md).
fn train() -> TaskResult {
    let root = workspace_root();
    let out = root.join("target").join("bench-train");
    std::fs::create_dir_all(&out).map_err(|e| format!("cannot create {}: {e}", out.display()))?;
    let sizes = std::env::var("MAMBA_BENCH_TRAIN_SIZES").unwrap_or_else(|_| TRAIN_SIZES.into());
    let ours_json = out.join("cuda_step.jsonl");
    let torch_json = out.join("torch_step.jsonl");
    for f in [&ours_json, &torch_json] {
        // A stale file must not pass for this run's result.
        if f.exists() {
            std::fs::remove_file(f).map_err(|e| format!("cannot remove {}: {e}", f.display()))?;
        }
    }

    let precisions =
        std::env::var("MAMBA_BENCH_TRAIN_PRECISIONS").unwrap_or_else(|_| TRAIN_PRECISIONS.into());
    let mut rows = String::new();
    for p in precisions
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
    {
        eprintln!("bench train: ours (bench_cuda_step), sizes {sizes}, precision {p}");
        let one = out.join(format!("cuda_step-{p}.jsonl"));
        let mut ours = example(&root, "bench_cuda_step");
        ours.args(["--sizes", &sizes, "--precision", p, "--json"])
            .arg(&one)
            .args(env_args("MAMBA_BENCH_CUDA_ARGS"));
        run_checked(&mut ours)?;
        rows += &std::fs::read_to_string(&one)
            .map_err(|e| format!("cannot read {}: {e}", one.display()))?;
    }
    std::fs::write(&ours_json, rows)
        .map_err(|e| format!("cannot write {}: {e}", ours_json.display()))?;

    let script = root.join("scripts/bench_torch_step.py");
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    eprintln!("bench train: the PyTorch reference (bench_torch_step.py), sizes {sizes}");
    let mut torch = Command::new(&python);
    torch
        .arg(&script)
        .args(["--sizes", &sizes, "--json"])
        .arg(&torch_json)
        .args(env_args("MAMBA_BENCH_TORCH_ARGS"))
        .env("LD_LIBRARY_PATH", gpu_library_path());
    let torch_result = run_checked(&mut torch);
    if torch_result.is_err() || !torch_json.exists() {
        // Keep going: the table still shows ours, with the reference missing.
        std::fs::write(&torch_json, "")
            .map_err(|e| format!("cannot write {}: {e}", torch_json.display()))?;
    }

    println!();
    let mut report = Command::new(&python);
    report
        .arg(&script)
        .arg("--report")
        .arg(&ours_json)
        .arg(&torch_json);
    run_checked(&mut report)?;

    let scaling = scaling(&root);
    torch_result
        .map_err(|e| format!("the PyTorch reference failed ({e}); the table has ours only"))?;
    scaling
}

/// Step 4 of [`train`]: the 2-GPU scaling slot.
fn scaling(root: &Path) -> TaskResult {
    if std::env::var("MAMBA_BENCH_TRAIN_SCALING").is_ok_and(|v| v.trim() == "0") {
        println!("scaling: skipped (MAMBA_BENCH_TRAIN_SCALING=0)");
        return Ok(());
    }
    let src = root
        .join("mamba-train/examples")
        .join(format!("{SCALING_EXAMPLE}.rs"));
    if !src.exists() {
        println!(
            "scaling: not measured: {} does not exist yet (it needs the data-parallel CUDA trainer)",
            src.display()
        );
        return Ok(());
    }
    println!("scaling: {SCALING_EXAMPLE} (P = 2 vs P = 1 at a fixed per-GPU batch)");
    let mut cmd = example(root, SCALING_EXAMPLE);
    cmd.args(env_args("MAMBA_BENCH_SCALING_ARGS"));
    run_checked(&mut cmd)
}

/// `cargo run --release -p mamba-train --example NAME --`, with the GPU
/// hosts' library directories and NCCL settings.
fn example(root: &Path, name: &str) -> Command {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let mut cmd = Command::new(cargo);
    cmd.current_dir(root)
        .args([
            "run",
            "--release",
            "-p",
            "mamba-train",
            "--example",
            name,
            "--",
        ])
        // A benchmark without kernels measures nothing.
        .env("MAMBA_REQUIRE_KERNELS", "1")
        .env("NCCL_NVLS_ENABLE", "0")
        .env("LD_LIBRARY_PATH", gpu_library_path());
    cmd
}

/// Whitespace-split flags from environment variable `var` (none when unset).
fn env_args(var: &str) -> Vec<String> {
    std::env::var(var)
        .unwrap_or_default()
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

/// `LD_LIBRARY_PATH` with the GPU hosts' cuBLAS and driver directories
/// first (they are not in the loader cache there), when present.
fn gpu_library_path() -> String {
    let mut dirs: Vec<String> = ["/usr/local/cuda/lib64", "/usr/local/nvidia/lib64"]
        .iter()
        .filter(|d| PathBuf::from(d).is_dir())
        .map(|d| d.to_string())
        .collect();
    if let Ok(old) = std::env::var("LD_LIBRARY_PATH") {
        if !old.is_empty() {
            dirs.push(old);
        }
    }
    dirs.join(":")
}
