//! Recurrent decoding on the CPU: [`CpuDecoder`], the [`Decoder`] of the
//! f32 CPU models of both architectures (the shared frame is
//! `recurrent`), and the Mamba-1 block step (`Mamba1Step`).
//!
//! A Mamba-1 step is the forward pass of `net` for one token, through the
//! same functions (`ops`, `gemm`, `block`) and in the same order, with the conv and
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

use super::block::Ends;
use super::conv;
// `Float::exp` is the CPU model's fixed polynomial; f32's inherent `exp`
// (the system libm) would not give the forward pass's bits.
use super::float::Float;
use super::gemm::{gemm, Accum, MatRef};
use super::mamba2::decode::Mamba2Step;
use super::ops;
use super::recurrent::{a_of, conv_step, Recurrent, StepBlocks, StepState};
use crate::config::{Arch, ModelConfig};
use crate::error::Result;
use crate::model::decode::{DecodeState, Decoder};
use crate::params::ParamLayout;

/// The f32 CPU model decoding one sequence, token by token, for either
/// architecture (Mamba-1 or Mamba-2, from the config).
///
/// Owns a copy of the weights (so it outlives whatever it was built from),
/// the recurrent state, and one token's activations, reused by every step.
pub struct CpuDecoder(Recurrent<f32>);

impl CpuDecoder {
    /// A decoder of the model `cfg` (validated, Mamba-1 or Mamba-2) with
    /// weights `params` (of its layout's length), at position 0.
    pub fn new(cfg: ModelConfig, params: Vec<f32>) -> Result<Self> {
        recurrent(cfg, params).map(CpuDecoder)
    }

    /// The weights it decodes with.
    pub fn params(&self) -> &[f32] {
        &self.0.params
    }
}

/// The recurrent decoder of `cfg`'s architecture in `F`.
pub(crate) fn recurrent<F: Float>(cfg: ModelConfig, params: Vec<F>) -> Result<Recurrent<F>> {
    Recurrent::new(cfg, params, |cfg, lay, p| match cfg.arch {
        Arch::Mamba1 => Box::new(Mamba1Step::new(cfg, lay, p)) as Box<dyn StepBlocks<F>>,
        Arch::Mamba2(_) => Box::new(Mamba2Step::new(cfg, lay, p)),
    })
}

impl Decoder for CpuDecoder {
    fn config(&self) -> &ModelConfig {
        &self.0.cfg
    }

    fn device_name(&self) -> &'static str {
        "cpu"
    }

    fn reset(&mut self) -> Result<()> {
        self.0.reset();
        Ok(())
    }

    fn step(&mut self, token: u32) -> Result<&[f32]> {
        self.0.step(token)
    }

    fn position(&self) -> u64 {
        self.0.pos
    }

    fn snapshot(&mut self) -> Result<DecodeState> {
        Ok(DecodeState {
            conv: self.0.conv.clone(),
            ssm: self.0.ssm.clone(),
        })
    }

    fn restore(&mut self, state: &DecodeState, position: u64) -> Result<()> {
        state.check_shape(&self.0.cfg)?;
        self.0.conv.copy_from_slice(&state.conv);
        self.0.ssm.copy_from_slice(&state.ssm);
        self.0.pos = position;
        Ok(())
    }
}

/// The Mamba-1 blocks for one token: per layer `A = -exp(A_log)`
/// (`[d_inner, d_state]`) and the conv weights transposed to
/// `[d_conv, d_inner]`, computed once; one token's activations.
struct Mamba1Step<F> {
    cfg: ModelConfig,
    a: Vec<Vec<F>>,
    conv_wt: Vec<Vec<F>>,
    b: Row<F>,
}

/// One token's activations (each a single row of `net`'s buffers).
struct Row<F> {
    x_next: Vec<F>,
    xn: Vec<F>,
    rstd: Vec<F>,
    xz: Vec<F>,
    u: Vec<F>,
    dbc: Vec<F>,
    dtr: Vec<F>,
    dt: Vec<F>,
    y: Vec<F>,
    g: Vec<F>,
}

