//! The conv's fused backward on the CPU: `kernels/cuda/mamba_ops.cu`
//! compiled as C++ under `kernels/emu/cuda_emu.h` and checked by
//! `kernels/emu/conv_check.cpp`, with this crate's launch geometry
//! ([`REDUCE_THREADS`], [`COL_SLAB`]): bit for bit against a host twin that
//! makes every value by the kernel's expression in its association (so the
//! tiles and halos never move a bit, and the slab sums are the shape's
//! alone), and against the backward in f64. Shapes cover every width's
//! halo, sequences shorter than the taps, slabs ending inside a tile, a
//! partial channel block, a column block of a wider matrix, and x / dx in
//! bf16. Skips, printing why, when no C++20 compiler is found.

use super::reductions::REDUCE_THREADS;
use super::scan_emu_tests::run_with_negative;
use super::COL_SLAB;

#[test]
fn the_fused_conv_backward_under_the_cpu_emulator_keeps_its_association_and_matches_f64() {
    let defines = [
        ("EMU_BLOCK", REDUCE_THREADS as usize),
        ("EMU_COL_SLAB", COL_SLAB),
    ];
    let Some([(ok, text), (neg_ok, neg_text)]) = run_with_negative("conv_check", &defines) else {
        return;
    };
    println!("{text}");
    assert!(ok && text.contains("all within tolerance"), "{text}");
    // Every shape ran and matched its twin bit for bit.
    assert_eq!(text.matches("twin-bits ok").count(), 8, "{text}");
    // Negative control: one wrong du element fed to the kernel must be
    // caught, by the twin's bits and by the f64 oracle.
    assert!(
        !neg_ok
            && neg_text.contains("twin-bits DIFFER")
            && neg_text.contains("dw")
            && neg_text.contains("FAIL"),
        "the wrong input was not caught:\n{neg_text}"
    );
}
