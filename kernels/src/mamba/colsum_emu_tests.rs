//! The two-stage column sums on the CPU: `kernels/cuda/mamba_ops.cu`'s
//! `mamba_colsum_partial` and `mamba_reduce_partials` compiled as C++ under
//! `kernels/emu/cuda_emu.h` and checked by `kernels/emu/colsum_check.cpp`
//! with this crate's slab ([`COL_SLAB`]): the partials and the sums bit for
//! bit against a host twin in the association the kernels promise (row
//! lanes in ascending order, a fixed tree over the lanes, then the slabs in
//! order), and against f64. Every mode, f32 and bf16 operands, wide leading
//! dimensions, partial slabs and column blocks. Skips, printing why, when
//! no C++20 compiler is found.

use super::scan_emu_tests::run_with_negative;
use super::COL_SLAB;

#[test]
fn column_sums_under_the_cpu_emulator_keep_their_association_and_match_f64() {
    let Some([(ok, text), (neg_ok, neg_text)]) =
        run_with_negative("colsum_check", &[("EMU_COL_SLAB", COL_SLAB)])
    else {
        return;
    };
    println!("{text}");
    assert!(ok && text.contains("all within tolerance"), "{text}");
    assert_eq!(text.matches("twin-bits ok").count(), 8, "{text}");
    // Negative control: one wrong element of a fed to the kernel must be
    // caught by the twin's bits and by the f64 oracle on every shape.
    assert!(
        !neg_ok && neg_text.matches("twin-bits DIFFER").count() == 8 && neg_text.contains("sum"),
        "the wrong input was not caught:\n{neg_text}"
    );
}
