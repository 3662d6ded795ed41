//! The Mamba-2 block stack ([`Mamba2Acts`] as the frame's [`Blocks`]),
//! forward and backward, generic over [`Float`]; the embedding, final norm,
//! tied head and loss around it are the shared
//! [`frame`](super::super::frame), with the Mamba-1 reference's orders.
//!
//! Shapes (`T = batch * seq_len` tokens, token-major rows): residual `x`
//! `[T, d_model]`; `zx = in_proj(norm(x))` `[T, w]` holding z (`d_inner`),
//! then x, B, C (the conv's `cd = d_inner + 2 G N` channels), then dt_raw
//! (`H`); `xc` (conv output) and `u = silu(xc)` `[T, cd]`;
//! `dtr = dt_raw + dt_bias`, `dt = softplus(dtr)` `[T, H]`; `y` (SSD scan
//! with the D skip), `g = y * silu(z)`, `gn = rmsnorm(g) * norm.weight`
//! `[T, d_inner]`; block output `x + out_proj(gn)`. The matrix products,
//! norms, conv and activations are the Mamba-1 reference's functions. The
//! forward keeps every activation above per layer; the backward recomputes
//! the scan states.

use super::super::conv;
use super::super::float::Float;
use super::super::frame::{Blocks, Pass};
use super::super::gemm::{gemm, Accum, MatRef};
use super::super::host::Arch;
use super::super::net::two_mut;
use super::super::ops;
use super::acts::{Dims, Mamba2Acts};
use super::gate;
use super::ssd::{self, SsdGrads};
use crate::config::ModelConfig;
use crate::error::{Result, TrainError};

/// The Mamba-2 architecture, for the shared host model (`host::Net`).
pub(crate) struct Mamba2;

impl Arch for Mamba2 {
    type Stack<F: Float> = Mamba2Acts<F>;
    fn check(cfg: &ModelConfig) -> Result<()> {
        if cfg.ssd().is_none() {
            return Err(TrainError::Config(
                "Mamba2Model needs a Mamba-2 config (arch mamba2); this one is Mamba-1, \
                 which CpuModel runs"
                    .into(),
            ));
        }
        Ok(())
    }
}

impl<F: Float> Blocks<F> for Mamba2Acts<F> {
    fn forward(&mut self, pass: &Pass<'_, F>, xs: &mut [Vec<F>], panels: &mut Vec<F>) {
        let Pass {
            cfg,
            lay,
            p,
            nseq,
            l,
        } = *pass;
        let dm = Dims::new(cfg, nseq, l);
        let Dims { t, d, e, w, .. } = dm;
        self.size_forward(&dm, cfg.n_layer);
        let eps = pass.eps();
        for (i, (lo, la)) in lay
            .ssd_layers
            .iter()
            .zip(self.layers.iter_mut())
            .enumerate()
        {
            let (done, rest) = xs.split_at_mut(i + 1);
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
            conv::conv_weight_t(&p[lo.conv_w.clone()], dm.cd, dm.k(), &mut self.conv_wt);
            conv::conv_silu_fwd(
                &la.zx[e..],
                &self.conv_wt,
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
            a_of(&p[lo.a_log.clone()], &mut self.a);
            ssd::ssd_fwd(
                &la.u,
                &la.dt,
                &self.a,
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
    }

    fn backward(
        &mut self,
        pass: &Pass<'_, F>,
        xs: &[Vec<F>],
        dx: &mut [F],
        grads: &mut [F],
        panels: &mut Vec<F>,
    ) {
        let Pass {
            cfg,
            lay,
            p,
            nseq,
            l,
        } = *pass;
        let dm = Dims::new(cfg, nseq, l);
        let Dims { t, d, e, w, .. } = dm;
        self.size_backward(&dm);
        for (i, (lo, la)) in lay.ssd_layers.iter().zip(&self.layers).enumerate().rev() {
            let x_in = &xs[i];
            // Block output = x_in + out_proj(gn).
            let dxm = MatRef::new(dx, t, d, d);
            gemm(
                dxm.t(),
                MatRef::new(&la.gn, t, e, e),
                &mut grads[lo.out_proj.clone()],
                e,
                Accum::Overwrite,
                panels,
            );
            let out_proj = MatRef::new(&p[lo.out_proj.clone()], d, e, e);
            gemm(dxm, out_proj, &mut self.dgn, e, Accum::Overwrite, panels);
            ops::rmsnorm_bwd(
                &self.dgn,
                &la.g,
                &la.rstd_g,
                &p[lo.norm_gated.clone()],
                &mut self.dg,
                false,
                &mut grads[lo.norm_gated.clone()],
            );
            gate::gate_bwd(&self.dg, &la.y, &la.zx, e, w, &mut self.dy, &mut self.dzx);
            a_of(&p[lo.a_log.clone()], &mut self.a);
            ssd::ssd_bwd(
                &la.u,
                &la.dt,
                &self.a,
                &p[lo.d.clone()],
                &self.dy,
                dm.ssd(),
                nseq,
                SsdGrads {
                    du: &mut self.du,
                    ddt: &mut self.ddt,
                    da_log: &mut self.da_log,
                    dd: &mut self.dd,
                },
            );
            grads[lo.a_log.clone()].copy_from_slice(&self.da_log);
            grads[lo.d.clone()].copy_from_slice(&self.dd);
            // dt = softplus(dtr): ddt becomes d loss / d dtr, which is also
            // d loss / d dt_raw (the dt columns of the in_proj output).
            ops::softplus_bwd(&mut self.ddt, &la.dtr);
            ops::col_sum(&self.ddt, &mut grads[lo.dt_bias.clone()]);
            let dt0 = e + dm.cd;
            for (row, g) in self
                .dzx
                .chunks_exact_mut(w)
                .zip(self.ddt.chunks_exact(dm.h))
            {
                row[dt0..].copy_from_slice(g);
            }
            // u = silu(xc), then the conv writes the x, B, C columns.
            ops::silu_bwd(&mut self.du, &la.xc);
            conv::conv_weight_t(&p[lo.conv_w.clone()], dm.cd, dm.k(), &mut self.conv_wt);
            let (dcw, dcb) = two_mut(grads, lo.conv_w.clone(), lo.conv_b.clone());
            conv::conv_bwd(
                &self.du,
                &la.zx[e..],
                &self.conv_wt,
                dm.conv(),
                &mut self.dzx[e..],
                dcw,
                dcb,
            );
            // zx = xn . in_proj^T.
            let dzx = MatRef::new(&self.dzx, t, w, w);
            gemm(
                dzx.t(),
                MatRef::new(&la.xn, t, d, d),
                &mut grads[lo.in_proj.clone()],
                d,
                Accum::Overwrite,
                panels,
            );
            let in_proj = MatRef::new(&p[lo.in_proj.clone()], w, d, d);
            gemm(dzx, in_proj, &mut self.dxn, d, Accum::Overwrite, panels);
            ops::rmsnorm_bwd(
                &self.dxn,
                x_in,
                &la.rstd,
                &p[lo.norm.clone()],
                dx,
                true,
                &mut grads[lo.norm.clone()],
            );
        }
    }
}

/// `a[h] = -exp(A_log[h])`.
fn a_of<F: Float>(a_log: &[F], a: &mut [F]) {
    for (av, &lv) in a.iter_mut().zip(a_log) {
        *av = -lv.exp();
    }
}
