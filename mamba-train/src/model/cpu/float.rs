//! The scalar type the CPU model is generic over: `f32` for training, `f64`
//! for gradient checks. Both run the *same* code in the same order, so the
//! f64 twin checks the f32 program, not a different one.
//!
//! Only IEEE `+ - * /` and the functions below are used. No `mul_add`: Rust
//! never contracts `a * b + c` into a fused multiply-add, so every product is
//! rounded before it is added, which a CUDA port can mirror with
//! `__fmul_rn`/`__fadd_rn` (or `--fmad=false`).

use std::fmt::Debug;
use std::ops::{Add, Div, Mul, Neg, Sub};

/// A real scalar for the CPU model.
pub trait Float:
    Copy
    + Default
    + Send
    + Sync
    + Debug
    + PartialOrd
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + 'static
{
    /// 0.
    const ZERO: Self;
    /// 1.
    const ONE: Self;
    /// Round an f64 to this type (nearest).
    fn from_f64(v: f64) -> Self;
    /// Widen to f64 (exact).
    fn to_f64(self) -> f64;
    /// `e^self`. For f32 this is [`exp_f32`] (a fixed polynomial, so the
    /// bits do not depend on the system libm and it vectorises); for f64 it
    /// is the standard library's `exp`.
    fn exp(self) -> Self;
    /// `ln(1 + self)`. For f32 this is [`ln_1p_f32`] (fixed polynomial,
    /// vectorises); for f64 the standard library's.
    fn ln_1p(self) -> Self;
    /// Natural logarithm (standard library).
    fn ln(self) -> Self;
    /// Square root (IEEE, correctly rounded).
    fn sqrt(self) -> Self;
}

