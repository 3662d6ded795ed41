//! Mamba-2 blocks on the device (`n_groups = 1`), forward and backward,
//! inside the same pass as Mamba-1's ([`super::forward`],
//! [`super::backward`]: the embedding, the final norm, the tied head and
//! the loss are shared, and so are the pre-norm, its backward, the conv
//! kernels, the gated RMSNorm's kernels and the selective scan).
//!
//! The scan is Mamba-1's per-channel selective scan
//! ([`kernels::mamba::scan`]): a Mamba-2 head of `P` channels with one
//! `dt`, `A` and `D` is that scan with the head's values broadcast to its
//! channels ([`kernels::mamba::heads`], exact copies) and B, C shared by
//! every channel (one group). Its gradients per channel are summed back per
//! head in ascending channel order. So the CUDA Mamba-2 walks time
//! sequentially, in f32, in every precision (the GEMMs take the precision,
//! as for Mamba-1; every Mamba-2 activation is kept in f32); its
//! association differs from the CPU reference's chunked SSD, so the two
//! agree within tolerance (`tests/cuda_mamba2.rs`), and `chunk_size`, which
//! decides the CPU's order, does not change its bits.
//!
//! Per block (rows `M`, `E = d_inner`, `N = d_state`, `H` heads of `P`,
//! `cd = E + 2N` conv channels, `w = E + cd + H`):
//! ```text
//! xn  = RMSNorm(x_in)                        kernel  [M, d]   (shared buffer)
//! zx  = xn . W_in^T                          cuBLAS  [M, w]   (z | x B C | dt_raw)
//! uc  = SiLU(conv1d(x B C) + b)              kernel  [M, cd]
//! dt  = softplus(dt_raw + dt_bias)           kernels [M, H]
//! y, g = scan(x of uc, dt per channel, B, C, A per channel, D per channel),
//!        g = y SiLU(z)                       kernels [M, E]
//! gn  = RMSNorm(g) * norm.weight             kernel  [M, E]   (shared buffer)
//! x_out = x_in + gn . W_out^T                copy + cuBLAS (beta = 1)
//! ```
//! and back, from `dres = dL/dx_out`:
//! ```text
//! dgn = dres . W_out   gn again   dW_out = dres^T . gn
//! d norm.weight = colsum(dgn * g * rstd_g)   dg = RMSNorm_bwd(dgn)
//! dy, dz = gate_bwd(dg, y, z)                dD = head sums of colsum(dy * u)
//! d dt, du, dB, dC, dA_log = scan_bwd(...)   (per channel; d dt and dA_log summed per head)
//! d dt_bias = colsum(d dt_raw)               duc = du | dB dC
//! conv backward -> dx dB dC of zx, d conv   dW_in, dxn   pre-norm backward
//! ```
//!
//! Over 450 lines: one concept, the Mamba-2 block's forward and backward,
//! which must stay in step (the backward remakes the forward's per-channel
//! operands and gated norm with the same calls, `ChannelOps::make` and
//! `ScanViews`, shared by both); split, the two halves of one block's
//! buffer contract would sit in two files.

use cudarc::driver::{CudaSlice, CudaView};
use kernels::mamba::heads::GroupShape;
use kernels::mamba::{ColSum, ScanBackward, ScanForward, ScanInputs, ScanShape, Store, Stored};

use super::backward::block_norm_bwd;
use super::forward::{again, block_norm, cast_copy, half, op, op_t, store_into, stored};
use super::workspace::{ssd_conv_channels, ssd_in_width, ActBuf, SsdActs, SsdBufs, Workspace};
use super::Engine;
use crate::config::{ModelConfig, RMS_EPS};
use crate::error::{Result, TrainError};
use crate::params::{ParamLayout, SsdLayerOffsets};

/// The extents every Mamba-2 block of a pass shares.
#[derive(Clone, Copy)]
struct Dims {
    /// Rows and sequence length.
    m: usize,
    t: usize,
    /// d_model, d_inner, d_state, heads, head_dim, conv width.
    d: usize,
    e: usize,
    n: usize,
    h: usize,
    p: usize,
    k: usize,
    /// Conv channels and in_proj width.
    cd: usize,
    w: usize,
}

impl Dims {
    fn of(cfg: &ModelConfig, shape: ScanShape) -> Result<Self> {
        let Some(s) = cfg.ssd() else {
            return Err(TrainError::Config(
                "a Mamba-2 block needs a Mamba-2 config".into(),
            ));
        };
        Ok(Dims {
            m: shape.rows(),
            t: shape.seq_len,
            d: cfg.d_model,
            e: cfg.d_inner(),
            n: cfg.d_state,
            h: cfg.num_heads(),
            p: s.head_dim,
            k: cfg.d_conv,
            cd: ssd_conv_channels(cfg),
            w: ssd_in_width(cfg),
        })
    }
}

