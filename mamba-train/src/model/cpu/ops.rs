//! Per-token and per-channel operations of the Mamba block, forward and
//! backward: RMSNorm, SiLU, softplus, the gate, cross-entropy (the causal
//! depthwise convolution is in `conv`).
//!
//! Parallelism never splits a sum: per-token work is split over token
//! chunks, and every reduction over tokens (weight gradients) is one serial
//! chain in ascending token order, split only across output channels. So the
//! bits do not depend on the thread count. Every formula below states its
//! evaluation order, which is the contract a CUDA port mirrors.

use rayon::prelude::*;

use super::float::Float;
use super::simd::simd_fn;

/// Tokens per parallel task for per-token work.
pub(crate) const TOK_CHUNK: usize = 32;
/// Channels per parallel task for reductions over tokens.
pub(crate) const CH_CHUNK: usize = 16;

/// `src` (at most `W` values) as a lane array, zero-padded; a full-width
/// source is a fixed-size copy (no call to `memcpy`).
#[inline(always)]
pub(crate) fn lanes<F: Float, const W: usize>(src: &[F]) -> [F; W] {
    if let Ok(full) = <[F; W]>::try_from(src) {
        return full;
    }
    let mut v = [F::ZERO; W];
    v[..src.len()].copy_from_slice(src);
    v
}

#[inline(always)]
fn from_usize<F: Float>(v: usize) -> F {
    F::from_f64(v as f64)
}

/// `sigmoid(v) = 1 / (1 + exp(-v))`.
#[inline(always)]
pub(crate) fn sigmoid<F: Float>(v: F) -> F {
    F::ONE / (F::ONE + (-v).exp())
}

/// `silu(v) = v / (1 + exp(-v))` (PyTorch's CPU formula).
#[inline(always)]
pub(crate) fn silu<F: Float>(v: F) -> F {
    v / (F::ONE + (-v).exp())
}

/// `d silu / dv = s * (1 + v * (1 - s))`, `s = sigmoid(v)` (PyTorch's).
#[inline(always)]
pub(crate) fn silu_grad<F: Float>(v: F) -> F {
    let s = sigmoid(v);
    s * (F::ONE + v * (F::ONE - s))
}

/// PyTorch's softplus (beta 1, threshold 20): `v` above 20, else
/// `ln_1p(exp(v))`.
#[inline(always)]
pub(crate) fn softplus<F: Float>(v: F) -> F {
    if v > from_usize(20) {
        v
    } else {
        v.exp().ln_1p()
    }
}

/// Softplus backward as PyTorch: `g` above 20, else `(g * z) / (z + 1)`
/// with `z = exp(v)`.
#[inline(always)]
pub(crate) fn softplus_grad<F: Float>(v: F, g: F) -> F {
    if v > from_usize(20) {
        g
    } else {
        let z = v.exp();
        (g * z) / (z + F::ONE)
    }
}

/// RMSNorm forward over rows of `d = w.len()`:
/// `ss = sum_j x_j*x_j` (ascending j), `rstd = 1 / sqrt(ss / d + eps)`,
/// `out_j = (x_j * rstd) * w_j`. Stores `rstd` per row for the backward.
pub(crate) fn rmsnorm_fwd<F: Float>(x: &[F], w: &[F], eps: F, out: &mut [F], rstd: &mut [F]) {
    let d = w.len();
    out.par_chunks_mut(TOK_CHUNK * d)
        .zip(rstd.par_chunks_mut(TOK_CHUNK))
        .zip(x.par_chunks(TOK_CHUNK * d))
        .for_each(|((o, r), xs)| rmsnorm_fwd_rows(xs, w, eps, o, r));
}

simd_fn! {
fn rmsnorm_fwd_rows<F: Float>(xs: &[F], w: &[F], eps: F, o: &mut [F], r: &mut [F]) {
    let d = w.len();
    let dn: F = from_usize(d);
    for ((orow, rv), xrow) in o.chunks_exact_mut(d).zip(r.iter_mut()).zip(xs.chunks_exact(d)) {
        let mut ss = F::ZERO;
        for &v in xrow {
            ss = ss + v * v;
        }
        let rs = F::ONE / (ss / dn + eps).sqrt();
        *rv = rs;
        for ((ov, &xv), &wv) in orow.iter_mut().zip(xrow).zip(w) {
            *ov = (xv * rs) * wv;
        }
    }
}
}

