//! The scan kernels' logic on the CPU: `kernels/cuda/mamba_scan.cu` compiled
//! as C++ under `kernels/emu/cuda_emu.h` (blocks as threads with real
//! barriers, shuffles, shared memory refilled with NaN per block, cp.async
//! landing as late as the hardware may) and checked by
//! `kernels/emu/scan_check.cpp` against a sequential f64 scan, with the
//! launch geometry of [`scan_shape`](super::scan_shape). This runs on every
//! machine with a C++20 compiler, GPU or not, so an index, barrier or
//! staging bug in the scan fails CI before any GPU run; the GPU test
//! (`mamba-train/tests/cuda_scan.rs`) checks the same oracle on the device.
//! Skips, printing why, when no C++20 compiler is found (`$CXX`, else `c++`).

use std::path::{Path, PathBuf};
use std::process::Command;

use super::scan_shape::{BLOCK, LANE_STATES, RED_STEPS};

pub(super) fn compiler() -> String {
    std::env::var("CXX").unwrap_or_else(|_| "c++".to_string())
}

/// `Err(reason)` when `cxx` cannot compile C++20 with `<barrier>`.
pub(super) fn probe(cxx: &str, dir: &Path) -> Result<(), String> {
    let src = dir.join("probe.cpp");
    std::fs::write(
        &src,
        "#include <barrier>\nint main() { std::barrier<> b(1); }\n",
    )
    .map_err(|e| format!("writing {}: {e}", src.display()))?;
    let out = Command::new(cxx)
        .args(["-std=c++20", "-pthread", "-o"])
        .arg(dir.join("probe"))
        .arg(&src)
        .output()
        .map_err(|e| format!("no C++ compiler `{cxx}` ({e})"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "`{cxx}` does not compile C++20 <barrier>: {}",
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .next()
                .unwrap_or("")
        ))
    }
}

/// Compile `kernels/emu/<check>.cpp` (the kernels it includes under the
/// emulator) with `-D<name>=<value>` for each define, and run it: (exit
/// status success, stdout). Shared with the SSD kernels' check.
pub(super) fn compile_and_run(
    cxx: &str,
    dir: &Path,
    check: &str,
    defines: &[(&str, usize)],
) -> (bool, String) {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let tag: String = defines.iter().map(|(k, v)| format!("_{k}{v}")).collect();
    let exe = dir.join(format!("{check}{tag}"));
    let out = Command::new(cxx)
        .args(["-std=c++20", "-O2", "-pthread", "-DMAMBA_CUDA_EMU"])
        .args(defines.iter().map(|(k, v)| format!("-D{k}={v}")))
        .arg("-I")
        .arg(root.join("cuda"))
        .arg("-I")
        .arg(root.join("emu"))
        .args(["-include", "cuda_emu.h", "-x", "c++"])
        .arg(root.join(format!("emu/{check}.cpp")))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("run the C++ compiler");
    assert!(
        out.status.success(),
        "compiling the emulated {check} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = Command::new(&exe)
        .output()
        .unwrap_or_else(|e| panic!("run the emulated {check}: {e}"));
    let text = String::from_utf8_lossy(&run.stdout).into_owned();
    (run.status.success(), text)
}

/// Build and run `kernels/emu/<check>.cpp` twice, with `defines` and
/// `EMU_NEGATIVE` 0 then 1 (its negative control): `[(success, stdout)]` of
/// the two runs, or `None` (printing why) when no C++20 compiler is found.
pub(super) fn run_with_negative(
    check: &str,
    defines: &[(&str, usize)],
) -> Option<[(bool, String); 2]> {
    let dir = tempfile::tempdir().expect("temp dir");
    let cxx = compiler();
    if let Err(why) = probe(&cxx, dir.path()) {
        eprintln!("skipping: {why}");
        return None;
    }
    let run = |negative: usize| {
        let mut all = defines.to_vec();
        all.push(("EMU_NEGATIVE", negative));
        compile_and_run(&cxx, dir.path(), check, &all)
    };
    Some([run(0), run(1)])
}

/// The scan check with the launch geometry of `scan_shape.rs` and
/// `-DEMU_NEGATIVE=negative`.
fn build_and_run(cxx: &str, dir: &Path, negative: bool) -> (bool, String) {
    compile_and_run(
        cxx,
        dir,
        "scan_check",
        &[
            ("EMU_BLOCK", BLOCK),
            ("EMU_LANE_STATES", LANE_STATES),
            ("EMU_RED_STEPS", RED_STEPS),
            ("EMU_NEGATIVE", usize::from(negative)),
        ],
    )
}

#[test]
fn the_scan_kernels_under_the_cpu_emulator_match_a_sequential_f64_scan() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cxx = compiler();
    if let Err(why) = probe(&cxx, dir.path()) {
        eprintln!("skipping: {why}");
        return;
    }
    let (ok, text) = build_and_run(&cxx, dir.path(), false);
    println!("{text}");
    assert!(ok && text.contains("all within tolerance"), "{text}");
    // The bf16-kept u / dt / z comparison ran (even-D shapes) and agreed.
    assert!(
        text.contains("bf16 u/dt/z same bits") && !text.contains("DIFFER"),
        "{text}"
    );
    // Negative control: one wrong dt fed to the kernels must be caught.
    let (ok, text) = build_and_run(&cxx, dir.path(), true);
    assert!(
        !ok && text.contains("FAIL"),
        "the wrong input was not caught:\n{text}"
    );
}
