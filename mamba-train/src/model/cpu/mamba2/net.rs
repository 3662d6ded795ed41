//! The Mamba-2 network, forward and backward, generic over [`Float`].
//!
//! Shapes (`T = batch * seq_len` tokens, token-major rows): residual `x`
//! `[T, d_model]`; `zx = in_proj(norm(x))` `[T, w]` holding z (`d_inner`),
//! then x, B, C (the conv's `cd = d_inner + 2 G N` channels), then dt_raw
//! (`H`); `xc` (conv output) and `u = silu(xc)` `[T, cd]`;
//! `dtr = dt_raw + dt_bias`, `dt = softplus(dtr)` `[T, H]`; `y` (SSD scan
//! with the D skip), `g = y * silu(z)`, `gn = rmsnorm(g) * norm.weight`
//! `[T, d_inner]`; block output `x + out_proj(gn)`. The embedding, the final
//! norm, the tied head and the loss are the Mamba-1 reference's, with its
//! orders ([`super::super::net`]); so are the matrix products, norms, conv
//! and activations, which this module calls rather than re-implements. The
//! forward keeps every activation above per layer; the backward recomputes
//! the scan states.

use rayon::prelude::*;

use super::super::conv;
use super::super::float::Float;
use super::super::gemm::{gemm, Accum, MatRef};
use super::super::net::two_mut;
use super::super::ops::{self, TOK_CHUNK};
use super::gate;
use super::ssd::{self, SsdGrads};
use super::workspace::{Dims, Workspace};
use crate::config::{ModelConfig, RMS_EPS};
use crate::params::ParamLayout;