/// RMSNorm backward. With `xh_j = x_j * rstd` and `g_j = dy_j * w_j`:
/// `dot = sum_j g_j * xh_j` (ascending j),
/// `dx_j = rstd * (g_j - xh_j * (dot / d))`, added to `dx` when `add`
/// (`dx_j = dx_old_j + that`) or stored otherwise;
/// `dw_j = sum_t dy[t,j] * xh[t,j]` in ascending t (overwrites `dw`).
pub(crate) fn rmsnorm_bwd<F: Float>(
    dy: &[F],
    x: &[F],
    rstd: &[F],
    w: &[F],
    dx: &mut [F],
    add: bool,
    dw: &mut [F],
) {
    let d = w.len();
    dx.par_chunks_mut(TOK_CHUNK * d)
        .zip(dy.par_chunks(TOK_CHUNK * d))
        .zip(x.par_chunks(TOK_CHUNK * d))
        .zip(rstd.par_chunks(TOK_CHUNK))
        .for_each(|(((dxs, dys), xs), rs)| rmsnorm_bwd_rows(dys, xs, rs, w, dxs, add));
    rmsnorm_dw(dy, x, rstd, dw);
}

simd_fn! {
fn rmsnorm_bwd_rows<F: Float>(dys: &[F], xs: &[F], rs: &[F], w: &[F], dxs: &mut [F], add: bool) {
    let d = w.len();
    let dn: F = from_usize(d);
    for (((dxrow, dyrow), xrow), &r) in dxs.chunks_exact_mut(d).zip(dys.chunks_exact(d)).zip(xs.chunks_exact(d)).zip(rs) {
        let mut dot = F::ZERO;
        for ((&dyv, &xv), &wv) in dyrow.iter().zip(xrow).zip(w) {
            dot = dot + (dyv * wv) * (xv * r);
        }
        let m = dot / dn;
        for (((dxv, &dyv), &xv), &wv) in dxrow.iter_mut().zip(dyrow).zip(xrow).zip(w) {
            let v = r * ((dyv * wv) - (xv * r) * m);
            *dxv = if add { *dxv + v } else { v };
        }
    }
}
}

simd_fn! {
fn rmsnorm_dw<F: Float>(dy: &[F], x: &[F], rstd: &[F], dw: &mut [F]) {
    let d = dw.len();
    dw.fill(F::ZERO);
    for ((dyrow, xrow), &r) in dy.chunks_exact(d).zip(x.chunks_exact(d)).zip(rstd) {
        for ((dwv, &dyv), &xv) in dw.iter_mut().zip(dyrow).zip(xrow) {
            *dwv = *dwv + dyv * (xv * r);
        }
    }
}
}

/// `out_j = sum_t v[t,j]` over rows of `out.len()` columns, ascending t,
/// from 0.
pub(crate) fn col_sum<F: Float>(v: &[F], out: &mut [F]) {
    col_sum_simd(v, out);
}

simd_fn! {
fn col_sum_simd<F: Float>(v: &[F], out: &mut [F]) {
    out.fill(F::ZERO);
    for row in v.chunks_exact(out.len()) {
        for (o, &x) in out.iter_mut().zip(row) {
            *o = *o + x;
        }
    }
}
}

/// `dtr = dtr + bias` (in place, rows of `bias.len()`), `dt = softplus(dtr)`.
pub(crate) fn bias_softplus<F: Float>(dtr: &mut [F], bias: &[F], dt: &mut [F]) {
    let e = bias.len();
    dtr.par_chunks_mut(TOK_CHUNK * e)
        .zip(dt.par_chunks_mut(TOK_CHUNK * e))
        .for_each(|(a, o)| bias_softplus_rows(a, bias, o));
}

simd_fn! {
fn bias_softplus_rows<F: Float>(a: &mut [F], bias: &[F], o: &mut [F]) {
    let e = bias.len();
    for (arow, orow) in a.chunks_exact_mut(e).zip(o.chunks_exact_mut(e)) {
        for ((av, ov), &bv) in arow.iter_mut().zip(orow.iter_mut()).zip(bias) {
            *av = *av + bv;
            *ov = softplus(*av);
        }
    }
}
}

