//! `cargo xtask bundle DIR`: prebuilt test and bench binaries plus a runner
//! script, for a GPU host that has no Rust toolchain.
//!
//! Layout of DIR:
//! - `tests/<crate>-<target>`: every test executable of the workspace, built
//!   in release and stripped;
//! - `bin/<name>`: the `mamba-train` binary and the benchmark / example
//!   programs;
//! - `scripts/`: the Python references (transformers cross-check, PyTorch
//!   step benchmark);
//! - `run.sh`: `./run.sh tests [FILTER]` (`MAMBA_TEST_ONLY` names a subset
//!   of the binaries), `./run.sh bench reduce|peer|train|scaling|tree`,
//!   `./run.sh hf-crosscheck`.
//!
//! The runner sets `MAMBA_REQUIRE_GPU=1`, so a GPU test that cannot find its
//! GPU fails instead of skipping, and it keeps `NCCL_NVLS_ENABLE=0` as the GPU
//! machines require.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::util::{workspace_root, TaskResult};

/// Packages whose tests go into the bundle.
const TEST_PACKAGES: &[&str] = &[
    "nccl-sys-min",
    "mamba-comm",
    "kernels",
    "mamba-reduce",
    "mamba-train",
    "mamba-integration-tests",
];

/// Example programs shipped in `bin/` as `(package, example)`; missing ones
/// are reported, not fatal, so the bundle tracks what exists.
const EXAMPLES: &[(&str, &str)] = &[
    ("mamba-comm", "allreduce"),
    ("mamba-reduce", "bench_reduce"),
    ("mamba-reduce", "bench_peer_fold"),
    ("mamba-train", "bench_cuda_step"),
    ("mamba-train", "dp_scaling"),
    ("mamba-train", "hf_logits"),
    ("mamba-train", "tree_memory"),
];

/// Python references shipped in `scripts/` (run there with the host's
/// PyTorch and transformers): `(source path in the workspace, name)`.
const SCRIPTS: &[(&str, &str)] = &[
    ("scripts/hf_crosscheck.py", "hf_crosscheck.py"),
    ("scripts/bench_torch_step.py", "bench_torch_step.py"),
    ("mamba-train/tests/hf_load.py", "hf_load.py"),
    ("scripts/torch_reference.py", "torch_reference.py"),
];

const RUNNER: &str = include_str!("run.sh");

pub fn run(dir: &Path) -> TaskResult {
    let root = workspace_root();
    if dir.exists() {
        fs::remove_dir_all(dir).map_err(|e| format!("cannot clear {}: {e}", dir.display()))?;
    }
    let tests_dir = dir.join("tests");
    let bin_dir = dir.join("bin");
    for d in [&tests_dir, &bin_dir] {
        fs::create_dir_all(d).map_err(|e| format!("cannot create {}: {e}", d.display()))?;
    }

    // Kernels must be in the bundle: a GPU host cannot compile them.
    let mut test_build = cargo(&root);
    test_build.args([
        "test",
        "--release",
        "--no-run",
        "--message-format=json-render-diagnostics",
    ]);
    for p in TEST_PACKAGES {
        test_build.args(["-p", p]);
    }
    for exe in built_executables(test_build, true)? {
        let name = exe
            .file_name()
            .and_then(|n| n.to_str())
            .ok_or_else(|| format!("odd executable name {}", exe.display()))?;
        copy_stripped(&exe, &tests_dir.join(name))?;
    }

    // The bundle is a test bundle: its binary carries the fault-injection
    // hooks the GPU suite's fault tests use (a release build never has
    // them; each hook acts only when its MAMBA_TEST_* variable is set).
    let mut bin_build = cargo(&root);
    bin_build.args([
        "build",
        "--release",
        "--message-format=json-render-diagnostics",
        "-p",
        "mamba-train",
        "--features",
        "fault-injection",
        "--bin",
        "mamba-train",
    ]);
    for exe in built_executables(bin_build, false)? {
        copy_stripped(&exe, &bin_dir.join("mamba-train"))?;
    }
    for (pkg, ex) in EXAMPLES {
        let src = root.join(pkg).join("examples").join(format!("{ex}.rs"));
        if !src.exists() {
            eprintln!("bundle: example {pkg}/{ex} does not exist yet; left out");
            continue;
        }
        let mut b = cargo(&root);
        b.args([
            "build",
            "--release",
            "--message-format=json-render-diagnostics",
            "-p",
            pkg,
            "--example",
            ex,
        ]);
        for exe in built_executables(b, false)? {
            copy_stripped(&exe, &bin_dir.join(ex))?;
        }
    }

    let scripts_dir = dir.join("scripts");
    fs::create_dir_all(&scripts_dir)
        .map_err(|e| format!("cannot create {}: {e}", scripts_dir.display()))?;
    for (src, name) in SCRIPTS {
        let from = root.join(src);
        fs::copy(&from, scripts_dir.join(name))
            .map_err(|e| format!("cannot copy {}: {e}", from.display()))?;
    }

    let runner = dir.join("run.sh");
    fs::write(&runner, RUNNER).map_err(|e| format!("cannot write {}: {e}", runner.display()))?;
    set_executable(&runner)?;
    eprintln!("bundle: wrote {}", dir.display());
    Ok(())
}