/// The scan's per-channel operands of one block ([`SsdBufs`]' docs).
struct ChannelOps<'w> {
    u_x: &'w mut CudaSlice<f32>,
    dt_e: &'w mut CudaSlice<f32>,
    a_log_e: &'w mut CudaSlice<f32>,
    d_e: &'w mut CudaSlice<f32>,
}

impl ChannelOps<'_> {
    /// Make them from the block's conv output `uc`, its per-head `dt` and
    /// its `A_log` and `D`: exact broadcasts, so the forward and the
    /// backward (which makes them again) see the same values.
    fn make(
        &mut self,
        e: &Engine,
        lo: &SsdLayerOffsets,
        p: &CudaSlice<f32>,
        dm: Dims,
        (uc, dt): (&CudaSlice<f32>, &CudaSlice<f32>),
    ) -> Result<()> {
        let (s, kr) = (&e.stream, &e.kernels);
        let x_cols = GroupShape {
            rows: dm.m,
            groups: dm.e,
            per: 1,
            ld_heads: dm.cd,
            ld_channels: dm.e,
        };
        kr.group_bcast(s, &uc.as_view(), &mut self.u_x.as_view_mut(), x_cols)?;
        let per_head = GroupShape::dense(dm.m, dm.h, dm.p);
        kr.group_bcast(s, &dt.as_view(), &mut self.dt_e.as_view_mut(), per_head)?;
        let a_log = GroupShape::dense(1, dm.h, dm.p * dm.n);
        kr.group_bcast(
            s,
            &p.slice(lo.a_log.clone()),
            &mut self.a_log_e.as_view_mut(),
            a_log,
        )?;
        let d_skip = GroupShape::dense(1, dm.h, dm.p);
        kr.group_bcast(
            s,
            &p.slice(lo.d.clone()),
            &mut self.d_e.as_view_mut(),
            d_skip,
        )?;
        Ok(())
    }
}

/// Views of one block's scan inputs: the per-channel operands and the B, C
/// columns of its conv output `uc` (from column `d_inner` on).
struct ScanViews<'a> {
    u: CudaView<'a, f32>,
    dt: CudaView<'a, f32>,
    bc: CudaView<'a, f32>,
    a_log: CudaView<'a, f32>,
    d: CudaView<'a, f32>,
}

impl<'a> ScanViews<'a> {
    fn of(ops: &'a ChannelOps<'_>, uc: &'a CudaSlice<f32>, d_inner: usize) -> Self {
        ScanViews {
            u: ops.u_x.as_view(),
            dt: ops.dt_e.as_view(),
            bc: uc.slice(d_inner..),
            a_log: ops.a_log_e.as_view(),
            d: ops.d_e.as_view(),
        }
    }

    /// The scan's inputs, B and C rows `ldbc` (the conv channels) apart.
    fn inputs(&self, ldbc: usize) -> ScanInputs<'_> {
        ScanInputs {
            u: Stored::F32(&self.u),
            dt: Stored::F32(&self.dt),
            bc: &self.bc,
            ldbc,
            a_log: &self.a_log,
            d: &self.d,
        }
    }
}

/// Every Mamba-2 block's forward pass over `ws.resid`, leaving what the
/// backward reads (as [`super::forward::forward`] does for Mamba-1).
pub(super) fn forward_blocks(
    e: &Engine,
    cfg: &ModelConfig,
    lay: &ParamLayout,
    (p, pb): (&CudaSlice<f32>, Option<&CudaSlice<u16>>),
    shape: ScanShape,
    ws: &mut Workspace,
) -> Result<()> {
    let dm = Dims::of(cfg, shape)?;
    let Workspace {
        resid,
        xn,
        xn_of,
        g,
        scan_seg,
        ssd,
        ..
    } = ws;
    let SsdBufs {
        acts,
        u_x,
        dt_e,
        a_log_e,
        d_e,
        ..
    } = ssd.as_mut().ok_or_else(missing_buffers)?;
    for (l, lo) in lay.ssd_layers.iter().enumerate() {
        let (before, after) = resid.split_at_mut(l + 1);
        let mut ops = ChannelOps {
            u_x,
            dt_e,
            a_log_e,
            d_e,
        };
        block_forward(
            e,
            lo,
            (p, pb),
            (dm, shape),
            &before[l],
            Some(&mut after[0]),
            acts.slot_mut(l),
            &mut ops,
            (xn, g, scan_seg),
        )?;
        acts.resident = Some(l);
        *xn_of = Some(l);
    }
    Ok(())
}

