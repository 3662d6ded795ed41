//! The whole network, forward and backward, generic over [`Float`].
//!
//! Shapes (`T = batch * seq_len` tokens, row-major, token-major):
//! residual `x` `[T, d_model]`; `xz = in_proj(norm(x))` `[T, 2*d_inner]`
//! (x half then z half); `xc` (conv output), `u = silu(xc)`, `dtr`
//! (pre-softplus), `dt`, `y` (scan output with the D skip), `g = y * silu(z)`
//! all `[T, d_inner]`; `dbc = x_proj(u)` `[T, dt_rank + 2*d_state]` holding
//! dt_raw, B, C in that order. The forward keeps every one of these per
//! layer (in a [`Workspace`]) for the backward; the scan states are
//! recomputed there.

use rayon::prelude::*;

use super::conv;
use super::float::Float;
use super::gemm::{gemm, Accum, MatRef};
use super::ops::{self, TOK_CHUNK};
use super::scan::{self, ScanGrads};
use super::workspace::Dims;
pub(crate) use super::workspace::Workspace;
use crate::config::{ModelConfig, RMS_EPS};
use crate::params::ParamLayout;

/// Forward pass over `tokens` (`nseq` sequences of `l`; ids already
/// validated) into `ws`. `nseq * l` must be positive.
pub(crate) fn forward<F: Float>(
    cfg: &ModelConfig,
    lay: &ParamLayout,
    p: &[F],
    tokens: &[u32],
    nseq: usize,
    l: usize,
    ws: &mut Workspace<F>,
) {
    let dm = Dims::new(cfg, nseq, l);
    let Dims {
        t,
        d,
        e,
        r,
        k,
        v,
        ld_bc,
        ..
    } = dm;
    ws.size_forward(&dm, cfg.n_layer);
    let eps = F::from_f64(RMS_EPS as f64);
    let emb = &p[lay.embedding.clone()];
    ws.xs[0]
        .par_chunks_mut(TOK_CHUNK * d)
        .enumerate()
        .for_each(|(ci, xs)| {
            for (i, row) in xs.chunks_exact_mut(d).enumerate() {
                let tok = tokens[ci * TOK_CHUNK + i] as usize;
                row.copy_from_slice(&emb[tok * d..(tok + 1) * d]);
            }
        });
    let panels = &mut ws.panels;
    for (i, (lo, la)) in lay.layers.iter().zip(ws.layers.iter_mut()).enumerate() {
        let (done, rest) = ws.xs.split_at_mut(i + 1);
        let (x_in, x_out) = (&done[i], &mut rest[0]);
        ops::rmsnorm_fwd(x_in, &p[lo.norm.clone()], eps, &mut la.xn, &mut la.rstd);
        let in_proj = MatRef::new(&p[lo.in_proj.clone()], 2 * e, d, d);
        gemm(
            MatRef::new(&la.xn, t, d, d),
            in_proj.t(),
            &mut la.xz,
            2 * e,
            Accum::Overwrite,
            panels,
        );
        conv::conv_weight_t(&p[lo.conv_w.clone()], e, k, &mut ws.conv_wt);
        conv::conv_silu_fwd(
            &la.xz,
            &ws.conv_wt,
            &p[lo.conv_b.clone()],
            dm.conv(),
            &mut la.xc,
            &mut la.u,
        );
        let x_proj = MatRef::new(&p[lo.x_proj.clone()], ld_bc, e, e);
        gemm(
            MatRef::new(&la.u, t, e, e),
            x_proj.t(),
            &mut la.dbc,
            ld_bc,
            Accum::Overwrite,
            panels,
        );
        // dtr = (dt_raw . W^T) + bias; dt = softplus(dtr).
        let dt_proj = MatRef::new(&p[lo.dt_proj_w.clone()], e, r, r);
        gemm(
            MatRef::new(&la.dbc, t, r, ld_bc),
            dt_proj.t(),
            &mut la.dtr,
            e,
            Accum::Overwrite,
            panels,
        );
        ops::bias_softplus(&mut la.dtr, &p[lo.dt_proj_b.clone()], &mut la.dt);
        let a = scan::a_blocks(&p[lo.a_log.clone()], dm.scan());
        scan::scan_fwd(
            &la.u,
            &la.dt,
            &la.dbc,
            &a,
            &p[lo.d.clone()],
            dm.scan(),
            &mut la.y,
        );
        ops::gate_fwd(&la.y, &la.xz, e, &mut la.g);
        // x_out = x_in + out_proj(g).
        let out_proj = MatRef::new(&p[lo.out_proj.clone()], d, e, e);
        gemm(
            MatRef::new(&la.g, t, e, e),
            out_proj.t(),
            x_out,
            d,
            Accum::Overwrite,
            panels,
        );
        ops::residual_add(x_out, x_in);
    }
    let x = &ws.xs[cfg.n_layer];
    ops::rmsnorm_fwd(x, &p[lay.norm_f.clone()], eps, &mut ws.xf, &mut ws.rstd_f);
    gemm(
        MatRef::new(&ws.xf, t, d, d),
        MatRef::new(emb, v, d, d).t(),
        &mut ws.logits,
        v,
        Accum::Overwrite,
        panels,
    );
}

