//! The two ends of a residual block, `x_out = x_in + out_proj(mixer(
//! in_proj(rmsnorm(x_in))))`, forward and backward, over `t` token rows:
//! what every architecture's block shares around its mixer. Used by both
//! training block stacks (`net`, `mamba2::net`) and both decode steps
//! (`decode`, `mamba2::decode`, with `t = 1`), so the four run the same
//! operations in the same order (one-row `gemm` gives every output the
//! same ascending chain as many rows, which keeps Mamba-1's decode bits
//! equal to its forward's).

use std::ops::Range;

use super::float::Float;
use super::gemm::{gemm, linear_bwd, Accum, MatRef};
use super::ops;
use crate::config::RMS_EPS;

/// One layer's ends: its `norm`, `in_proj` (`[w, d]`) and `out_proj`
/// (`[d, e]`) weights in the arena `p`, over `t` rows.
pub(crate) struct Ends<'a, F> {
    p: &'a [F],
    norm: Range<usize>,
    in_proj: Range<usize>,
    out_proj: Range<usize>,
    t: usize,
    d: usize,
    w: usize,
    e: usize,
}

impl<'a, F: Float> Ends<'a, F> {
    /// `ranges` = the layer's `[norm, in_proj, out_proj]`; `shape` = `[t
    /// rows, d_model, in_proj output width w, out_proj input width e]`.
    pub(crate) fn new(p: &'a [F], ranges: [&Range<usize>; 3], shape: [usize; 4]) -> Self {
        let [norm, in_proj, out_proj] = ranges.map(Range::clone);
        let [t, d, w, e] = shape;
        Ends {
            p,
            norm,
            in_proj,
            out_proj,
            t,
            d,
            w,
            e,
        }
    }

    /// `xn = rmsnorm(x_in) * norm` (keeping `rstd` per row), then
    /// `zx = xn . in_proj^T` (`[t, w]`).
    pub(crate) fn enter(
        &self,
        x_in: &[F],
        xn: &mut [F],
        rstd: &mut [F],
        zx: &mut [F],
        panels: &mut Vec<F>,
    ) {
        let (p, t, d, w) = (self.p, self.t, self.d, self.w);
        let eps = F::from_f64(RMS_EPS as f64);
        ops::rmsnorm_fwd(x_in, &p[self.norm.clone()], eps, xn, rstd);
        let in_proj = MatRef::new(&p[self.in_proj.clone()], w, d, d);
        let xn = MatRef::new(xn, t, d, d);
        gemm(xn, in_proj.t(), zx, w, Accum::Overwrite, panels);
    }

    /// `x_out = g . out_proj^T`, then `x_out + x_in` (the residual).
    pub(crate) fn leave(&self, g: &[F], x_in: &[F], x_out: &mut [F], panels: &mut Vec<F>) {
        let (p, t, d, e) = (self.p, self.t, self.d, self.e);
        let out_proj = MatRef::new(&p[self.out_proj.clone()], d, e, e);
        let g = MatRef::new(g, t, e, e);
        gemm(g, out_proj.t(), x_out, d, Accum::Overwrite, panels);
        ops::residual_add(x_out, x_in);
    }

    /// Backward of [`leave`](Self::leave), given `dx` = d loss / d `x_out`:
    /// overwrites out_proj's gradient in `grads` (`dx^T . g`) and `dg`
    /// (`dx . out_proj`).
    pub(crate) fn leave_bwd(
        &self,
        dx: &[F],
        g: &[F],
        grads: &mut [F],
        dg: &mut [F],
        panels: &mut Vec<F>,
    ) {
        let (p, t, d, e) = (self.p, self.t, self.d, self.e);
        let dx = MatRef::new(dx, t, d, d);
        let g = MatRef::new(g, t, e, e);
        let out_proj = MatRef::new(&p[self.out_proj.clone()], d, e, e);
        let gw = &mut grads[self.out_proj.clone()];
        linear_bwd(dx, g, out_proj, gw, dg, e, Accum::Overwrite, panels);
    }

    /// Backward of [`enter`](Self::enter), given `dzx` = d loss / d `zx`:
    /// overwrites in_proj's gradient (`dzx^T . xn`) and the norm's in
    /// `grads`, and adds d loss / d `x_in` through the norm to `dx` (which
    /// holds the residual's share already). `dxn` is scratch, `[t, d]`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn enter_bwd(
        &self,
        dzx: &[F],
        xn: &[F],
        x_in: &[F],
        rstd: &[F],
        grads: &mut [F],
        dxn: &mut [F],
        dx: &mut [F],
        panels: &mut Vec<F>,
    ) {
        let (p, t, d, w) = (self.p, self.t, self.d, self.w);
        let dzx = MatRef::new(dzx, t, w, w);
        let in_proj = MatRef::new(&p[self.in_proj.clone()], w, d, d);
        let gw = &mut grads[self.in_proj.clone()];
        let xn = MatRef::new(xn, t, d, d);
        linear_bwd(dzx, xn, in_proj, gw, dxn, d, Accum::Overwrite, panels);
        let (nw, gn) = (&p[self.norm.clone()], &mut grads[self.norm.clone()]);
        ops::rmsnorm_bwd(dxn, x_in, rstd, nw, dx, true, gn);
    }
}
