//! Recurrent decoding on the CPU: [`CpuDecoder`], the [`Decoder`] of the
//! f32 CPU model.
//!
//! A step is the forward pass of `net::forward` for one token, through the
//! same functions (`ops`, `gemm`) and in the same order, with the conv and
//! the scan reading their past from the [`DecodeState`] instead of from
//! earlier rows:
//! - conv: `acc = 0`, then `acc = acc + w[c,j] * x_{t+j-(k-1)}` for
//!   ascending `j` over the taps inside the sequence (the kept inputs for
//!   `j < k-1`, the new input for `j = k-1`), `xc = acc + bias`,
//!   `u = silu(xc)` — `conv::conv_silu_fwd`'s order;
//! - scan: `du = dt * u`; for ascending `n`: `abar = exp(dt * A)`,
//!   `h = abar * h + du * B`, `y = y + h * C`; then `y + D * u` —
//!   `scan::fwd_seq`'s order per lane.
//!
//! Matrix products are `gemm` with one row, whose every output is the same
//! ascending chain as with many rows. So the logits of a step are the bits
//! of the full forward pass at that position (pinned by
//! `tests/decode_parity.rs`), and the cost of a step does not depend on the
//! position.

use super::conv;
// `Float::exp` is the CPU model's fixed polynomial; f32's inherent `exp`
// (the system libm) would not give the forward pass's bits.
use super::float::Float;
use super::gemm::{gemm, Accum, MatRef};
use super::ops::{self, silu};
use crate::config::{ModelConfig, RMS_EPS};
use crate::error::Result;
use crate::model::decode::{check_token, DecodeState, Decoder};
use crate::params::ParamLayout;

/// The f32 CPU model decoding one sequence, token by token.
///
/// Owns a copy of the weights (so it outlives whatever it was built from),
/// the recurrent state, and one token's activations, reused by every step.
pub struct CpuDecoder {
    cfg: ModelConfig,
    layout: ParamLayout,
    params: Vec<f32>,
    /// Per layer: `A = -exp(A_log)`, `[d_inner, d_state]`.
    a: Vec<Vec<f32>>,
    /// Per layer: the conv weights transposed to `[d_conv, d_inner]`.
    conv_wt: Vec<Vec<f32>>,
    state: DecodeState,
    pos: u64,
    buf: StepBuffers,
}

/// One token's activations (each a single row of `net`'s buffers).
#[derive(Default)]
struct StepBuffers {
    x: Vec<f32>,
    x_next: Vec<f32>,
    xn: Vec<f32>,
    rstd: Vec<f32>,
    xz: Vec<f32>,
    u: Vec<f32>,
    dbc: Vec<f32>,
    dtr: Vec<f32>,
    dt: Vec<f32>,
    y: Vec<f32>,
    g: Vec<f32>,
    xf: Vec<f32>,
    logits: Vec<f32>,
    panels: Vec<f32>,
}

impl CpuDecoder {
    /// A decoder of the model `cfg` (validated) with weights `params` (of
    /// its layout's length), at position 0.
    pub fn new(cfg: ModelConfig, params: Vec<f32>) -> Result<Self> {
        cfg.validate()?;
        cfg.require_mamba1(
            "the recurrent decoder",
            "Mamba-2 decoding is not implemented in this build",
        )?;
        let layout = ParamLayout::new(&cfg);
        crate::model::check_arena_len(&cfg, &layout, "params arena", params.len())?;
        let (e, k) = (cfg.d_inner(), cfg.d_conv);
        let a = layout
            .layers
            .iter()
            .map(|lo| {
                params[lo.a_log.clone()]
                    .iter()
                    .map(|&v| -Float::exp(v))
                    .collect()
            })
            .collect();
        let conv_wt = layout
            .layers
            .iter()
            .map(|lo| {
                let mut wt = Vec::new();
                conv::conv_weight_t(&params[lo.conv_w.clone()], e, k, &mut wt);
                wt
            })
            .collect();
        let d = cfg.d_model;
        let buf = StepBuffers {
            x: vec![0.0; d],
            x_next: vec![0.0; d],
            xn: vec![0.0; d],
            rstd: vec![0.0; 1],
            xz: vec![0.0; 2 * e],
            u: vec![0.0; e],
            dbc: vec![0.0; cfg.dt_rank + 2 * cfg.d_state],
            dtr: vec![0.0; e],
            dt: vec![0.0; e],
            y: vec![0.0; e],
            g: vec![0.0; e],
            xf: vec![0.0; d],
            logits: vec![0.0; cfg.vocab_size],
            panels: Vec::new(),
        };
        Ok(CpuDecoder {
            state: DecodeState::zeros(&cfg),
            cfg,
            layout,
            params,
            a,
            conv_wt,
            pos: 0,
            buf,
        })
    }

    /// The weights it decodes with.
    pub fn params(&self) -> &[f32] {
        &self.params
    }
}

