//! The Mamba-2 blocks for one token ([`Mamba2Step`]), the architecture's
//! part of recurrent decoding (the shared frame is `recurrent`;
//! [`CpuDecoder`](super::super::CpuDecoder) builds it for a Mamba-2 config).
//!
//! Per layer, the state is the conv window over x, B, C (the last
//! `d_conv - 1` rows of the conv's `cd = d_inner + 2 G N` channels, oldest
//! first) and the SSM state `[H, P, N]`. A step: RMSNorm, in_proj to
//! (z, x, B, C, dt_raw); conv over the kept window and the new row, + bias,
//! SiLU; `dt = softplus(dt_raw + dt_bias)`; per head `h` (its group's B, C):
//! `H = exp(dt A) H + (dt x) B^T`, `y = H C + D x`; gated RMSNorm
//! `rmsnorm(y * silu(z))`; out_proj; residual.
//!
//! The orders: the norms, matrix products (one-row `gemm`), conv, softplus
//! and gate are the training forward's functions in its order; the scan is
//! the sequential recurrence in the order of `ssd::ssd_naive` (ascending
//! `n` in the update and in `H C`). The training forward's chunked SSD
//! computes the same sums reassociated, so the step's logits equal the
//! forward's to rounding, not bit for bit (`tests/mamba2_decode.rs` states
//! the tolerances).

use super::super::block::Ends;
use super::super::conv;
use super::super::float::Float;
use super::super::ops;
use super::super::recurrent::{a_of, conv_step, StepBlocks, StepState};
use super::gate;
use crate::config::{ModelConfig, SsdConfig, RMS_EPS};
use crate::params::ParamLayout;

/// Shapes of one Mamba-2 layer: `e = H P`, conv channels `cd`, in_proj row
/// width `w = e + cd + H`.
#[derive(Clone, Copy)]
struct Shape {
    d: usize,
    e: usize,
    h: usize,
    p: usize,
    n: usize,
    g: usize,
    cd: usize,
    w: usize,
    kk: usize,
}

/// The Mamba-2 blocks for one token: per layer `A = -exp(A_log)` (`[H]`)
/// and the conv weights transposed to `[d_conv, cd]`, computed once; one
/// token's activations.
pub(crate) struct Mamba2Step<F> {
    s: Shape,
    a: Vec<Vec<F>>,
    conv_wt: Vec<Vec<F>>,
    x_next: Vec<F>,
    xn: Vec<F>,
    rstd: Vec<F>,
    zx: Vec<F>,
    u: Vec<F>,
    dtr: Vec<F>,
    dt: Vec<F>,
    y: Vec<F>,
    g: Vec<F>,
    gn: Vec<F>,
}

impl<F: Float> Mamba2Step<F> {
    /// `cfg` must be a validated Mamba-2 config and `p` of its layout.
    pub(crate) fn new(cfg: &ModelConfig, lay: &ParamLayout, p: &[F]) -> Self {
        let ssd = cfg.ssd().copied().unwrap_or(SsdConfig::DEFAULT);
        let (e, h, n, g) = (cfg.d_inner(), cfg.num_heads(), cfg.d_state, ssd.n_groups);
        let cd = e + 2 * g * n;
        let s = Shape {
            d: cfg.d_model,
            e,
            h,
            p: ssd.head_dim,
            n,
            g,
            cd,
            w: e + cd + h,
            kk: cfg.d_conv - 1,
        };
        let layers = &lay.ssd_layers;
        let a = layers.iter().map(|lo| a_of(&p[lo.a_log.clone()])).collect();
        let conv_wt = layers
            .iter()
            .map(|lo| {
                let mut wt = Vec::new();
                conv::conv_weight_t(&p[lo.conv_w.clone()], cd, cfg.d_conv, &mut wt);
                wt
            })
            .collect();
        let z = |len: usize| vec![F::ZERO; len];
        Mamba2Step {
            a,
            conv_wt,
            x_next: z(s.d),
            xn: z(s.d),
            rstd: z(1),
            zx: z(s.w),
            u: z(cd),
            dtr: z(h),
            dt: z(h),
            y: z(e),
            g: z(e),
            gn: z(e),
            s,
        }
    }
}

impl<F: Float> StepBlocks<F> for Mamba2Step<F> {
    fn step(&mut self, lay: &ParamLayout, p: &[F], st: StepState<'_, F>, panels: &mut Vec<F>) {
        let Shape {
            d, e, cd, w, kk, ..
        } = self.s;
        let eps = F::from_f64(RMS_EPS as f64);
        for (i, lo) in lay.ssd_layers.iter().enumerate() {
            let ends = Ends::new(p, [&lo.norm, &lo.in_proj, &lo.out_proj], [1, d, w, e]);
            ends.enter(st.x, &mut self.xn, &mut self.rstd, &mut self.zx, panels);
            conv_step(
                &self.zx[e..e + cd],
                &self.conv_wt[i],
                &p[lo.conv_b.clone()],
                &mut st.conv[i * kk * cd..(i + 1) * kk * cd],
                st.filled,
                &mut self.u,
            );
            self.dtr.copy_from_slice(&self.zx[e + cd..]);
            ops::bias_softplus(&mut self.dtr, &p[lo.dt_bias.clone()], &mut self.dt);
            let hs = &mut st.ssm[i * e * self.s.n..(i + 1) * e * self.s.n];
            ssd_step(
                self.s,
                &self.u,
                &self.dt,
                &self.a[i],
                &p[lo.d.clone()],
                hs,
                &mut self.y,
            );
            gate::gate_fwd(&self.y, &self.zx, e, w, &mut self.g);
            let nw = &p[lo.norm_gated.clone()];
            ops::rmsnorm_fwd(&self.g, nw, eps, &mut self.gn, &mut self.rstd);
            ends.leave(&self.gn, st.x, &mut self.x_next, panels);
            std::mem::swap(st.x, &mut self.x_next);
        }
    }
}

/// One SSD step of one layer: for every head `hh` (group `hh / (H / G)`),
/// `decay = exp(dt A)`, then per channel `pi`: `dx = dt * x[pi]`,
/// `H[pi][n] = decay * H[pi][n] + dx * B[n]` for ascending `n`,
/// `y[pi] = (sum_n H[pi][n] * C[n], ascending from 0) + D * x[pi]` — the
/// sequential oracle's order. `u` is the conv output row (x, B, C); `st`
/// is `[H, P, N]`.
fn ssd_step<F: Float>(s: Shape, u: &[F], dt: &[F], a: &[F], dpar: &[F], st: &mut [F], y: &mut [F]) {
    let (p, n) = (s.p, s.n);
    let heads_per_group = s.h / s.g;
    for hh in 0..s.h {
        let grp = hh / heads_per_group;
        let b = &u[s.e + grp * n..s.e + (grp + 1) * n];
        let c = &u[s.e + (s.g + grp) * n..s.e + (s.g + grp + 1) * n];
        let decay = (dt[hh] * a[hh]).exp();
        for pi in 0..p {
            let xv = u[hh * p + pi];
            let dx = dt[hh] * xv;
            let hs = &mut st[(hh * p + pi) * n..(hh * p + pi + 1) * n];
            let mut acc = F::ZERO;
            for (ni, sv) in hs.iter_mut().enumerate() {
                *sv = decay * *sv + dx * b[ni];
                acc = acc + *sv * c[ni];
            }
            y[hh * p + pi] = acc + dpar[hh] * xv;
        }
    }
}
