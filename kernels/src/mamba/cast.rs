//! f32 -> bf16 casts: the device kernel (`mamba_cast_bf16`, feeding the
//! bf16 GEMMs of the training step) and its host twin
//! [`f32_to_bf16_rne`], which gives the same bits.
//!
//! A bf16 is stored as its bit pattern in a `u16` (the top half of an f32):
//! 1 sign bit, 8 exponent bits (f32's range), 7 mantissa bits. The cast
//! rounds to nearest, ties to even, in integer arithmetic: no flush to zero
//! (subnormals round like every other value), `+-inf` stays `+-inf`, a
//! finite value that rounds past bf16's largest becomes `+-inf`, and a NaN
//! stays a NaN of the same sign with its top payload bits, made quiet.

use cudarc::driver::{CudaStream, CudaView, CudaViewMut};

use super::check;
use super::launcher::{Arg, Grid, Launch, THREADS};
use super::MambaKernels;
use crate::error::KernelError;

/// `x` rounded to the nearest bf16 (ties to even), as its bits. The host
/// twin of the `mamba_cast_bf16` kernel: the same bits for every input.
#[inline]
pub fn f32_to_bf16_rne(x: f32) -> u16 {
    let b = x.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        // NaN: keep sign and top payload bits, set the quiet bit (so a
        // payload living only in the low 16 bits does not become inf).
        return ((b >> 16) | 0x0040) as u16;
    }
    // Adding 0x7fff rounds up past the halfway point; the low bit of the
    // kept half breaks a tie towards even. A carry into the exponent is the
    // correct rounding (up to the next binade, or to inf).
    (b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// The f32 value of a bf16 (exact: bf16 is a truncated f32).
#[inline]
pub fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

impl MambaKernels {
    /// `dst[i] = bf16(src[i])` (bits, [`f32_to_bf16_rne`]) for `i < n`.
    pub fn cast_bf16(
        &self,
        stream: &CudaStream,
        src: &CudaView<f32>,
        dst: &mut CudaViewMut<u16>,
        n: usize,
    ) -> Result<(), KernelError> {
        const K: &str = "mamba_cast_bf16";
        self.check_stream(K, stream)?;
        check::len(K, "src", src.len(), n)?;
        check::len(K, "dst", dst.len(), n)?;
        if n == 0 {
            return Ok(());
        }
        let launch = Launch {
            kernel: K,
            func: &self.f.cast_bf16,
            grid: Grid::Flat { n: n.div_ceil(8) },
            block: THREADS,
        };
        let mut args = [Arg::In(src), Arg::Out(dst), Arg::Long("n", n)];
        // SAFETY: matches mamba_cast_bf16(const float* src, unsigned short*
        // dst, long long n); thread t touches src[j] and dst[j] for j in
        // [8t, min(8t + 8, n)) only, inside the extents checked above (its
        // 16-byte accesses only when the whole 8 are below n and both
        // pointers are 16-byte aligned).
        unsafe { self.launch(stream, launch, &mut args) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An independent reference: of the two bf16 neighbours of `x` (the
    /// truncation and the next one up in magnitude), the nearer in exact
    /// (f64) arithmetic, ties to the even bit pattern.
    fn reference(x: f32) -> u16 {
        let b = x.to_bits();
        if x.is_infinite() {
            return (b >> 16) as u16;
        }
        let lo = (b >> 16) as u16;
        let hi = lo.wrapping_add(1);
        let (xl, xh) = (bf16_to_f32(lo) as f64, (hi as u32) << 16);
        // hi may be inf (0x7f80 / 0xff80): f64 distance still works, with
        // inf standing for "the value past the largest", i.e. 2^128.
        let xh = if (xh & 0x7fff_ffff) == 0x7f80_0000 {
            2f64.powi(128).copysign(x as f64)
        } else {
            f32::from_bits(xh) as f64
        };
        let (dl, dh) = ((x as f64 - xl).abs(), (xh - x as f64).abs());
        if dl < dh || (dl == dh && lo & 1 == 0) {
            lo
        } else {
            hi
        }
    }

    #[test]
    fn exact_values_are_kept() {
        for v in [0.0f32, -0.0, 1.0, -2.5, 0.15625, 65536.0, f32::MIN_POSITIVE] {
            let h = f32_to_bf16_rne(v);
            assert_eq!(bf16_to_f32(h).to_bits(), v.to_bits(), "{v}");
        }
        assert_eq!(f32_to_bf16_rne(-0.0), 0x8000);
    }

    #[test]
    fn ties_go_to_even() {
        // 1 + 2^-8 lies halfway between 1 (0x3f80, even) and 1 + 2^-7.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3f80_8000)), 0x3f80);
        // 1 + 3 * 2^-8: halfway between 0x3f81 (odd) and 0x3f82 (even).
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3f81_8000)), 0x3f82);
        // Just off the tie, either way.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3f81_7fff)), 0x3f81);
        // Negative ties mirror the positive ones.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0xbf80_8000)), 0xbf80);
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0xbf81_8000)), 0xbf82);
        // A tie that carries into the exponent: 1.9921875 + half an ulp -> 2.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x3fff_8000)), 0x4000);
    }

    #[test]
    fn nan_and_inf() {
        assert_eq!(f32_to_bf16_rne(f32::INFINITY), 0x7f80);
        assert_eq!(f32_to_bf16_rne(f32::NEG_INFINITY), 0xff80);
        // Finite values past bf16's largest (0x7f7f) round to inf ...
        assert_eq!(f32_to_bf16_rne(f32::MAX), 0x7f80);
        assert_eq!(f32_to_bf16_rne(f32::MIN), 0xff80);
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x7f7f_8000)), 0x7f80);
        // ... and below the halfway point they stay finite.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x7f7f_7fff)), 0x7f7f);
        // NaNs stay NaN (never inf), quiet, sign kept.
        for (bits, want) in [
            (0x7fc0_0000u32, 0x7fc0u16),
            (0x7f80_0001, 0x7fc0),
            (0xff80_0001, 0xffc0),
            (0x7fff_ffff, 0x7fff),
            (0x7fa0_0000, 0x7fe0),
        ] {
            let h = f32_to_bf16_rne(f32::from_bits(bits));
            assert_eq!(h, want, "{bits:#x}");
            assert!(bf16_to_f32(h).is_nan());
        }
        assert!(bf16_to_f32(f32_to_bf16_rne(f32::NAN)).is_nan());
    }

    #[test]
    fn subnormals_round_without_flushing() {
        // Smallest f32 subnormal: below half of bf16's smallest -> +0.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x0000_0001)), 0x0000);
        // Exactly half of bf16's smallest subnormal (0x0001): a tie -> even 0.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x0000_8000)), 0x0000);
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x0000_8001)), 0x0001);
        // Tie between 0x0001 (odd) and 0x0002 -> 0x0002.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x0001_8000)), 0x0002);
        // Largest subnormal rounds up into the normals.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x007f_ffff)), 0x0080);
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x8000_8001)), 0x8001);
        // A bf16 subnormal is kept exactly.
        assert_eq!(f32_to_bf16_rne(f32::from_bits(0x0012_0000)), 0x0012);
    }

    #[test]
    fn matches_an_independent_reference_over_many_patterns() {
        // Every high half with a spread of low halves (ties, just-off-ties,
        // extremes), plus a pseudo-random sweep; NaNs are checked above.
        let lows = [
            0x0000u32, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff, 0x1234, 0xc000,
        ];
        let mut checked = 0usize;
        let mut check = |b: u32| {
            let x = f32::from_bits(b);
            if x.is_nan() {
                return;
            }
            assert_eq!(f32_to_bf16_rne(x), reference(x), "{b:#010x}");
            checked += 1;
        };
        for hi in 0..=0xffffu32 {
            for lo in lows {
                check((hi << 16) | lo);
            }
        }
        let mut s = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200_000 {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            check(s as u32);
        }
        assert!(checked > 700_000, "{checked}");
    }
}