impl<F: Float> Mamba1Step<F> {
    fn new(cfg: &ModelConfig, lay: &ParamLayout, p: &[F]) -> Self {
        let (d, e, k) = (cfg.d_model, cfg.d_inner(), cfg.d_conv);
        let a = lay
            .layers
            .iter()
            .map(|lo| a_of(&p[lo.a_log.clone()]))
            .collect();
        let conv_wt = lay
            .layers
            .iter()
            .map(|lo| {
                let mut wt = Vec::new();
                conv::conv_weight_t(&p[lo.conv_w.clone()], e, k, &mut wt);
                wt
            })
            .collect();
        let z = |n: usize| vec![F::ZERO; n];
        let b = Row {
            x_next: z(d),
            xn: z(d),
            rstd: z(1),
            xz: z(2 * e),
            u: z(e),
            dbc: z(cfg.dt_rank + 2 * cfg.d_state),
            dtr: z(e),
            dt: z(e),
            y: z(e),
            g: z(e),
        };
        Mamba1Step {
            cfg: cfg.clone(),
            a,
            conv_wt,
            b,
        }
    }
}

impl<F: Float> StepBlocks<F> for Mamba1Step<F> {
    fn step(&mut self, lay: &ParamLayout, p: &[F], st: StepState<'_, F>, panels: &mut Vec<F>) {
        let Mamba1Step { cfg, a, conv_wt, b } = self;
        let (d, e, n, r, k) = (
            cfg.d_model,
            cfg.d_inner(),
            cfg.d_state,
            cfg.dt_rank,
            cfg.d_conv,
        );
        let (ld_bc, kk) = (r + 2 * n, k - 1);
        for (i, lo) in lay.layers.iter().enumerate() {
            let ends = Ends::new(p, [&lo.norm, &lo.in_proj, &lo.out_proj], [1, d, 2 * e, e]);
            ends.enter(st.x, &mut b.xn, &mut b.rstd, &mut b.xz, panels);
            let conv_state = &mut st.conv[i * kk * e..(i + 1) * kk * e];
            conv_step(
                &b.xz[..e],
                &conv_wt[i],
                &p[lo.conv_b.clone()],
                conv_state,
                st.filled,
                &mut b.u,
            );
            let x_proj = MatRef::new(&p[lo.x_proj.clone()], ld_bc, e, e);
            gemm(
                MatRef::new(&b.u, 1, e, e),
                x_proj.t(),
                &mut b.dbc,
                ld_bc,
                Accum::Overwrite,
                panels,
            );
            let dt_proj = MatRef::new(&p[lo.dt_proj_w.clone()], e, r, r);
            gemm(
                MatRef::new(&b.dbc, 1, r, ld_bc),
                dt_proj.t(),
                &mut b.dtr,
                e,
                Accum::Overwrite,
                panels,
            );
            ops::bias_softplus(&mut b.dtr, &p[lo.dt_proj_b.clone()], &mut b.dt);
            let h = &mut st.ssm[i * e * n..(i + 1) * e * n];
            let (bt, ct) = (&b.dbc[r..r + n], &b.dbc[r + n..r + 2 * n]);
            scan_step(&b.u, &b.dt, bt, ct, &a[i], &p[lo.d.clone()], h, &mut b.y);
            ops::gate_fwd(&b.y, &b.xz, e, &mut b.g);
            ends.leave(&b.g, st.x, &mut b.x_next, panels);
            std::mem::swap(st.x, &mut b.x_next);
        }
    }
}

/// One scan step over every channel (module docs give the order): `h`
/// (`[e, n]`) advances by one token, `y` gets `C.h + D u`.
#[allow(clippy::too_many_arguments)]
fn scan_step<F: Float>(
    u: &[F],
    dt: &[F],
    bt: &[F],
    ct: &[F],
    a: &[F],
    dpar: &[F],
    h: &mut [F],
    y: &mut [F],
) {
    let n = bt.len();
    for c in 0..u.len() {
        let du = dt[c] * u[c];
        let mut yv = F::ZERO;
        let hc = &mut h[c * n..(c + 1) * n];
        for s in 0..n {
            let abar = (dt[c] * a[c * n + s]).exp();
            hc[s] = abar * hc[s] + du * bt[s];
            yv = yv + hc[s] * ct[s];
        }
        y[c] = yv + dpar[c] * u[c];
    }
}