/// One Mamba-2 block's forward pass from `x_in` (the module docs): its
/// activations into `a` and, when `x_out` is given, its output into
/// `x_out`; without it, the recomputation of the activations alone
/// (`--recompute`: the same kernels on the same input, the same bits).
/// `xn` and `gn` are the shared norm output buffers ([`Workspace::xn`],
/// [`Workspace::g`]).
#[allow(clippy::too_many_arguments)]
fn block_forward(
    e: &Engine,
    lo: &SsdLayerOffsets,
    (p, pb): (&CudaSlice<f32>, Option<&CudaSlice<u16>>),
    (dm, shape): (Dims, ScanShape),
    x_in: &CudaSlice<f32>,
    x_out: Option<&mut CudaSlice<f32>>,
    a: &mut SsdActs,
    ops: &mut ChannelOps<'_>,
    (xn, gn, scan_seg): (&mut ActBuf, &mut ActBuf, &mut CudaSlice<f32>),
) -> Result<()> {
    let Dims {
        m,
        t,
        d,
        e: di,
        h,
        k,
        cd,
        w,
        ..
    } = dm;
    let (s, kr) = (&e.stream, &e.kernels);
    let wv = |range: &std::ops::Range<usize>| p.slice(range.clone());

    block_norm(e, &lo.norm, p, (m, d), x_in, xn, &mut a.rstd)?;
    e.blas.gemm(
        "in_proj",
        m,
        w,
        d,
        op(xn.elems(), d),
        op_t(&wv(&lo.in_proj), d).with_bf16(half(pb, &lo.in_proj)),
        0.0,
        &mut a.zx.as_view_mut(),
        w,
    )?;
    let xbc = a.zx.slice(di..);
    kr.conv_fwd(
        s,
        Stored::F32(&xbc),
        w,
        &wv(&lo.conv_w),
        &wv(&lo.conv_b),
        Store::F32(a.uc.as_view_mut()),
        m,
        t,
        cd,
        k,
    )?;
    let dt_cols = GroupShape {
        rows: m,
        groups: h,
        per: 1,
        ld_heads: w,
        ld_channels: h,
    };
    kr.group_bcast(s, &a.zx.slice(di + cd..), &mut a.dt.as_view_mut(), dt_cols)?;
    kr.dt_softplus(s, &mut a.dt.as_view_mut(), None, &wv(&lo.dt_bias), m, h)?;
    ops.make(e, lo, p, dm, (&a.uc, &a.dt))?;

    let views = ScanViews::of(ops, &a.uc, di);
    let z = a.zx.as_view();
    kr.scan_forward(
        s,
        shape,
        views.inputs(cd),
        ScanForward {
            z: Stored::F32(&z),
            ldz: w,
            hin: &mut a.hin.as_view_mut(),
            y: Store::F32(a.y.as_view_mut()),
            out: Store::F32(a.g.as_view_mut()),
            scratch_seg: &mut scan_seg.as_view_mut(),
        },
    )?;
    kr.rmsnorm_fwd(
        s,
        &a.g.as_view(),
        &wv(&lo.norm_gated),
        gn.produce(),
        &mut a.rstd_g.as_view_mut(),
        m,
        di,
        RMS_EPS,
    )?;

    let Some(x_out) = x_out else {
        return Ok(());
    };
    s.memcpy_dtod(x_in, x_out).map_err(|err| TrainError::Cuda {
        what: "copying the residual stream".into(),
        detail: err.to_string(),
    })?;
    e.blas.gemm(
        "out_proj",
        m,
        d,
        di,
        op(gn.elems(), di),
        op_t(&wv(&lo.out_proj), di).with_bf16(half(pb, &lo.out_proj)),
        1.0,
        &mut x_out.as_view_mut(),
        d,
    )?;
    Ok(())
}