/// Forward pass over `tokens` (`nseq` sequences of `l`; ids validated;
/// `nseq * l > 0`) into `ws`.
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
    let Dims { t, d, e, w, v, .. } = dm;
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
    for (i, (lo, la)) in lay.ssd_layers.iter().zip(ws.layers.iter_mut()).enumerate() {
        let (done, rest) = ws.xs.split_at_mut(i + 1);
        let (x_in, x_out) = (&done[i], &mut rest[0]);
        ops::rmsnorm_fwd(x_in, &p[lo.norm.clone()], eps, &mut la.xn, &mut la.rstd);
        let in_proj = MatRef::new(&p[lo.in_proj.clone()], w, d, d);
        gemm(
            MatRef::new(&la.xn, t, d, d),
            in_proj.t(),
            &mut la.zx,
            w,
            Accum::Overwrite,
            panels,
        );
        conv::conv_weight_t(&p[lo.conv_w.clone()], dm.cd, dm.k(), &mut ws.conv_wt);
        conv::conv_silu_fwd(
            &la.zx[e..],
            &ws.conv_wt,
            &p[lo.conv_b.clone()],
            dm.conv(),
            &mut la.xc,
            &mut la.u,
        );
        // dtr = dt_raw + dt_bias; dt = softplus(dtr).
        let dt0 = e + dm.cd;
        for (row, zrow) in la.dtr.chunks_exact_mut(dm.h).zip(la.zx.chunks_exact(w)) {
            row.copy_from_slice(&zrow[dt0..]);
        }
        ops::bias_softplus(&mut la.dtr, &p[lo.dt_bias.clone()], &mut la.dt);
        a_of(&p[lo.a_log.clone()], &mut ws.a);
        ssd::ssd_fwd(
            &la.u,
            &la.dt,
            &ws.a,
            &p[lo.d.clone()],
            dm.ssd(),
            nseq,
            &mut la.y,
        );
        gate::gate_fwd(&la.y, &la.zx, e, w, &mut la.g);
        ops::rmsnorm_fwd(
            &la.g,
            &p[lo.norm_gated.clone()],
            eps,
            &mut la.gn,
            &mut la.rstd_g,
        );
        let out_proj = MatRef::new(&p[lo.out_proj.clone()], d, e, e);
        gemm(
            MatRef::new(&la.gn, t, e, e),
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

/// `a[h] = -exp(A_log[h])`.
fn a_of<F: Float>(a_log: &[F], a: &mut [F]) {
    for (av, &lv) in a.iter_mut().zip(a_log) {
        *av = -lv.exp();
    }
}

/// Backward pass after [`forward`] filled `ws`: overwrites every element of
/// `grads` with d(mean loss)/d params and returns the mean loss.
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
    let Dims { t, d, e, w, v, .. } = dm;
    let count = targets.iter().filter(|&&t| t >= 0).count();
    if count == 0 {
        grads.fill(F::ZERO);
        return 0.0;
    }
    ws.size_backward(&dm);
    let emb = &p[lay.embedding.clone()];
    let panels = &mut ws.panels;
    // Head: logits = xf . emb^T (as the Mamba-1 reference).
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
    ops::rmsnorm_bwd(
        &ws.dxf,
        &ws.xs[cfg.n_layer],
        &ws.rstd_f,
        &p[lay.norm_f.clone()],
        &mut ws.dx,
        false,
        &mut grads[lay.norm_f.clone()],
    );

    for (i, (lo, la)) in lay.ssd_layers.iter().zip(&ws.layers).enumerate().rev() {
        let x_in = &ws.xs[i];
        // Block output = x_in + out_proj(gn).
        let dx = MatRef::new(&ws.dx, t, d, d);
        gemm(
            dx.t(),
            MatRef::new(&la.gn, t, e, e),
            &mut grads[lo.out_proj.clone()],
            e,
            Accum::Overwrite,
            panels,
        );
        let out_proj = MatRef::new(&p[lo.out_proj.clone()], d, e, e);
        gemm(dx, out_proj, &mut ws.dgn, e, Accum::Overwrite, panels);
        ops::rmsnorm_bwd(
            &ws.dgn,
            &la.g,
            &la.rstd_g,
            &p[lo.norm_gated.clone()],
            &mut ws.dg,
            false,
            &mut grads[lo.norm_gated.clone()],
        );
        gate::gate_bwd(&ws.dg, &la.y, &la.zx, e, w, &mut ws.dy, &mut ws.dzx);
        a_of(&p[lo.a_log.clone()], &mut ws.a);
        ssd::ssd_bwd(
            &la.u,
            &la.dt,
            &ws.a,
            &p[lo.d.clone()],
            &ws.dy,
            dm.ssd(),
            nseq,
            SsdGrads {
                du: &mut ws.du,
                ddt: &mut ws.ddt,
                da_log: &mut ws.da_log,
                dd: &mut ws.dd,
            },
        );
        grads[lo.a_log.clone()].copy_from_slice(&ws.da_log);
        grads[lo.d.clone()].copy_from_slice(&ws.dd);
        // dt = softplus(dtr): ddt becomes d loss / d dtr, which is also
        // d loss / d dt_raw (the dt columns of the in_proj output).
        ops::softplus_bwd(&mut ws.ddt, &la.dtr);
        ops::col_sum(&ws.ddt, &mut grads[lo.dt_bias.clone()]);
        let dt0 = e + dm.cd;
        for (row, g) in ws.dzx.chunks_exact_mut(w).zip(ws.ddt.chunks_exact(dm.h)) {
            row[dt0..].copy_from_slice(g);
        }
        // u = silu(xc), then the conv writes the x, B, C columns.
        ops::silu_bwd(&mut ws.du, &la.xc);
        conv::conv_weight_t(&p[lo.conv_w.clone()], dm.cd, dm.k(), &mut ws.conv_wt);
        let (dcw, dcb) = two_mut(grads, lo.conv_w.clone(), lo.conv_b.clone());
        conv::conv_bwd(
            &ws.du,
            &la.zx[e..],
            &ws.conv_wt,
            dm.conv(),
            &mut ws.dzx[e..],
            dcw,
            dcb,
        );
        // zx = xn . in_proj^T.
        let dzx = MatRef::new(&ws.dzx, t, w, w);
        gemm(
            dzx.t(),
            MatRef::new(&la.xn, t, d, d),
            &mut grads[lo.in_proj.clone()],
            d,
            Accum::Overwrite,
            panels,
        );
        let in_proj = MatRef::new(&p[lo.in_proj.clone()], w, d, d);
        gemm(dzx, in_proj, &mut ws.dxn, d, Accum::Overwrite, panels);
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
    // gradient (as the Mamba-1 reference).
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