impl Float for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v as f32
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }
    #[inline(always)]
    fn ln_1p(self) -> Self {
        ln_1p_f32(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f32::ln(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl Float for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline(always)]
    fn from_f64(v: f64) -> Self {
        v
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn ln_1p(self) -> Self {
        f64::ln_1p(self)
    }
    #[inline(always)]
    fn ln(self) -> Self {
        f64::ln(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
}

/// Largest input whose result is computed; above it the result is `+inf`.
/// (True f32 overflow is at 88.7228; stopping at 88.37 keeps `2^n` a normal
/// float. No exponent in the model comes near either bound.)
pub const EXP_F32_HI: f32 = 88.37;
/// Smallest input whose result is computed; below it the result is `0`
/// (no subnormal results).
pub const EXP_F32_LO: f32 = -87.33;

/// `e^x` in f32 from plain multiplies and adds (Cephes `expf`: Cody-Waite
/// range reduction by `ln 2`, degree-6 minimax polynomial, exponent bits).
/// Within 2 ulp of the true value on `[-87.33, 88.37]`; NaN in, NaN out.
///
/// Exact recipe (a CUDA port reproduces it bit for bit with `__fmul_rn` /
/// `__fadd_rn`; constants as written in the source, rounded to f32): `xc = clamp(x)`; `t = xc * LOG2E + 12582912`;
/// `n = bits(t) - bits(12582912)`; `r = (xc - n*0.693359375) - n*(-2.12194440e-4)`;
/// `p = ((((((1.98756915e-4*r + 1.39819995e-3)*r + 8.33345191e-3)*r +
/// 4.16657959e-2)*r + 1.66666655e-1)*r + 5.00000012e-1)*(r*r) + r) + 1`;
/// result `p * 2^n`.
#[inline(always)]
#[allow(clippy::excessive_precision)] // Cephes' published constants, rounded by the compiler
pub fn exp_f32(x: f32) -> f32 {
    const MAGIC: f32 = 12_582_912.0; // 1.5 * 2^23: adding it rounds to an integer
                                     // `clamp` keeps NaN as NaN.
    let xc = x.clamp(EXP_F32_LO, EXP_F32_HI);
    let t = xc * std::f32::consts::LOG2_E + MAGIC;
    let nf = t - MAGIC;
    let n = (t.to_bits() as i32).wrapping_sub(MAGIC.to_bits() as i32);
    let r = (xc - nf * 0.693_359_375) - nf * (-2.121_944_40e-4);
    let z = r * r;
    let mut p = 1.987_569_150_0e-4_f32;
    p = p * r + 1.398_199_950_7e-3;
    p = p * r + 8.333_451_907_3e-3;
    p = p * r + 4.166_579_589_4e-2;
    p = p * r + 1.666_666_545_9e-1;
    p = p * r + 5.000_000_120_1e-1;
    p = (p * z + r) + 1.0;
    let scale = f32::from_bits((n.wrapping_add(127) as u32) << 23);
    let v = p * scale;
    if x > EXP_F32_HI {
        f32::INFINITY
    } else if x < EXP_F32_LO {
        0.0
    } else {
        v
    }
}

/// `ln(1 + y)` in f32 from plain arithmetic, for `y > -1` (finite or
/// `+inf`); NaN in, NaN out; within 3 ulp. Recipe: `u = 1 + y`; if `u == 1`
/// the result is `y`, else `ln(u) * (y / (u - 1))` (the quotient corrects
/// the rounding of `1 + y`), where `ln(u)` is Cephes `logf`: `u = m * 2^e`
/// with `m` in `[sqrt(1/2), sqrt(2))`, `x = m - 1`, `z = x*x`,
/// `q = ((((((((7.0376836292e-2*x - 1.1514610310e-1)*x + 1.1676998740e-1)*x
/// - 1.2420140846e-1)*x + 1.4249322787e-1)*x - 1.6668057665e-1)*x
/// + 2.0000714765e-1)*x - 2.4999993993e-1)*x + 3.3333331174e-1) * x * z`,
/// `ln u = (((x + ((q + e*(-2.12194440e-4)) + (-0.5*z)))) + e*0.693359375`.
#[inline(always)]
#[allow(clippy::excessive_precision)] // Cephes' published constants, rounded by the compiler
pub fn ln_1p_f32(y: f32) -> f32 {
    let u = 1.0 + y;
    let bits = u.to_bits();
    // u = m0 * 2^e0 with m0 in [1, 2).
    let mut e = ((bits >> 23) & 0xff) as i32 - 127;
    let m0 = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    let (m, bump) = if m0 > std::f32::consts::SQRT_2 {
        (m0 * 0.5, 1)
    } else {
        (m0, 0)
    };
    e += bump;
    let ef = e as f32;
    let x = m - 1.0;
    let z = x * x;
    let mut q = 7.037_683_629_2e-2_f32;
    q = q * x - 1.151_461_031_0e-1;
    q = q * x + 1.167_699_874_0e-1;
    q = q * x - 1.242_014_084_6e-1;
    q = q * x + 1.424_932_278_7e-1;
    q = q * x - 1.666_805_766_5e-1;
    q = q * x + 2.000_071_476_5e-1;
    q = q * x - 2.499_999_399_3e-1;
    q = q * x + 3.333_333_117_4e-1;
    q = q * x * z;
    let ln_u = (x + ((q + ef * (-2.121_944_40e-4)) + (-0.5 * z))) + ef * 0.693_359_375;
    let corrected = ln_u * (y / (u - 1.0));
    if y.is_nan() || y == f32::INFINITY || u == 1.0 {
        y
    } else {
        corrected
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_f32_is_within_two_ulp_of_the_true_value() {
        let mut worst = 0.0f64;
        let mut x = -87.0f32;
        while x < 88.3 {
            let got = exp_f32(x) as f64;
            let want = (x as f64).exp();
            let ulp = f32::EPSILON as f64 * want.abs();
            worst = worst.max((got - want).abs() / ulp);
            x += 0.0137;
        }
        for &x in &[0.0f32, -0.0, 1e-8, -1e-8, 0.5, -0.5, 20.0, -20.0] {
            let got = exp_f32(x) as f64;
            let want = (x as f64).exp();
            worst = worst.max((got - want).abs() / (f32::EPSILON as f64 * want));
        }
        assert!(worst < 2.0, "exp_f32 error {worst} ulp");
        assert_eq!(exp_f32(0.0), 1.0);
    }

    #[test]
    fn ln_1p_f32_is_within_three_ulp_of_the_true_value() {
        let mut worst = 0.0f64;
        let mut check = |y: f32| {
            let got = ln_1p_f32(y) as f64;
            let want = (y as f64).ln_1p();
            let ulp = f32::EPSILON as f64 * want.abs().max(f32::MIN_POSITIVE as f64);
            worst = worst.max((got - want).abs() / ulp);
        };
        let mut y = 1e-30f32;
        while y < 1e30 {
            check(y);
            y *= 1.0137;
        }
        let mut y = -0.999f32;
        while y < 3.0 {
            check(y);
            y += 0.000_731;
        }
        for y in [0.0f32, 1e-8, -1e-8, 1.0, f32::MAX] {
            check(y);
        }
        assert!(worst < 3.0, "ln_1p_f32 error {worst} ulp");
        assert!(ln_1p_f32(f32::NAN).is_nan());
        assert_eq!(ln_1p_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(ln_1p_f32(0.0), 0.0);
    }

    #[test]
    fn exp_f32_edges() {
        assert!(exp_f32(f32::NAN).is_nan());
        assert_eq!(exp_f32(100.0), f32::INFINITY);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(-100.0), 0.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert!(exp_f32(EXP_F32_HI).is_finite());
        assert!(exp_f32(EXP_F32_LO) > 0.0);
    }
}