/// Every Mamba-2 block's backward pass, last block first, from `ws.dres`
/// (the final norm's input gradient) down to block 0's input gradient in
/// `ws.dres` (as [`super::backward::backward`] does for Mamba-1: every
/// tensor of a block's gradient is written once).
pub(super) fn backward_blocks(
    e: &Engine,
    cfg: &ModelConfig,
    lay: &ParamLayout,
    (p, pb): (&CudaSlice<f32>, Option<&CudaSlice<u16>>),
    shape: ScanShape,
    ws: &mut Workspace,
    grads: &mut CudaSlice<f32>,
) -> Result<()> {
    let dm = Dims::of(cfg, shape)?;
    let Dims {
        m,
        t,
        d,
        e: di,
        n,
        h,
        p: hp,
        k,
        cd,
        w,
    } = dm;
    let (s, kr) = (&e.stream, &e.kernels);
    let wv = |range: &std::ops::Range<usize>| p.slice(range.clone());
    let Workspace {
        resid,
        xn,
        xn_of,
        g: gn,
        scan_seg,
        ssd,
        dres,
        dres_h,
        dout: dgn,
        dy,
        du,
        ddtr: ddt,
        dxn,
        colsum,
        da_part,
        dbc_part,
        ..
    } = ws;
    let SsdBufs {
        acts,
        u_x,
        dt_e,
        a_log_e,
        d_e,
        duc,
        dg,
        dd_e,
        da_log_e,
        dzx,
        dzx_h,
        rstd_again,
    } = ssd.as_mut().ok_or_else(missing_buffers)?;
    for (l, lo) in lay.ssd_layers.iter().enumerate().rev() {
        let mut ops = ChannelOps {
            u_x,
            dt_e,
            a_log_e,
            d_e,
        };
        if acts.shared() && acts.resident != Some(l) {
            // --recompute: this block's activations again, from its input.
            block_forward(
                e,
                lo,
                (p, pb),
                (dm, shape),
                &resid[l],
                None,
                acts.slot_mut(l),
                &mut ops,
                (xn, gn, scan_seg),
            )?;
            acts.resident = Some(l);
            *xn_of = Some(l);
        }
        if *xn_of != Some(l) {
            // The block's norm output again (the forward's bits).
            block_norm(
                e,
                &lo.norm,
                p,
                (m, d),
                &resid[l],
                xn,
                &mut acts.slot_mut(l).rstd,
            )?;
            *xn_of = Some(l);
        }
        let a = acts.slot(l);
        let g = |range: &std::ops::Range<usize>| range.clone();

        // out_proj: the input gradient, then gn again (its norm on the kept
        // g, the forward's bits) for the weight gradient.
        let dres_v = dres.as_view();
        let dres_hv = stored(dres_h, m * d);
        e.blas.gemm(
            "out_proj dx",
            m,
            di,
            d,
            op(&dres_v, d).with_bf16(again(&dres_hv)),
            op(&wv(&lo.out_proj), di).with_bf16(half(pb, &lo.out_proj)),
            0.0,
            &mut dgn.as_view_mut(),
            di,
        )?;
        kr.rmsnorm_fwd(
            s,
            &a.g.as_view(),
            &wv(&lo.norm_gated),
            gn.produce(),
            &mut rstd_again.as_view_mut(),
            m,
            di,
            RMS_EPS,
        )?;
        e.blas.gemm(
            "out_proj dW",
            d,
            di,
            m,
            op_t(&dres_v, d).with_bf16(dres_hv),
            op(gn.elems(), di),
            0.0,
            &mut grads.slice_mut(g(&lo.out_proj)),
            di,
        )?;

        // Gated RMSNorm, then the gate (dz into zx's z columns).
        let (gv, rstd_g) = (a.g.as_view(), a.rstd_g.as_view());
        kr.colsum(
            s,
            ColSum::ProductRowScaled {
                a: &dgn.as_view(),
                lda: di,
                b: &gv,
                ldb: di,
                row_scale: &rstd_g,
            },
            m,
            di,
            &mut colsum.as_view_mut(),
            &mut grads.slice_mut(g(&lo.norm_gated)),
        )?;
        kr.rmsnorm_bwd(
            s,
            &dgn.as_view(),
            &gv,
            &wv(&lo.norm_gated),
            &rstd_g,
            Store::F32(dg.as_view_mut()),
            m,
            di,
            false,
        )?;
        let (y, zx) = (a.y.as_view(), a.zx.as_view());
        kr.gate_bwd(
            s,
            &dg.as_view(),
            Stored::F32(&y),
            Stored::F32(&zx),
            w,
            &mut dy.as_view_mut(),
            Store::F32(dzx.as_view_mut()),
            gn.produce(),
            m,
            di,
        )?;

        // The scan, per channel, and its per-head sums.
        ops.make(e, lo, p, dm, (&a.uc, &a.dt))?;
        let views = ScanViews::of(&ops, &a.uc, di);
        kr.colsum(
            s,
            ColSum::Product {
                a: &dy.as_view(),
                lda: di,
                b: Stored::F32(&views.u),
                ldb: di,
            },
            m,
            di,
            &mut colsum.as_view_mut(),
            &mut dd_e.as_view_mut(),
        )?;
        let skip = GroupShape::dense(1, h, hp);
        kr.group_sum(s, &dd_e.as_view(), &mut grads.slice_mut(g(&lo.d)), skip)?;
        kr.scan_backward(
            s,
            shape,
            views.inputs(cd),
            ScanBackward {
                dy: &dy.as_view(),
                hin: &a.hin.as_view(),
                scratch_da: &mut da_part.as_view_mut(),
                scratch_dbc: &mut dbc_part.as_view_mut(),
                scratch_seg: &mut scan_seg.as_view_mut(),
                ddt_raw: Store::F32(ddt.as_view_mut()),
                du: &mut du.as_view_mut(),
                dbc: &mut duc.slice_mut(di..),
                da_log: &mut da_log_e.as_view_mut(),
            },
        )?;
        let a_log_heads = GroupShape::dense(1, h, hp * n);
        kr.group_sum(
            s,
            &da_log_e.as_view(),
            &mut grads.slice_mut(g(&lo.a_log)),
            a_log_heads,
        )?;
        // d dt_raw per head (the scan's per-channel d dt already carries
        // softplus'), into zx's dt columns; dt_bias's gradient is their sum.
        let dt_heads = GroupShape {
            rows: m,
            groups: h,
            per: hp,
            ld_heads: w,
            ld_channels: di,
        };
        kr.group_sum(s, &ddt.as_view(), &mut dzx.slice_mut(di + cd..), dt_heads)?;
        kr.colsum(
            s,
            ColSum::Plain {
                a: &dzx.slice(di + cd..),
                lda: w,
            },
            m,
            h,
            &mut colsum.as_view_mut(),
            &mut grads.slice_mut(g(&lo.dt_bias)),
        )?;

        // Conv + SiLU over x, B, C: duc = du | dB dC, then through SiLU in
        // place, then the input gradient into zx's conv columns and the
        // conv's weight and bias.
        let x_cols = GroupShape {
            rows: m,
            groups: di,
            per: 1,
            ld_heads: di,
            ld_channels: cd,
        };
        kr.group_bcast(s, &du.as_view(), &mut duc.as_view_mut(), x_cols)?;
        let xbc = a.zx.slice(di..);
        let (conv_w, conv_b) = (wv(&lo.conv_w), wv(&lo.conv_b));
        kr.conv_bwd_pre(
            s,
            Stored::F32(&xbc),
            w,
            &conv_w,
            &conv_b,
            &mut duc.as_view_mut(),
            m,
            t,
            cd,
            k,
        )?;
        kr.conv_bwd_dx(
            s,
            &duc.as_view(),
            &conv_w,
            Store::F32(dzx.slice_mut(di..)),
            w,
            m,
            t,
            cd,
            k,
        )?;
        let (wr, br) = (g(&lo.conv_w), g(&lo.conv_b));
        if wr.end != br.start {
            return Err(TrainError::Config(format!(
                "layer {l}: conv1d.weight {wr:?} must be followed by conv1d.bias {br:?} in the \
                 arena"
            )));
        }
        kr.conv_wgrad(
            s,
            &duc.as_view(),
            Stored::F32(&xbc),
            w,
            &mut colsum.as_view_mut(),
            &mut grads.slice_mut(wr.start..br.end),
            m,
            t,
            cd,
            k,
        )?;

        // in_proj, then the pre-norm.
        let dzx_v: CudaView<'_, f32> = dzx.as_view();
        let dzx_hv = cast_copy(e, &dzx_v, dzx_h.as_mut())?;
        e.blas.gemm(
            "in_proj dW",
            w,
            d,
            m,
            op_t(&dzx_v, w).with_bf16(again(&dzx_hv)),
            op(xn.elems(), d),
            0.0,
            &mut grads.slice_mut(g(&lo.in_proj)),
            d,
        )?;
        e.blas.gemm(
            "in_proj dx",
            m,
            d,
            w,
            op(&dzx_v, w).with_bf16(dzx_hv),
            op(&wv(&lo.in_proj), d).with_bf16(half(pb, &lo.in_proj)),
            0.0,
            &mut dxn.as_view_mut(),
            d,
        )?;
        let dres_store = if l > 0 {
            store_into(dres_h, m * d)
        } else {
            None
        };
        block_norm_bwd(
            e,
            &lo.norm,
            p,
            (m, d),
            (dxn, &resid[l], &a.rstd),
            colsum,
            (dres, dres_store),
            grads,
        )?;
    }
    Ok(())
}

fn missing_buffers() -> TrainError {
    TrainError::Cuda {
        what: "running a Mamba-2 block".into(),
        detail: "the workspace has no Mamba-2 buffers (it was built for Mamba-1)".into(),
    }
}
