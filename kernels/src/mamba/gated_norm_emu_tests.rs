//! Mamba-2's fused gated-norm backward on the CPU: `kernels/cuda/mamba_ops.cu`
//! compiled as C++ under `kernels/emu/cuda_emu.h` and checked by
//! `kernels/emu/gated_norm_check.cpp`, with this crate's launch geometry
//! ([`REDUCE_THREADS`] threads, [`ROWS_PER_BLOCK`] rows a block): its `dy`
//! and `dz` bit for bit against `mamba_rmsnorm_bwd` into an f32 gradient
//! followed by `mamba_gate_bwd` (the two kernels it replaces in the model,
//! which the CUDA parity tests pin), and both against the backward in f64.
//! Skips, printing why, when no C++20 compiler is found.

use super::ops::ROWS_PER_BLOCK;
use super::reductions::REDUCE_THREADS;
use super::scan_emu_tests::run_with_negative;

#[test]
fn the_fused_gated_norm_backward_under_the_cpu_emulator_is_the_two_kernels_bit_for_bit() {
    let defines = [
        ("EMU_BLOCK", REDUCE_THREADS as usize),
        ("EMU_ROWS_PER_BLOCK", ROWS_PER_BLOCK),
    ];
    let Some([(ok, text), (neg_ok, neg_text)]) = run_with_negative("gated_norm_check", &defines)
    else {
        return;
    };
    println!("{text}");
    assert!(ok && text.contains("all within tolerance"), "{text}");
    assert_eq!(text.matches("two-kernel-bits ok").count(), 6, "{text}");
    // Negative control: one wrong dgn element fed to the fused kernel alone
    // must be caught.
    assert!(
        !neg_ok && neg_text.contains("two-kernel-bits DIFFER"),
        "the wrong input was not caught:\n{neg_text}"
    );
}
