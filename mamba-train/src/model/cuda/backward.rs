//! The backward pass on the device. It *overwrites* every tensor of the
//! gradient arena exactly once (cuBLAS with `beta = 0`, or a reduction that
//! writes), except the embedding, which the LM head's GEMM writes and the
//! embedding's scatter-add then adds to. Nothing is accumulated across calls.
//!
//! With `--recompute` ([`super::workspace::BlockActs`]) each block's
//! activations are recomputed from its input just before its backward
//! (the last block's are still there from the forward pass). Every block's
//! norm output `xn` and gated output `g` are made again here, not kept
//! ([`super::workspace`]'s docs): `xn` by the block's RMSNorm on its input,
//! `g` by the gate's backward, both the forward's bits. In bf16 runs
//! each output gradient has one bf16 copy, which the two GEMMs of its linear
//! layer share: stored by the kernel that makes the gradient (the norm's
//! backward for `dres`, the scan for `ddtr`), cast afterwards only for
//! cuBLAS's `ddbc`; `dxz`, which only in_proj's GEMMs read, is stored in
//! bf16 alone by the gate and conv backward.
//!
//! Per block, from `dres = dL/dx_out` (which also flows straight through to
//! `x_in`):
//! ```text
//! dout = dres . W_out
//! dy, dz, g = gate_bwd(dout, y, z)   (g = y SiLU(z) again)
//! dW_out = dres^T . g            dD   = colsum(dy * u)
//! ddtr, du, dB, dC, dA_log = scan_bwd(...)      (du includes D dy)
//! db_dt = colsum(ddtr)  dW_dt = ddtr^T . dt_raw  d dt_raw = ddtr . W_dt
//! dW_x  = ddbc^T . u    du   += ddbc . W_x
//! dpre  = du SiLU'(pre) dx = conv^T(dpre)  dw_conv, db_conv = colsums
//! xn again = RMSNorm(x_in)      dW_in = dxz^T . xn    dxn  = dxz . W_in
//! dw_norm = colsum(dxn * x_in * rstd)   dres += RMSNorm_bwd(dxn)
//! ```

use cudarc::driver::CudaSlice;
use kernels::mamba::{ColSum, ScanBackward, ScanInputs, Store, Stored};

use super::forward::{
    again, block_forward, block_norm, cast_copy, half, op, op_t, store_into, stored, Scratch,
};
use super::workspace::Workspace;
use super::Engine;
use crate::config::ModelConfig;
use crate::error::{Result, TrainError};
use crate::params::ParamLayout;

