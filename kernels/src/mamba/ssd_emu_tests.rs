//! The SSD kernels' logic on the CPU: `kernels/cuda/mamba_ssd.cu` and
//! `mamba_ssd_tc.cu` compiled as C++ under `kernels/emu/cuda_emu.h` (whose
//! tensor-core mma exchanges the fragments through the warp as the PTX
//! layout places them) and checked by `kernels/emu/ssd_check.cpp` against
//! the sequential recurrence in f64, forward and backward, with the host
//! launchers' grids and order: once with the SIMT products (f32 runs), once
//! with the tensor-core ones (tf32 / bf16 runs, at tf32's tolerances; their
//! `_h` twins, which keep x, B, C, dy and the states in bf16, against them fed
//! the bf16 rounding, bit for bit). Runs on
//! every machine with a C++20 compiler, so an index, barrier or formula bug
//! in the SSD kernels fails CI before any GPU run. Skips, printing why, when
//! no C++20 compiler is found.

use super::scan_emu_tests::run_with_negative;

/// The check with the SIMT (`tc = 0`) or tensor-core (`tc = 1`) products,
/// then its negative control.
fn check(tc: usize) {
    let Some([(ok, text), (neg_ok, neg_text)]) = run_with_negative("ssd_check", &[("EMU_TC", tc)])
    else {
        return;
    };
    println!("{text}");
    assert!(ok && text.contains("all within tolerance"), "{text}");
    // Every shape ran (a crash or an early exit would print fewer lines).
    assert_eq!(text.matches(" bits ").count(), 8, "{text}");
    if tc == 1 {
        // The bf16 kernels (`_h`) ran on every shape: fed x, B, C and dy's
        // rounding, their states are the rounded states of the f32 kernels
        // fed its widening, and every product that of the f32 kernels fed
        // those values, bit for bit.
        assert_eq!(text.matches("bf16-kept ok").count(), 8, "{text}");
    }
    // Negative control: one wrong dt fed to the kernels must be caught.
    assert!(
        !neg_ok && neg_text.contains("FAIL"),
        "the wrong input was not caught:\n{neg_text}"
    );
}

#[test]
fn the_ssd_kernels_under_the_cpu_emulator_match_the_sequential_recurrence_in_f64() {
    check(0);
}

#[test]
fn the_tensor_core_ssd_kernels_under_the_cpu_emulator_match_it_at_tf32_tolerances() {
    check(1);
}