/// `g = y * silu(z)` with `z` the second half of each `xz` row.
pub(crate) fn gate_fwd<F: Float>(y: &[F], xz: &[F], e: usize, g: &mut [F]) {
    g.par_chunks_mut(TOK_CHUNK * e)
        .zip(y.par_chunks(TOK_CHUNK * e))
        .zip(xz.par_chunks(TOK_CHUNK * 2 * e))
        .for_each(|((gs, ys), xzs)| gate_fwd_rows(ys, xzs, e, gs));
}

simd_fn! {
fn gate_fwd_rows<F: Float>(ys: &[F], xzs: &[F], e: usize, gs: &mut [F]) {
    for ((grow, yrow), xzrow) in gs.chunks_exact_mut(e).zip(ys.chunks_exact(e)).zip(xzs.chunks_exact(2 * e)) {
        for ((gv, &yv), &zv) in grow.iter_mut().zip(yrow).zip(&xzrow[e..]) {
            *gv = yv * silu(zv);
        }
    }
}
}

/// Gate backward: `dy = dg * silu(z)`; `dz = (dg * y) * silu'(z)` written to
/// the second half of each `dxz` row.
pub(crate) fn gate_bwd<F: Float>(
    dg: &[F],
    y: &[F],
    xz: &[F],
    e: usize,
    dy: &mut [F],
    dxz: &mut [F],
) {
    dy.par_chunks_mut(TOK_CHUNK * e)
        .zip(dxz.par_chunks_mut(TOK_CHUNK * 2 * e))
        .zip(dg.par_chunks(TOK_CHUNK * e))
        .zip(y.par_chunks(TOK_CHUNK * e))
        .zip(xz.par_chunks(TOK_CHUNK * 2 * e))
        .for_each(|((((dys, dxzs), dgs), ys), xzs)| gate_bwd_rows(dgs, ys, xzs, e, dys, dxzs));
}

simd_fn! {
fn gate_bwd_rows<F: Float>(dgs: &[F], ys: &[F], xzs: &[F], e: usize, dys: &mut [F], dxzs: &mut [F]) {
    let rows = dys
        .chunks_exact_mut(e)
        .zip(dxzs.chunks_exact_mut(2 * e))
        .zip(dgs.chunks_exact(e))
        .zip(ys.chunks_exact(e))
        .zip(xzs.chunks_exact(2 * e));
    for ((((dyr, dxzr), dgr), yr), xzr) in rows {
        let (z, dz) = (&xzr[e..], &mut dxzr[e..]);
        for j in 0..e {
            dyr[j] = dgr[j] * silu(z[j]);
            dz[j] = (dgr[j] * yr[j]) * silu_grad(z[j]);
        }
    }
}
}

/// In place: `g = softplus_grad(v, g)` (d loss / d dt to d loss / d dtr).
pub(crate) fn softplus_bwd<F: Float>(g: &mut [F], v: &[F]) {
    g.par_chunks_mut(4096)
        .zip(v.par_chunks(4096))
        .for_each(|(gs, vs)| softplus_bwd_chunk(gs, vs));
}

simd_fn! {
fn softplus_bwd_chunk<F: Float>(gs: &mut [F], vs: &[F]) {
    for (gv, &vv) in gs.iter_mut().zip(vs) {
        *gv = softplus_grad(vv, *gv);
    }
}
}

/// In place: `g = g * silu'(v)` (d loss / d u to d loss / d xc).
pub(crate) fn silu_bwd<F: Float>(g: &mut [F], v: &[F]) {
    g.par_chunks_mut(4096)
        .zip(v.par_chunks(4096))
        .for_each(|(gs, vs)| silu_bwd_chunk(gs, vs));
}

simd_fn! {
fn silu_bwd_chunk<F: Float>(gs: &mut [F], vs: &[F]) {
    for (gv, &vv) in gs.iter_mut().zip(vs) {
        *gv = *gv * silu_grad(vv);
    }
}
}

/// In place: `o = x + o` (the residual connection).
pub(crate) fn residual_add<F: Float>(o: &mut [F], x: &[F]) {
    o.par_chunks_mut(4096)
        .zip(x.par_chunks(4096))
        .for_each(|(os, xs)| residual_add_chunk(os, xs));
}

simd_fn! {
fn residual_add_chunk<F: Float>(os: &mut [F], xs: &[F]) {
    for (ov, &xv) in os.iter_mut().zip(xs) {
        *ov = xv + *ov;
    }
}
}