/// Backward pass after [`super::forward::forward`] and
/// [`super::head::head_loss`] with gradients: `ws.dxn` must already hold
/// d loss / d xf and `grads`' embedding the head's share of d E (the
/// embedding lookup's share is added here).
/// `pb` is `p` cast to bf16 (bf16 runs), as for the forward pass.
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    e: &Engine,
    cfg: &ModelConfig,
    lay: &ParamLayout,
    p: &CudaSlice<f32>,
    pb: Option<&CudaSlice<u16>>,
    ws: &mut Workspace,
    grads: &mut CudaSlice<f32>,
) -> Result<()> {
    let (t, m) = (ws.seq_len, ws.batch * ws.seq_len);
    let (d, di, r, k) = (cfg.d_model, cfg.d_inner(), cfg.dt_rank, cfg.d_conv);
    let n = cfg.d_state;
    let ldbc = r + 2 * n;
    let shape = Workspace::scan_shape(cfg, ws.batch, ws.seq_len);
    let (s, kr) = (&e.stream, &e.kernels);

    // Final norm.
    let last = ws.resid[cfg.n_layer].as_view();
    let norm_f = p.slice(lay.norm_f.clone());
    kr.colsum(
        s,
        ColSum::ProductRowScaled {
            a: &ws.dxn.as_view(),
            lda: d,
            b: Stored::F32(&last),
            ldb: d,
            row_scale: &ws.rstd_f.as_view(),
        },
        m,
        d,
        &mut ws.colsum.as_view_mut(),
        &mut grads.slice_mut(lay.norm_f.clone()),
    )?;
    kr.rmsnorm_bwd(
        s,
        &ws.dxn.as_view(),
        Stored::F32(&last),
        &norm_f,
        &ws.rstd_f.as_view(),
        Store::f32_and(ws.dres.as_view_mut(), store_into(&mut ws.dres_h, m * d)),
        m,
        d,
        false,
    )?;

    if ws.ssd.is_some() {
        super::ssd::backward_blocks(e, cfg, lay, (p, pb), shape, ws, grads)?;
    }
    for (l, lo) in lay.layers.iter().enumerate().rev() {
        if ws.acts.shared() && ws.acts.resident != Some(l) {
            // --recompute: this block's activations again, from its input.
            block_forward(
                e,
                cfg,
                lo,
                (p, pb),
                shape,
                &ws.resid[l],
                None,
                ws.acts.slot_mut(l),
                Scratch {
                    scan_seg: &mut ws.scan_seg,
                    dt_raw: &mut ws.ddtr,
                    xn: &mut ws.xn,
                    g: &mut ws.g,
                },
            )?;
            ws.acts.resident = Some(l);
            ws.xn_of = Some(l);
        }
        if ws.xn_of != Some(l) {
            // The block's norm output again (the forward's bits; its 1/rms
            // is rewritten with the bits it holds).
            block_norm(
                e,
                &lo.norm,
                p,
                (m, d),
                &ws.resid[l],
                &mut ws.xn,
                &mut ws.acts.slot_mut(l).rstd,
            )?;
            ws.xn_of = Some(l);
        }
        let a = ws.acts.slot(l);
        let w = |range: &std::ops::Range<usize>| p.slice(range.clone());
        let g = |range: &std::ops::Range<usize>| range.clone();

        // out_proj and the residual: x_out = x_in + g . W_out^T. The input
        // gradient first: the gate's backward below makes it into dy and dz
        // and makes g again, which the weight gradient reads.
        let dres = ws.dres.as_view();
        let dres_h = stored(&ws.dres_h, m * d);
        e.blas.gemm(
            "out_proj dx",
            m,
            di,
            d,
            op(&dres, d).with_bf16(again(&dres_h)),
            op(&w(&lo.out_proj), di).with_bf16(half(pb, &lo.out_proj)),
            0.0,
            &mut ws.dout.as_view_mut(),
            di,
        )?;

        // Gate.
        let z = a.xz.view_from(di);
        let (y, u, dt) = (a.y.view(), a.u.view(), a.dt.view());
        kr.gate_bwd(
            s,
            &ws.dout.as_view(),
            y.stored(),
            z.stored(),
            2 * di,
            &mut ws.dy.as_view_mut(),
            ws.dxz.produce_from(di),
            ws.g.produce(),
            m,
            di,
        )?;
        e.blas.gemm(
            "out_proj dW",
            d,
            di,
            m,
            op_t(&dres, d).with_bf16(dres_h),
            op(ws.g.elems(), di),
            0.0,
            &mut grads.slice_mut(g(&lo.out_proj)),
            di,
        )?;
        kr.colsum(
            s,
            ColSum::Product {
                a: Stored::F32(&ws.dy.as_view()),
                lda: di,
                b: u.stored(),
                ldb: di,
            },
            m,
            di,
            &mut ws.colsum.as_view_mut(),
            &mut grads.slice_mut(g(&lo.d)),
        )?;

        // Scan.
        let (bc, a_log, dpar) = (a.dbc.slice(r..), w(&lo.a_log), w(&lo.d));
        kr.scan_backward(
            s,
            shape,
            ScanInputs {
                u: u.stored(),
                dt: dt.stored(),
                bc: &bc,
                ldbc,
                a_log: &a_log,
                d: &dpar,
            },
            ScanBackward {
                dy: &ws.dy.as_view(),
                hin: &a.hin.as_view(),
                scratch_da: &mut ws.da_part.as_view_mut(),
                scratch_dbc: &mut ws.dbc_part.as_view_mut(),
                scratch_seg: &mut ws.scan_seg.as_view_mut(),
                ddt_raw: Store::f32_and(ws.ddtr.as_view_mut(), store_into(&mut ws.ddtr_h, m * di)),
                du: &mut ws.du.as_view_mut(),
                dbc: &mut ws.ddbc.slice_mut(r..),
                da_log: &mut grads.slice_mut(g(&lo.a_log)),
            },
        )?;

        // dt_proj (bias, weight, input).
        let ddtr = ws.ddtr.as_view();
        let ddtr_h = stored(&ws.ddtr_h, m * di);
        kr.colsum(
            s,
            ColSum::Plain { a: &ddtr, lda: di },
            m,
            di,
            &mut ws.colsum.as_view_mut(),
            &mut grads.slice_mut(g(&lo.dt_proj_b)),
        )?;
        e.blas.gemm(
            "dt_proj dW",
            di,
            r,
            m,
            op_t(&ddtr, di).with_bf16(again(&ddtr_h)),
            op(&a.dbc.as_view(), ldbc).with_bf16(a.dbc_h.as_ref().map(|h| h.as_view())),
            0.0,
            &mut grads.slice_mut(g(&lo.dt_proj_w)),
            r,
        )?;
        e.blas.gemm(
            "dt_proj dx",
            m,
            r,
            di,
            op(&ddtr, di).with_bf16(ddtr_h),
            op(&w(&lo.dt_proj_w), r).with_bf16(half(pb, &lo.dt_proj_w)),
            0.0,
            &mut ws.ddbc.as_view_mut(),
            ldbc,
        )?;

        // x_proj.
        let ddbc = ws.ddbc.as_view();
        let ddbc_h = cast_copy(e, &ddbc, ws.ddbc_h.as_mut())?;
        e.blas.gemm(
            "x_proj dW",
            ldbc,
            di,
            m,
            op_t(&ddbc, ldbc).with_bf16(again(&ddbc_h)),
            op(a.u.elems(), di).with_bf16(a.u_h.as_ref().map(|h| h.as_view())),
            0.0,
            &mut grads.slice_mut(g(&lo.x_proj)),
            di,
        )?;
        e.blas.gemm(
            "x_proj dx",
            m,
            di,
            ldbc,
            op(&ddbc, ldbc).with_bf16(ddbc_h),
            op(&w(&lo.x_proj), di).with_bf16(half(pb, &lo.x_proj)),
            1.0,
            &mut ws.du.as_view_mut(),
            di,
        )?;

        // Conv + SiLU, one pass: du -> dx (into dxz's x half) and the conv's
        // weight and bias gradients.
        {
            // conv1d.weight and conv1d.bias are adjacent arena tensors, the
            // weight first (ParamLayout's order): the kernel writes both as
            // one span.
            let (wr, br) = (g(&lo.conv_w), g(&lo.conv_b));
            if wr.end != br.start {
                return Err(TrainError::Config(format!(
                    "layer {l}: conv1d.weight {wr:?} must be followed by conv1d.bias {br:?} in \
                     the arena"
                )));
            }
            let xz = a.xz.view();
            kr.conv_bwd(
                s,
                xz.stored(),
                2 * di,
                &w(&lo.conv_w),
                &w(&lo.conv_b),
                &ws.du.as_view(),
                ws.dxz.produce(),
                2 * di,
                &mut ws.colsum.as_view_mut(),
                &mut grads.slice_mut(wr.start..br.end),
                m,
                t,
                di,
                k,
            )?;
        }

        // in_proj.
        e.blas.gemm(
            "in_proj dW",
            2 * di,
            d,
            m,
            op_t(ws.dxz.elems(), 2 * di),
            op(ws.xn.elems(), d),
            0.0,
            &mut grads.slice_mut(g(&lo.in_proj)),
            d,
        )?;
        e.blas.gemm(
            "in_proj dx",
            m,
            d,
            2 * di,
            op(ws.dxz.elems(), 2 * di),
            op(&w(&lo.in_proj), d).with_bf16(half(pb, &lo.in_proj)),
            0.0,
            &mut ws.dxn.as_view_mut(),
            d,
        )?;

        let dres_h = if l > 0 {
            store_into(&mut ws.dres_h, m * d)
        } else {
            None
        };
        block_norm_bwd(
            e,
            &lo.norm,
            p,
            (m, d),
            (&ws.dxn, &ws.resid[l], &a.rstd),
            &mut ws.colsum,
            (&mut ws.dres, dres_h),
            grads,
        )?;
    }

    // Embedding: dE += scatter of dres by token (LM head's share is there).
    kr.embed_bwd(
        s,
        &ws.csr,
        &ws.dres.as_view(),
        &mut grads.slice_mut(lay.embedding.clone()),
        d,
    )?;
    Ok(())
}

