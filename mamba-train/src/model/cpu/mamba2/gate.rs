//! The gate of Mamba-2's gated RMSNorm (`MambaRMSNormGated` with
//! `norm_before_gate = False`): `g = y * silu(z)`, then RMSNorm of `g` with
//! the mixer's `norm.weight` (that part is the shared
//! [`ops::rmsnorm_fwd`](super::super::ops::rmsnorm_fwd)). Here `z` is the
//! first `d_inner` columns of each in_proj output row, `ld` apart. Per-token
//! work only, split over token chunks: the bits do not depend on the thread
//! count.

use rayon::prelude::*;

use super::super::float::Float;
use super::super::ops::{silu, silu_grad, TOK_CHUNK};

/// `g[t, c] = y[t, c] * silu(z[t, c])`, `z` rows `ld` apart.
pub(crate) fn gate_fwd<F: Float>(y: &[F], zx: &[F], e: usize, ld: usize, g: &mut [F]) {
    g.par_chunks_mut(TOK_CHUNK * e)
        .zip(y.par_chunks(TOK_CHUNK * e))
        .zip(zx.par_chunks(TOK_CHUNK * ld))
        .for_each(|((gs, ys), zs)| {
            for ((grow, yrow), zrow) in gs
                .chunks_exact_mut(e)
                .zip(ys.chunks_exact(e))
                .zip(zs.chunks_exact(ld))
            {
                for ((gv, &yv), &zv) in grow.iter_mut().zip(yrow).zip(&zrow[..e]) {
                    *gv = yv * silu(zv);
                }
            }
        });
}

/// Gate backward: `dy = dg * silu(z)` and `dz = (dg * y) * silu'(z)`,
/// written to the first `e` columns of each `dzx` row (`ld` apart; the other
/// columns untouched).
pub(crate) fn gate_bwd<F: Float>(
    dg: &[F],
    y: &[F],
    zx: &[F],
    e: usize,
    ld: usize,
    dy: &mut [F],
    dzx: &mut [F],
) {
    dy.par_chunks_mut(TOK_CHUNK * e)
        .zip(dzx.par_chunks_mut(TOK_CHUNK * ld))
        .zip(dg.par_chunks(TOK_CHUNK * e))
        .zip(y.par_chunks(TOK_CHUNK * e))
        .zip(zx.par_chunks(TOK_CHUNK * ld))
        .for_each(|((((dys, dzs), dgs), ys), zs)| {
            let rows = dys
                .chunks_exact_mut(e)
                .zip(dzs.chunks_exact_mut(ld))
                .zip(dgs.chunks_exact(e))
                .zip(ys.chunks_exact(e))
                .zip(zs.chunks_exact(ld));
            for ((((dyr, dzr), dgr), yr), zr) in rows {
                for c in 0..e {
                    dyr[c] = dgr[c] * silu(zr[c]);
                    dzr[c] = (dgr[c] * yr[c]) * silu_grad(zr[c]);
                }
            }
        });
}
