//! Run-time selection of the instruction set for hot loops.
//!
//! [`simd_fn!`] defines a function whose body is compiled three times:
//! portable (the crate's target baseline), with AVX2, and with AVX-512F, and
//! calls the widest one the CPU supports. The body is the same source, and
//! Rust never contracts `a * b + c` into a fused multiply-add nor reorders
//! float operations, so every variant performs the same IEEE operations in
//! the same order per element; wider vectors only process more independent
//! elements at once. The bits therefore do not depend on the CPU's features
//! (tests compare the dispatched path against portable code bit for bit,
//! using [`set_max_simd`]).

use std::sync::atomic::{AtomicU8, Ordering};

/// Widest instruction set the dispatch may pick.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum SimdLevel {
    /// The build target's baseline (SSE2 on x86-64).
    Portable = 0,
    /// AVX2 when the CPU has it.
    Avx2 = 1,
    /// AVX-512F when the CPU has it (the default ceiling).
    Avx512 = 2,
}

static MAX_LEVEL: AtomicU8 = AtomicU8::new(SimdLevel::Avx512 as u8);

/// Cap the instruction set of the CPU model's hot loops, process-wide. A
/// debugging and testing knob: results are bit-identical at every level, only
/// speed changes.
pub fn set_max_simd(level: SimdLevel) {
    MAX_LEVEL.store(level as u8, Ordering::Relaxed);
}

/// Whether the dispatch may use `level` (the cap allows it and the CPU has it).
#[inline]
pub(crate) fn allowed(level: SimdLevel) -> bool {
    if MAX_LEVEL.load(Ordering::Relaxed) < level as u8 {
        return false;
    }
    #[cfg(target_arch = "x86_64")]
    {
        match level {
            SimdLevel::Portable => true,
            SimdLevel::Avx2 => std::arch::is_x86_feature_detected!("avx2"),
            SimdLevel::Avx512 => std::arch::is_x86_feature_detected!("avx512f"),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        level == SimdLevel::Portable
    }
}

/// `simd_fn! { pub(crate) fn name<F: Float>(arg: Ty, ...) { body } }`.
macro_rules! simd_fn {
    ($(#[$meta:meta])* $vis:vis fn $name:ident<$F:ident: Float>($($arg:ident : $ty:ty),* $(,)?) $body:block) => {
        $(#[$meta])*
        $vis fn $name<$F: Float>($($arg: $ty),*) {
            #[inline(always)]
            fn body<$F: Float>($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                // `unsafe fn`: the crate's MSRV (1.85) allows `target_feature`
                // only there. Safety: call only when the CPU has the feature.
                #[target_feature(enable = "avx512f")]
                unsafe fn wide512<$F: Float>($($arg: $ty),*) {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2")]
                unsafe fn wide256<$F: Float>($($arg: $ty),*) {
                    body($($arg),*)
                }
                if $crate::model::cpu::simd::allowed($crate::model::cpu::simd::SimdLevel::Avx512) {
                    // SAFETY: the CPU supports AVX-512F (checked just above).
                    return unsafe { wide512($($arg),*) };
                }
                if $crate::model::cpu::simd::allowed($crate::model::cpu::simd::SimdLevel::Avx2) {
                    // SAFETY: the CPU supports AVX2 (checked just above).
                    return unsafe { wide256($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

pub(crate) use simd_fn;
