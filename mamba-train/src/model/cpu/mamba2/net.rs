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

use super::super::block::Ends;
use super::super::conv;
use super::super::float::Float;
use super::super::frame::{Blocks, Pass};
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
        let (cfg, lay, p, nseq) = (pass.cfg, pass.lay, pass.p, pass.nseq);
        let dm = Dims::new(cfg, nseq, pass.l);
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
            let ends = Ends::new(p, [&lo.norm, &lo.in_proj, &lo.out_proj], [t, d, w, e]);
            ends.enter(x_in, &mut la.xn, &mut la.rstd, &mut la.zx, panels);
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
            ends.leave(&la.gn, x_in, x_out, panels);
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
        let (cfg, lay, p, nseq) = (pass.cfg, pass.lay, pass.p, pass.nseq);
        let dm = Dims::new(cfg, nseq, pass.l);
        let Dims { t, d, e, w, .. } = dm;
        self.size_backward(&dm);
        for (i, (lo, la)) in lay.ssd_layers.iter().zip(&self.layers).enumerate().rev() {
            let x_in = &xs[i];
            // Block output = x_in + out_proj(gn).
            let ends = Ends::new(p, [&lo.norm, &lo.in_proj, &lo.out_proj], [t, d, w, e]);
            ends.leave_bwd(dx, &la.gn, grads, &mut self.dgn, panels);
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
            // zx = xn . in_proj^T, xn = norm(x_in).
            let (dzx, xn, rstd) = (&self.dzx, &la.xn, &la.rstd);
            ends.enter_bwd(dzx, xn, x_in, rstd, grads, &mut self.dxn, dx, panels);
        }
    }
}

/// `a[h] = -exp(A_log[h])`.
fn a_of<F: Float>(a_log: &[F], a: &mut [F]) {
    for (av, &lv) in a.iter_mut().zip(a_log) {
        *av = -lv.exp();
    }
}