/// Mean cross-entropy of the forward pass in `ws` (0 when no target counts).
pub(crate) fn loss<F: Float>(ws: &Workspace<F>, targets: &[i32], v: usize) -> f64 {
    let count = targets.iter().filter(|&&t| t >= 0).count();
    if count == 0 {
        return 0.0;
    }
    ops::cross_entropy(&ws.logits, targets, v, None) / count as f64
}

/// Backward pass after [`forward`] filled `ws`: overwrites every element of
/// `grads` with d(mean loss)/d params and returns the mean loss. `targets`
/// are validated (index or negative = ignored).
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward<F: Float>(
    cfg: &ModelConfig,
    lay: &ParamLayout,
    p: &[F],
    tokens: &[u32],
    targets: &[i32],
    nseq: usize,
    l: usize,
    ws: &mut Workspace<F>,
    grads: &mut [F],
) -> f64 {
    let dm = Dims::new(cfg, nseq, l);
    let Dims {
        t,
        d,
        e,
        r,
        k,
        v,
        ld_bc,
        ..
    } = dm;
    let count = targets.iter().filter(|&&t| t >= 0).count();
    if count == 0 {
        grads.fill(F::ZERO);
        return 0.0;
    }
    ws.size_backward(&dm);
    let emb = &p[lay.embedding.clone()];
    let panels = &mut ws.panels;
    // Head: logits = xf . emb^T.
    let loss = ops::cross_entropy(&ws.logits, targets, v, Some(&mut ws.dlogits)) / count as f64;
    let dlogits = MatRef::new(&ws.dlogits, t, v, v);
    gemm(
        dlogits.t(),
        MatRef::new(&ws.xf, t, d, d),
        &mut grads[lay.embedding.clone()],
        d,
        Accum::Overwrite,
        panels,
    );
    gemm(
        dlogits,
        MatRef::new(emb, v, d, d),
        &mut ws.dxf,
        d,
        Accum::Overwrite,
        panels,
    );
    let x_last = &ws.xs[cfg.n_layer];
    let gnf = &mut grads[lay.norm_f.clone()];
    ops::rmsnorm_bwd(
        &ws.dxf,
        x_last,
        &ws.rstd_f,
        &p[lay.norm_f.clone()],
        &mut ws.dx,
        false,
        gnf,
    );

    for (i, (lo, la)) in lay.layers.iter().zip(&ws.layers).enumerate().rev() {
        let x_in = &ws.xs[i];
        // Block output = x_in + out_proj(g): dx is d loss / d output.
        let dx = MatRef::new(&ws.dx, t, d, d);
        gemm(
            dx.t(),
            MatRef::new(&la.g, t, e, e),
            &mut grads[lo.out_proj.clone()],
            e,
            Accum::Overwrite,
            panels,
        );
        let out_proj = MatRef::new(&p[lo.out_proj.clone()], d, e, e);
        gemm(dx, out_proj, &mut ws.dg, e, Accum::Overwrite, panels);
        ops::gate_bwd(&ws.dg, &la.y, &la.xz, e, &mut ws.dy, &mut ws.dxz);
        let a = scan::a_blocks(&p[lo.a_log.clone()], dm.scan());
        let out = ScanGrads {
            du: &mut ws.du,
            ddt: &mut ws.ddt,
            dbc: &mut ws.ddbc,
            da_log: &mut ws.da_log,
            dd: &mut ws.dd,
        };
        scan::scan_bwd(
            &la.u,
            &la.dt,
            &la.dbc,
            &a,
            &p[lo.d.clone()],
            &ws.dy,
            dm.scan(),
            out,
        );
        grads[lo.a_log.clone()].copy_from_slice(&ws.da_log);
        grads[lo.d.clone()].copy_from_slice(&ws.dd);
        // dt = softplus(dtr): ddt becomes d loss / d dtr in place.
        ops::softplus_bwd(&mut ws.ddt, &la.dtr);
        ops::col_sum(&ws.ddt, &mut grads[lo.dt_proj_b.clone()]);
        let ddtr = MatRef::new(&ws.ddt, t, e, e);
        let dt_raw = MatRef::new(&la.dbc, t, r, ld_bc);
        gemm(
            ddtr.t(),
            dt_raw,
            &mut grads[lo.dt_proj_w.clone()],
            r,
            Accum::Overwrite,
            panels,
        );
        let dt_proj = MatRef::new(&p[lo.dt_proj_w.clone()], e, r, r);
        gemm(ddtr, dt_proj, &mut ws.ddbc, ld_bc, Accum::Overwrite, panels);
        // dbc = u . x_proj^T.
        let ddbc = MatRef::new(&ws.ddbc, t, ld_bc, ld_bc);
        gemm(
            ddbc.t(),
            MatRef::new(&la.u, t, e, e),
            &mut grads[lo.x_proj.clone()],
            e,
            Accum::Overwrite,
            panels,
        );
        let x_proj = MatRef::new(&p[lo.x_proj.clone()], ld_bc, e, e);
        gemm(ddbc, x_proj, &mut ws.du, e, Accum::Add, panels);
        // u = silu(xc): du becomes d loss / d xc in place.
        ops::silu_bwd(&mut ws.du, &la.xc);
        conv::conv_weight_t(&p[lo.conv_w.clone()], e, k, &mut ws.conv_wt);
        let (dcw, dcb) = two_mut(grads, lo.conv_w.clone(), lo.conv_b.clone());
        conv::conv_bwd(
            &ws.du,
            &la.xz,
            &ws.conv_wt,
            dm.conv(),
            &mut ws.dxz,
            dcw,
            dcb,
        );
        // xz = xn . in_proj^T.
        let dxz = MatRef::new(&ws.dxz, t, 2 * e, 2 * e);
        gemm(
            dxz.t(),
            MatRef::new(&la.xn, t, d, d),
            &mut grads[lo.in_proj.clone()],
            d,
            Accum::Overwrite,
            panels,
        );
        let in_proj = MatRef::new(&p[lo.in_proj.clone()], 2 * e, d, d);
        gemm(dxz, in_proj, &mut ws.dxn, d, Accum::Overwrite, panels);
        // xn = norm(x_in); the residual passes dx through unchanged.
        ops::rmsnorm_bwd(
            &ws.dxn,
            x_in,
            &la.rstd,
            &p[lo.norm.clone()],
            &mut ws.dx,
            true,
            &mut grads[lo.norm.clone()],
        );
    }
    // Embedding lookup: rows added in ascending token order after the head
    // gradient.
    let gemb = &mut grads[lay.embedding.clone()];
    for (i, &tok) in tokens.iter().enumerate() {
        let tok = tok as usize;
        for (gv, &xv) in gemb[tok * d..(tok + 1) * d]
            .iter_mut()
            .zip(&ws.dx[i * d..(i + 1) * d])
        {
            *gv = *gv + xv;
        }
    }
    loss
}

/// Two disjoint mutable sub-slices, `a` before `b`.
pub(super) fn two_mut<F>(
    s: &mut [F],
    a: std::ops::Range<usize>,
    b: std::ops::Range<usize>,
) -> (&mut [F], &mut [F]) {
    assert!(
        a.end <= b.start,
        "ranges {a:?} and {b:?} overlap or are out of order"
    );
    let (lo, hi) = s.split_at_mut(b.start);
    (&mut lo[a], &mut hi[..b.end - b.start])
}