fn cargo(root: &Path) -> Command {
    let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    c.current_dir(root);
    // The GPU hosts cannot compile kernels, so a bundle without them is useless.
    c.env("MAMBA_REQUIRE_KERNELS", "1");
    c
}

/// Run a cargo build with JSON messages and return the executables it made;
/// with `tests_only`, only test harnesses (`cargo test --no-run` also builds
/// the examples and binaries, which are not test suites).
fn built_executables(mut cmd: Command, tests_only: bool) -> Result<Vec<PathBuf>, String> {
    let shown = format!("{cmd:?}");
    let out = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .map_err(|e| format!("could not start {shown}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{shown} failed with {}", out.status));
    }
    let mut exes = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if msg["reason"] != "compiler-artifact" {
            continue;
        }
        if tests_only && msg["profile"]["test"] != true {
            continue;
        }
        if let Some(exe) = msg["executable"].as_str() {
            exes.push(PathBuf::from(exe));
        }
    }
    Ok(exes)
}

fn copy_stripped(src: &Path, dst: &Path) -> TaskResult {
    fs::copy(src, dst)
        .map_err(|e| format!("cannot copy {} to {}: {e}", src.display(), dst.display()))?;
    // Debug info is most of a test binary's size and the transfer is capped.
    let stripped = Command::new("strip").arg("--strip-debug").arg(dst).status();
    if !matches!(stripped, Ok(s) if s.success()) {
        eprintln!(
            "bundle: could not strip {} (kept unstripped)",
            dst.display()
        );
    }
    set_executable(dst)
}

fn set_executable(path: &Path) -> TaskResult {
    use std::os::unix::fs::PermissionsExt;
    fs::set_permissions(path, fs::Permissions::from_mode(0o755))
        .map_err(|e| format!("cannot chmod {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Output;

    /// A bundle of stand-in test binaries (each prints a passing result
    /// line and names itself into `ran`) and a fake `nvidia-smi` listing
    /// one GPU, so the runner's test loop runs on a machine without one.
    fn fake_bundle(root: &Path, names: &[&str]) -> TaskResult {
        let (tests, bin) = (root.join("b/tests"), root.join("fakebin"));
        fs::create_dir_all(&tests).map_err(|e| e.to_string())?;
        fs::create_dir_all(&bin).map_err(|e| e.to_string())?;
        let write = |path: PathBuf, text: String| -> TaskResult {
            fs::write(&path, text).map_err(|e| e.to_string())?;
            set_executable(&path)
        };
        write(
            bin.join("nvidia-smi"),
            "#!/bin/sh\necho 'GPU 0: fake'\n".into(),
        )?;
        write(root.join("b/run.sh"), RUNNER.into())?;
        for name in names {
            write(
                tests.join(name),
                format!(
                    "#!/bin/sh\necho {name} >> {}\necho 'test result: ok. 1 passed; 0 failed'\n",
                    root.join("ran").display()
                ),
            )?;
        }
        Ok(())
    }

    fn run_tests(root: &Path, only: Option<&str>) -> (Output, String) {
        let _ = fs::remove_file(root.join("ran"));
        let path = format!(
            "{}:{}",
            root.join("fakebin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let mut cmd = Command::new("bash");
        cmd.arg(root.join("b/run.sh"))
            .arg("tests")
            .env("PATH", path)
            .env("MAMBA_LOG_DIR", root.join("logs"))
            .env_remove("MAMBA_TEST_ONLY");
        if let Some(only) = only {
            cmd.env("MAMBA_TEST_ONLY", only);
        }
        let out = cmd.output().expect("bash runs");
        let ran = fs::read_to_string(root.join("ran")).unwrap_or_default();
        (out, ran)
    }

    #[test]
    fn the_runner_runs_the_named_subset_and_refuses_a_name_that_matches_nothing() {
        let root = std::env::temp_dir().join(format!("xtask-runner-{}", std::process::id()));
        let _ = fs::remove_dir_all(&root);
        let names = [
            "cuda_mamba2-1a",
            "cuda_mamba2_extra-2b",
            "digest_pins-3c",
            "cuda_train-4d",
        ];
        fake_bundle(&root, &names).expect("fake bundle");

        let (out, ran) = run_tests(&root, None);
        assert!(out.status.success(), "{out:?}");
        assert_eq!(
            ran.lines().count(),
            4,
            "the whole suite runs every binary: {ran}"
        );

        // Exact names before the hash: cuda_mamba2 is not cuda_mamba2_extra.
        let (out, ran) = run_tests(&root, Some("cuda_mamba2 digest_pins"));
        assert!(out.status.success(), "{out:?}");
        let mut got: Vec<&str> = ran.lines().collect();
        got.sort_unstable();
        assert_eq!(got, ["cuda_mamba2-1a", "digest_pins-3c"]);

        // A name that matches no binary fails, naming it.
        let (out, _) = run_tests(&root, Some("cuda_mamba digest_pins"));
        assert!(!out.status.success(), "a misspelt subset passed: {out:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("cuda_mamba,"), "{err}");
        let _ = fs::remove_dir_all(&root);
    }
}