/// A block's pre-norm backward, from `dxn = dL/d xn` (its in_proj's input
/// gradient): the norm weight's gradient into `grads[norm]`, then
/// `dres += RMSNorm_bwd(dxn)` (the residual's share came straight
/// through), storing `dres`'s bf16 copy into `dres_h` when given (the
/// block below reads it; below block 0 only the embedding's scatter reads
/// `dres`, in f32). Both architectures' blocks end with it.
#[allow(clippy::too_many_arguments)]
pub(super) fn block_norm_bwd(
    e: &Engine,
    norm: &std::ops::Range<usize>,
    p: &CudaSlice<f32>,
    (m, d): (usize, usize),
    (dxn, x_in, rstd): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<f32>),
    colsum: &mut CudaSlice<f32>,
    (dres, dres_h): (
        &mut CudaSlice<f32>,
        Option<cudarc::driver::CudaViewMut<'_, u16>>,
    ),
    grads: &mut CudaSlice<f32>,
) -> Result<()> {
    let (s, kr) = (&e.stream, &e.kernels);
    let (dxn, x_in, rstd) = (dxn.as_view(), x_in.as_view(), rstd.as_view());
    kr.colsum(
        s,
        ColSum::ProductRowScaled {
            a: &dxn,
            lda: d,
            b: Stored::F32(&x_in),
            ldb: d,
            row_scale: &rstd,
        },
        m,
        d,
        &mut colsum.as_view_mut(),
        &mut grads.slice_mut(norm.clone()),
    )?;
    kr.rmsnorm_bwd(
        s,
        &dxn,
        Stored::F32(&x_in),
        &p.slice(norm.clone()),
        &rstd,
        Store::f32_and(dres.as_view_mut(), dres_h),
        m,
        d,
        true,
    )?;
    Ok(())
}
