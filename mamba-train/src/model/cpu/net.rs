//! The Mamba-1 block stack ([`Mamba1Acts`] as the frame's [`Blocks`]),
//! forward and backward, generic over [`Float`]; the embedding, final norm,
//! tied head and loss around it are the shared [`frame`](super::frame).
//!
//! Shapes (`T = batch * seq_len` tokens, row-major, token-major):
//! residual `x` `[T, d_model]`; `xz = in_proj(norm(x))` `[T, 2*d_inner]`
//! (x half then z half); `xc` (conv output), `u = silu(xc)`, `dtr`
//! (pre-softplus), `dt`, `y` (scan output with the D skip), `g = y * silu(z)`
//! all `[T, d_inner]`; `dbc = x_proj(u)` `[T, dt_rank + 2*d_state]` holding
//! dt_raw, B, C in that order. The forward keeps every one of these per
//! layer (in [`Mamba1Acts`]) for the backward; the scan states are
//! recomputed there.

use super::acts::{Dims, Mamba1Acts};
use super::block::Ends;
use super::conv;
use super::float::Float;
use super::frame::{Blocks, Pass};
use super::gemm::{gemm, linear_bwd, Accum, MatRef};
use super::host::Arch;
use super::ops;
use super::scan::{self, ScanGrads};
use crate::config::ModelConfig;
use crate::error::Result;

/// The Mamba-1 architecture, for the shared host model (`host::Net`).
pub(crate) struct Mamba1;

impl Arch for Mamba1 {
    type Stack<F: Float> = Mamba1Acts<F>;
    fn check(cfg: &ModelConfig) -> Result<()> {
        cfg.require_mamba1("CpuModel", "use mamba2::Mamba2Model")
    }
}

impl<F: Float> Blocks<F> for Mamba1Acts<F> {
    fn forward(&mut self, pass: &Pass<'_, F>, xs: &mut [Vec<F>], panels: &mut Vec<F>) {
        let (cfg, lay, p) = (pass.cfg, pass.lay, pass.p);
        let dm = Dims::new(cfg, pass.nseq, pass.l);
        let Dims {
            t,
            d,
            e,
            r,
            k,
            ld_bc,
            ..
        } = dm;
        self.size_forward(&dm, cfg.n_layer);
        for (i, (lo, la)) in lay.layers.iter().zip(self.layers.iter_mut()).enumerate() {
            let (done, rest) = xs.split_at_mut(i + 1);
            let (x_in, x_out) = (&done[i], &mut rest[0]);
            let ends = Ends::new(p, [&lo.norm, &lo.in_proj, &lo.out_proj], [t, d, 2 * e, e]);
            ends.enter(x_in, &mut la.xn, &mut la.rstd, &mut la.xz, panels);
            conv::conv_weight_t(&p[lo.conv_w.clone()], e, k, &mut self.conv_wt);
            conv::conv_silu_fwd(
                &la.xz,
                &self.conv_wt,
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
            ends.leave(&la.g, x_in, x_out, panels);
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
        let (cfg, lay, p) = (pass.cfg, pass.lay, pass.p);
        let dm = Dims::new(cfg, pass.nseq, pass.l);
        let Dims {
            t,
            d,
            e,
            r,
            k,
            ld_bc,
            ..
        } = dm;
        self.size_backward(&dm);
        for (i, (lo, la)) in lay.layers.iter().zip(&self.layers).enumerate().rev() {
            let x_in = &xs[i];
            // Block output = x_in + out_proj(g): dx is d loss / d output.
            let ends = Ends::new(p, [&lo.norm, &lo.in_proj, &lo.out_proj], [t, d, 2 * e, e]);
            ends.leave_bwd(dx, &la.g, grads, &mut self.dg, panels);
            ops::gate_bwd(&self.dg, &la.y, &la.xz, e, &mut self.dy, &mut self.dxz);
            let a = scan::a_blocks(&p[lo.a_log.clone()], dm.scan());
            let out = ScanGrads {
                du: &mut self.du,
                ddt: &mut self.ddt,
                dbc: &mut self.ddbc,
                da_log: &mut self.da_log,
                dd: &mut self.dd,
            };
            scan::scan_bwd(
                &la.u,
                &la.dt,
                &la.dbc,
                &a,
                &p[lo.d.clone()],
                &self.dy,
                dm.scan(),
                out,
            );
            grads[lo.a_log.clone()].copy_from_slice(&self.da_log);
            grads[lo.d.clone()].copy_from_slice(&self.dd);
            // dt = softplus(dtr): ddt becomes d loss / d dtr in place.
            ops::softplus_bwd(&mut self.ddt, &la.dtr);
            ops::col_sum(&self.ddt, &mut grads[lo.dt_proj_b.clone()]);
            // dtr = dt_raw . dt_proj^T (dt_raw: the first r columns of dbc).
            linear_bwd(
                MatRef::new(&self.ddt, t, e, e),
                MatRef::new(&la.dbc, t, r, ld_bc),
                MatRef::new(&p[lo.dt_proj_w.clone()], e, r, r),
                &mut grads[lo.dt_proj_w.clone()],
                &mut self.ddbc,
                ld_bc,
                Accum::Overwrite,
                panels,
            );
            // dbc = u . x_proj^T; du gets its share added.
            linear_bwd(
                MatRef::new(&self.ddbc, t, ld_bc, ld_bc),
                MatRef::new(&la.u, t, e, e),
                MatRef::new(&p[lo.x_proj.clone()], ld_bc, e, e),
                &mut grads[lo.x_proj.clone()],
                &mut self.du,
                e,
                Accum::Add,
                panels,
            );
            // u = silu(xc): du becomes d loss / d xc in place.
            ops::silu_bwd(&mut self.du, &la.xc);
            conv::conv_weight_t(&p[lo.conv_w.clone()], e, k, &mut self.conv_wt);
            let (dcw, dcb) = two_mut(grads, lo.conv_w.clone(), lo.conv_b.clone());
            conv::conv_bwd(
                &self.du,
                &la.xz,
                &self.conv_wt,
                dm.conv(),
                &mut self.dxz,
                dcw,
                dcb,
            );
            // xz = xn . in_proj^T, xn = norm(x_in); the residual passes dx
            // through unchanged.
            let (dxz, xn, rstd) = (&self.dxz, &la.xn, &la.rstd);
            ends.enter_bwd(dxz, xn, x_in, rstd, grads, &mut self.dxn, dx, panels);
        }
    }
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
