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
use super::scan_emu_tests::{compile_and_run, compiler, probe};
use super::COL_SLAB;

#[test]
fn the_fused_conv_backward_under_the_cpu_emulator_keeps_its_association_and_matches_f64() {
    let dir = tempfile::tempdir().expect("temp dir");
    let cxx = compiler();
    if let Err(why) = probe(&cxx, dir.path()) {
        eprintln!("skipping: {why}");
        return;
    }
    let run = |negative: bool| {
        compile_and_run(
            &cxx,
            dir.path(),
            "conv_check",
            &[
                ("EMU_BLOCK", REDUCE_THREADS as usize),
                ("EMU_COL_SLAB", COL_SLAB),
                ("EMU_NEGATIVE", usize::from(negative)),
            ],
        )
    };
    let (ok, text) = run(false);
    println!("{text}");
    assert!(ok && text.contains("all within tolerance"), "{text}");
    // Every shape ran and matched its twin bit for bit.
    assert_eq!(text.matches("twin-bits ok").count(), 8, "{text}");
    // Negative control: one wrong du element fed to the kernel must be
    // caught, by the twin's bits and by the f64 oracle.
    let (ok, text) = run(true);
    assert!(
        !ok && text.contains("twin-bits DIFFER") && text.contains("dw") && text.contains("FAIL"),
        "the wrong input was not caught:\n{text}"
    );
}
