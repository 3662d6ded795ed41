//! The forward pass on the device: embedding, `n_layer` blocks of
//! `x + Mixer(RMSNorm(x))`, final RMSNorm (the tied LM head and the loss
//! follow in [`super::head`], over chunks of rows). Every activation the
//! backward pass needs is left in the [`Workspace`].
//!
//! Per block (rows `M = batch * seq_len`, `E = d_inner`, `R = dt_rank`,
//! `ldbc = R + 2 d_state`):
//! ```text
//! xn  = RMSNorm(x_in)                    kernel   [M, d]
//! xz  = xn . W_in^T                      cuBLAS   [M, 2E]   (x | z)
//! u   = SiLU(conv1d(x) + b)              kernel   [M, E]
//! dbc = u . W_x^T                        cuBLAS   [M, ldbc] (dt_raw | B | C)
//! dt  = softplus(dt_raw . W_dt^T + b_dt) cuBLAS + kernel [M, E]
//! y, g = scan(u, dt, B, C, A, D), y SiLU(z)   kernels [M, E]
//! x_out = x_in + g . W_out^T             copy + cuBLAS (beta = 1)
//! ```

use cudarc::driver::CudaSlice;
use kernels::mamba::{ScanForward, ScanInputs};

use super::blas::Operand;
use super::workspace::Workspace;
use super::Engine;
use crate::config::{ModelConfig, RMS_EPS};
use crate::error::{Result, TrainError};
use crate::params::ParamLayout;

/// `A` (not transposed) with leading dimension `ld`.
pub(super) fn op<'a, 'b>(
    data: &'a cudarc::driver::CudaView<'b, f32>,
    ld: usize,
) -> Operand<'a, 'b> {
    Operand {
        data,
        ld,
        trans: false,
        bf16: None,
    }
}

/// `A^T` (stored untransposed) with leading dimension `ld`.
pub(super) fn op_t<'a, 'b>(
    data: &'a cudarc::driver::CudaView<'b, f32>,
    ld: usize,
) -> Operand<'a, 'b> {
    Operand {
        data,
        ld,
        trans: true,
        bf16: None,
    }
}

/// The bf16 copy of the parameter tensor `range` (bf16 runs only).
pub(super) fn half<'p>(
    pb: Option<&'p CudaSlice<u16>>,
    range: &std::ops::Range<usize>,
) -> Option<cudarc::driver::CudaView<'p, u16>> {
    pb.map(|h| h.slice(range.clone()))
}

/// Run the forward pass of `p` over the tokens already in `ws.tokens`,
/// leaving the final norm's output in `ws.xf`. `pb` is `p` cast to bf16 (bf16 runs:
/// the weights' GEMM operands), `None` otherwise.
pub(super) fn forward(
    e: &Engine,
    cfg: &ModelConfig,
    lay: &ParamLayout,
    p: &CudaSlice<f32>,
    pb: Option<&CudaSlice<u16>>,
    ws: &mut Workspace,
) -> Result<()> {
    let (t, m) = (ws.seq_len, ws.batch * ws.seq_len);
    let (d, di, r, k, v) = (
        cfg.d_model,
        cfg.d_inner(),
        cfg.dt_rank,
        cfg.d_conv,
        cfg.vocab_size,
    );
    let ldbc = r + 2 * cfg.d_state;
    let shape = Workspace::scan_shape(cfg, ws.batch, ws.seq_len);
    let (s, kr) = (&e.stream, &e.kernels);

    let emb = p.slice(lay.embedding.clone());
    kr.embed_fwd(
        s,
        &ws.tokens.as_view(),
        &emb,
        &mut ws.resid[0].as_view_mut(),
        d,
        v,
    )?;

    for (l, lo) in lay.layers.iter().enumerate() {
        let (before, after) = ws.resid.split_at_mut(l + 1);
        let (x_in, x_out) = (&before[l], &mut after[0]);
        let a = &mut ws.layers[l];
        let w = |range: &std::ops::Range<usize>| p.slice(range.clone());

        kr.rmsnorm_fwd(
            s,
            &x_in.as_view(),
            &w(&lo.norm),
            &mut a.xn.as_view_mut(),
            &mut a.rstd.as_view_mut(),
            m,
            d,
            RMS_EPS,
        )?;
        e.blas.gemm(
            "in_proj",
            m,
            2 * di,
            d,
            op(&a.xn.as_view(), d),
            op_t(&w(&lo.in_proj), d).with_bf16(half(pb, &lo.in_proj).as_ref()),
            0.0,
            &mut a.xz.as_view_mut(),
            2 * di,
        )?;
        kr.conv_fwd(
            s,
            &a.xz.as_view(),
            2 * di,
            &w(&lo.conv_w),
            &w(&lo.conv_b),
            &mut a.u.as_view_mut(),
            m,
            t,
            di,
            k,
        )?;
        e.blas.gemm(
            "x_proj",
            m,
            ldbc,
            di,
            op(&a.u.as_view(), di),
            op_t(&w(&lo.x_proj), di).with_bf16(half(pb, &lo.x_proj).as_ref()),
            0.0,
            &mut a.dbc.as_view_mut(),
            ldbc,
        )?;
        e.blas.gemm(
            "dt_proj",
            m,
            di,
            r,
            op(&a.dbc.as_view(), ldbc),
            op_t(&w(&lo.dt_proj_w), r).with_bf16(half(pb, &lo.dt_proj_w).as_ref()),
            0.0,
            &mut a.dt.as_view_mut(),
            di,
        )?;
        kr.dt_softplus(s, &mut a.dt.as_view_mut(), &w(&lo.dt_proj_b), m, di)?;

        let (u, dt, bc, a_log, dpar) = (
            a.u.as_view(),
            a.dt.as_view(),
            a.dbc.slice(r..),
            w(&lo.a_log),
            w(&lo.d),
        );
        let z = a.xz.slice(di..);
        kr.scan_forward(
            s,
            shape,
            ScanInputs {
                u: &u,
                dt: &dt,
                bc: &bc,
                ldbc,
                a_log: &a_log,
                d: &dpar,
            },
            ScanForward {
                z: &z,
                ldz: 2 * di,
                hin: &mut a.hin.as_view_mut(),
                y: &mut a.y.as_view_mut(),
                out: &mut a.g.as_view_mut(),
            },
        )?;

        s.memcpy_dtod(x_in, x_out).map_err(|e| TrainError::Cuda {
            what: format!("copying the residual stream of layer {l}"),
            detail: e.to_string(),
        })?;
        e.blas.gemm(
            "out_proj",
            m,
            d,
            di,
            op(&a.g.as_view(), di),
            op_t(&w(&lo.out_proj), di).with_bf16(half(pb, &lo.out_proj).as_ref()),
            1.0,
            &mut x_out.as_view_mut(),
            d,
        )?;
    }

    let last = &ws.resid[cfg.n_layer];
    let norm_f = p.slice(lay.norm_f.clone());
    kr.rmsnorm_fwd(
        s,
        &last.as_view(),
        &norm_f,
        &mut ws.xf.as_view_mut(),
        &mut ws.rstd_f.as_view_mut(),
        m,
        d,
        RMS_EPS,
    )?;
    Ok(())
}
