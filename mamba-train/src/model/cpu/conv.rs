//! The causal depthwise convolution with SiLU, forward and backward, over
//! token-major rows. The same order rules as `ops`: per-token work split
//! over sequences and token chunks, the weight and bias gradients one
//! serial chain per channel in ascending (sequence, token) order, so the
//! bits do not depend on the thread count.

use rayon::prelude::*;

use super::float::Float;
use super::ops::{lanes, silu, CH_CHUNK};
use super::simd::simd_fn;

/// Shapes of the causal depthwise convolution.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ConvDims {
    /// Tokens per sequence.
    pub l: usize,
    /// Channels.
    pub e: usize,
    /// Kernel width.
    pub k: usize,
    /// Row stride of the input (the x half of `xz`, so `2 * e`).
    pub ld_in: usize,
}

/// Conv weights `[e, 1, k]` transposed to `[k, e]` (into `wt`) so the inner
/// loop runs over contiguous channels.
pub(crate) fn conv_weight_t<F: Float>(w: &[F], e: usize, k: usize, wt: &mut Vec<F>) {
    wt.clear();
    wt.resize(k * e, F::ZERO);
    for c in 0..e {
        for j in 0..k {
            wt[j * e + c] = w[c * k + j];
        }
    }
}

/// Causal depthwise conv + bias, then SiLU. For token t of a sequence:
/// `acc = sum_{j: s = t+j-(k-1) >= 0} w[c,j] * x[s,c]` (ascending j, from 0;
/// the left padding contributes nothing), `xc = acc + bias[c]`,
/// `u = silu(xc)`. `x` rows have stride `ld_in`; `xc`, `u` are `[T, e]`.
pub(crate) fn conv_silu_fwd<F: Float>(
    x: &[F],
    wt: &[F],
    bias: &[F],
    dims: ConvDims,
    xc: &mut [F],
    u: &mut [F],
) {
    let ConvDims { l, e, ld_in, .. } = dims;
    xc.par_chunks_mut(l * e)
        .zip(u.par_chunks_mut(l * e))
        .zip(x.par_chunks(l * ld_in))
        .for_each(|((xcr, ur), xr)| conv_fwd_seq(xr, wt, bias, dims, xcr, ur));
}

simd_fn! {
fn conv_fwd_seq<F: Float>(x: &[F], wt: &[F], bias: &[F], dims: ConvDims, xcr: &mut [F], ur: &mut [F]) {
    let ConvDims { l, e, k, ld_in } = dims;
    for t in 0..l {
        let out = &mut xcr[t * e..(t + 1) * e];
        out.fill(F::ZERO);
        for (j, wj) in wt.chunks_exact(e).enumerate() {
            let Some(s) = (t + j).checked_sub(k - 1) else { continue };
            for ((o, &wv), &xv) in out.iter_mut().zip(wj).zip(&x[s * ld_in..s * ld_in + e]) {
                *o = *o + wv * xv;
            }
        }
        for ((o, &bv), uo) in out.iter_mut().zip(bias).zip(ur[t * e..(t + 1) * e].iter_mut()) {
            *o = *o + bv;
            *uo = silu(*o);
        }
    }
}
}

/// Conv backward, given `dxc` = d loss / d (conv output). Input gradient for
/// token s: `dx[s,c] = sum_{j: t = s+(k-1)-j < l} dxc[t,c] * w[c,j]`
/// (ascending j, from 0), written to `dx` rows of stride `ld_in`. Weight
/// gradients, one chain over (sequence, token) ascending per element:
/// `dw[c,j] = sum dxc[t,c] * x[t+j-(k-1),c]`, `db[c] = sum dxc[t,c]`.
pub(crate) fn conv_bwd<F: Float>(
    dxc: &[F],
    x: &[F],
    wt: &[F],
    dims: ConvDims,
    dx: &mut [F],
    dw: &mut [F],
    db: &mut [F],
) {
    let ConvDims { l, e, ld_in, .. } = dims;
    dx.par_chunks_mut(l * ld_in)
        .zip(dxc.par_chunks(l * e))
        .for_each(|(dxr, gr)| conv_bwd_input_seq(gr, wt, dims, dxr));
    dw.par_chunks_mut(CH_CHUNK * dims.k)
        .zip(db.par_chunks_mut(CH_CHUNK))
        .enumerate()
        .for_each(|(ci, (dwc, dbc))| conv_bwd_weight_chunk(dxc, x, dims, ci * CH_CHUNK, dwc, dbc));
}

simd_fn! {
fn conv_bwd_input_seq<F: Float>(g: &[F], wt: &[F], dims: ConvDims, dxr: &mut [F]) {
    let ConvDims { l, e, k, ld_in } = dims;
    for s in 0..l {
        let out = &mut dxr[s * ld_in..s * ld_in + e];
        out.fill(F::ZERO);
        for (j, wj) in wt.chunks_exact(e).enumerate() {
            let t = s + (k - 1) - j;
            if t >= l {
                continue;
            }
            for ((o, &wv), &gv) in out.iter_mut().zip(wj).zip(&g[t * e..(t + 1) * e]) {
                *o = *o + gv * wv;
            }
        }
    }
}
}

simd_fn! {
/// Channels `c0 .. c0 + db.len()` of the weight and bias gradients.
fn conv_bwd_weight_chunk<F: Float>(dxc: &[F], x: &[F], dims: ConvDims, c0: usize, dwc: &mut [F], dbc: &mut [F]) {
    let ConvDims { l, e, k, ld_in } = dims;
    let nseq = dxc.len() / (l * e);
    let w = dbc.len();
    let mut accw = [[F::ZERO; CH_CHUNK]; MAX_CONV];
    let mut accb = [F::ZERO; CH_CHUNK];
    // Kernel taps beyond MAX_CONV go through a heap buffer (never in the
    // reference configs, d_conv = 4).
    let mut extra = vec![[F::ZERO; CH_CHUNK]; k.saturating_sub(MAX_CONV)];
    for b in 0..nseq {
        for t in 0..l {
            let tok = b * l + t;
            let g = lanes::<F, CH_CHUNK>(&dxc[tok * e + c0..tok * e + c0 + w]);
            for j in 0..k {
                let Some(s) = (t + j).checked_sub(k - 1) else { continue };
                let src = (b * l + s) * ld_in + c0;
                let xs = lanes::<F, CH_CHUNK>(&x[src..src + w]);
                let a = if j < MAX_CONV { &mut accw[j] } else { &mut extra[j - MAX_CONV] };
                for c in 0..CH_CHUNK {
                    a[c] = a[c] + g[c] * xs[c];
                }
            }
            for c in 0..CH_CHUNK {
                accb[c] = accb[c] + g[c];
            }
        }
    }
    for c in 0..w {
        for j in 0..k {
            dwc[c * k + j] = if j < MAX_CONV { accw[j][c] } else { extra[j - MAX_CONV][c] };
        }
    }
    dbc.copy_from_slice(&accb[..w]);
}
}

/// Conv widths whose weight-gradient accumulators live on the stack.
const MAX_CONV: usize = 8;