/// Cross-entropy per token with `count` valid targets. For a valid target:
/// `m = max_j l_j`, `s = sum_j exp(l_j - m)` (ascending j), the token loss
/// is `(m + ln s) - l_target`; the returned total is the f64 sum of the token
/// losses in ascending token order. When `dlogits` is given it is
/// overwritten with `(exp(l_j - m) / s - [j == target]) * (1 / count)`
/// (zero rows for ignored targets). Targets must be valid indices or
/// negative (ignored); the caller checks.
pub(crate) fn cross_entropy<F: Float>(
    logits: &[F],
    targets: &[i32],
    v: usize,
    dlogits: Option<&mut [F]>,
) -> f64 {
    let count = targets.iter().filter(|&&t| t >= 0).count();
    let mut per_tok = vec![F::ZERO; targets.len()];
    let inv = if count > 0 {
        F::ONE / from_usize::<F>(count)
    } else {
        F::ZERO
    };
    let row = |lrow: &[F], target: i32, drow: Option<&mut [F]>| -> F {
        if target < 0 {
            if let Some(d) = drow {
                d.fill(F::ZERO);
            }
            return F::ZERO;
        }
        let tgt = target as usize;
        let mut m = lrow[0];
        for &x in &lrow[1..] {
            if x > m {
                m = x;
            }
        }
        let mut s = F::ZERO;
        for &x in lrow {
            s = s + (x - m).exp();
        }
        if let Some(d) = drow {
            for (j, (dv, &x)) in d.iter_mut().zip(lrow).enumerate() {
                let p = (x - m).exp() / s;
                let onehot = if j == tgt { F::ONE } else { F::ZERO };
                *dv = (p - onehot) * inv;
            }
        }
        (m + s.ln()) - lrow[tgt]
    };
    match dlogits {
        Some(dl) => {
            per_tok
                .par_chunks_mut(TOK_CHUNK)
                .zip(dl.par_chunks_mut(TOK_CHUNK * v))
                .enumerate()
                .for_each(|(ci, (pt, dls))| {
                    for (r, (p, drow)) in pt.iter_mut().zip(dls.chunks_exact_mut(v)).enumerate() {
                        let t = ci * TOK_CHUNK + r;
                        *p = row(&logits[t * v..(t + 1) * v], targets[t], Some(drow));
                    }
                });
        }
        None => {
            per_tok
                .par_chunks_mut(TOK_CHUNK)
                .enumerate()
                .for_each(|(ci, pt)| {
                    for (r, p) in pt.iter_mut().enumerate() {
                        let t = ci * TOK_CHUNK + r;
                        *p = row(&logits[t * v..(t + 1) * v], targets[t], None);
                    }
                });
        }
    }
    per_tok.iter().fold(0.0f64, |acc, &x| acc + x.to_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activation_gradients_match_central_differences() {
        let h = 1e-6;
        for &v in &[-30.0f64, -5.0, -0.7, 0.0, 0.3, 4.0, 19.0, 25.0] {
            let fd = (silu(v + h) - silu(v - h)) / (2.0 * h);
            assert!((fd - silu_grad(v)).abs() < 1e-8, "silu' at {v}");
            let fd = (softplus(v + h) - softplus(v - h)) / (2.0 * h);
            assert!(
                (fd - softplus_grad(v, 1.0)).abs() < 1e-8,
                "softplus' at {v}"
            );
        }
        // Threshold behaviour as PyTorch: identity above 20.
        assert_eq!(softplus(20.5f64), 20.5);
        assert!((softplus(0.0f64) - 2f64.ln()).abs() < 1e-15);
    }

    #[test]
    fn cross_entropy_of_uniform_logits_is_ln_vocab_and_ignores_ignored() {
        let v = 7;
        let logits = vec![0.25f64; 3 * v];
        let targets = [2, -100, 6];
        let mut d = vec![9.0f64; 3 * v];
        let total = cross_entropy(&logits, &targets, v, Some(&mut d));
        assert!((total - 2.0 * (v as f64).ln()).abs() < 1e-12);
        assert!(
            d[v..2 * v].iter().all(|&x| x == 0.0),
            "ignored row has zero gradient"
        );
        let row0: f64 = d[..v].iter().sum();
        assert!(row0.abs() < 1e-15, "softmax minus one-hot sums to zero");
        assert!((d[2] - (1.0 / 7.0 - 1.0) / 2.0).abs() < 1e-15);
    }
}