impl Decoder for CpuDecoder {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn device_name(&self) -> &'static str {
        "cpu"
    }

    fn reset(&mut self) -> Result<()> {
        self.state.conv.fill(0.0);
        self.state.ssm.fill(0.0);
        self.pos = 0;
        Ok(())
    }

    fn step(&mut self, token: u32) -> Result<&[f32]> {
        check_token(&self.cfg, token, self.pos)?;
        let CpuDecoder {
            cfg,
            layout: lay,
            params: p,
            a,
            conv_wt,
            state,
            pos,
            buf: b,
        } = self;
        let (d, e, n, r, k) = (
            cfg.d_model,
            cfg.d_inner(),
            cfg.d_state,
            cfg.dt_rank,
            cfg.d_conv,
        );
        let (v, ld_bc) = (cfg.vocab_size, r + 2 * n);
        let kk = k - 1;
        let emb = &p[lay.embedding.clone()];
        let tok = token as usize;
        b.x.copy_from_slice(&emb[tok * d..(tok + 1) * d]);
        // Rows of the conv state holding inputs of this sequence.
        let filled = (*pos).min(kk as u64) as usize;
        for (i, lo) in lay.layers.iter().enumerate() {
            ops::rmsnorm_fwd(&b.x, &p[lo.norm.clone()], RMS_EPS, &mut b.xn, &mut b.rstd);
            let in_proj = MatRef::new(&p[lo.in_proj.clone()], 2 * e, d, d);
            gemm(
                MatRef::new(&b.xn, 1, d, d),
                in_proj.t(),
                &mut b.xz,
                2 * e,
                Accum::Overwrite,
                &mut b.panels,
            );
            let conv_state = &mut state.conv[i * kk * e..(i + 1) * kk * e];
            conv_step(
                &b.xz[..e],
                &conv_wt[i],
                &p[lo.conv_b.clone()],
                conv_state,
                filled,
                &mut b.u,
            );
            let x_proj = MatRef::new(&p[lo.x_proj.clone()], ld_bc, e, e);
            gemm(
                MatRef::new(&b.u, 1, e, e),
                x_proj.t(),
                &mut b.dbc,
                ld_bc,
                Accum::Overwrite,
                &mut b.panels,
            );
            let dt_proj = MatRef::new(&p[lo.dt_proj_w.clone()], e, r, r);
            gemm(
                MatRef::new(&b.dbc, 1, r, ld_bc),
                dt_proj.t(),
                &mut b.dtr,
                e,
                Accum::Overwrite,
                &mut b.panels,
            );
            ops::bias_softplus(&mut b.dtr, &p[lo.dt_proj_b.clone()], &mut b.dt);
            let h = &mut state.ssm[i * e * n..(i + 1) * e * n];
            let (bt, ct) = (&b.dbc[r..r + n], &b.dbc[r + n..r + 2 * n]);
            scan_step(&b.u, &b.dt, bt, ct, &a[i], &p[lo.d.clone()], h, &mut b.y);
            ops::gate_fwd(&b.y, &b.xz, e, &mut b.g);
            let out_proj = MatRef::new(&p[lo.out_proj.clone()], d, e, e);
            gemm(
                MatRef::new(&b.g, 1, e, e),
                out_proj.t(),
                &mut b.x_next,
                d,
                Accum::Overwrite,
                &mut b.panels,
            );
            ops::residual_add(&mut b.x_next, &b.x);
            std::mem::swap(&mut b.x, &mut b.x_next);
        }
        ops::rmsnorm_fwd(
            &b.x,
            &p[lay.norm_f.clone()],
            RMS_EPS,
            &mut b.xf,
            &mut b.rstd,
        );
        gemm(
            MatRef::new(&b.xf, 1, d, d),
            MatRef::new(emb, v, d, d).t(),
            &mut b.logits,
            v,
            Accum::Overwrite,
            &mut b.panels,
        );
        *pos += 1;
        Ok(&b.logits)
    }

    fn position(&self) -> u64 {
        self.pos
    }

    fn snapshot(&mut self) -> Result<DecodeState> {
        Ok(self.state.clone())
    }

    fn restore(&mut self, state: &DecodeState, position: u64) -> Result<()> {
        state.check_shape(&self.cfg)?;
        self.state.clone_from(state);
        self.pos = position;
        Ok(())
    }
}

/// One conv step over every channel (module docs give the order): reads
/// the newest `filled` rows of `st` (`[k-1, e]`, oldest first) and the new
/// input `x`, writes `u`, then shifts `x` into `st`.
fn conv_step(x: &[f32], wt: &[f32], bias: &[f32], st: &mut [f32], filled: usize, u: &mut [f32]) {
    let e = x.len();
    let kk = st.len() / e.max(1);
    for c in 0..e {
        let mut acc = 0.0f32;
        for j in kk - filled..kk {
            acc += wt[j * e + c] * st[j * e + c];
        }
        acc += wt[kk * e + c] * x[c];
        u[c] = silu(acc + bias[c]);
    }
    if kk > 0 {
        st.copy_within(e.., 0);
        st[(kk - 1) * e..].copy_from_slice(x);
    }
}

/// One scan step over every channel (module docs give the order): `h`
/// (`[e, n]`) advances by one token, `y` gets `C.h + D u`.
#[allow(clippy::too_many_arguments)]
fn scan_step(
    u: &[f32],
    dt: &[f32],
    bt: &[f32],
    ct: &[f32],
    a: &[f32],
    dpar: &[f32],
    h: &mut [f32],
    y: &mut [f32],
) {
    let n = bt.len();
    for c in 0..u.len() {
        let du = dt[c] * u[c];
        let mut yv = 0.0f32;
        let hc = &mut h[c * n..(c + 1) * n];
        for s in 0..n {
            let abar = Float::exp(dt[c] * a[c * n + s]);
            hc[s] = abar * hc[s] + du * bt[s];
            yv += hc[s] * ct[s];
        }
        y[c] = yv + dpar[c] * u[c];
    }
}
