//! Mamba-2 blocks on the device (any number of groups of B and C),
//! forward and backward, inside the same pass as Mamba-1's
//! ([`super::forward`], [`super::backward`]: the embedding, the final norm,
//! the tied head and the loss are shared, and so are the pre-norm, its
//! backward, the conv kernels, the gated RMSNorm's kernels and the gate's
//! backward).
//!
//! The scan is the chunked SSD of [`kernels::mamba::ssd`]: per chunk of
//! [`kernels::mamba::SSD_CHUNK`] tokens a diagonal block and the state the
//! chunk enters with, the states passed from chunk to chunk; its backward
//! recomputes the entry states and keeps every sum in a fixed order (no
//! atomics). bf16 runs keep `zx`, `uc`, `y` and `g` in bf16 alone, and
//! so `dy` and the SSD's states (`dt` stays f32); the GEMMs take the
//! precision, as for Mamba-1, and so do the scan's chunk products (f32
//! FMAs in f32 runs, tf32 tensor cores in tf32 and bf16 runs:
//! [`kernels::mamba::SsdProducts`], the engine's choice). Its
//! chunk length is the kernels' constant, so the model's `chunk_size`
//! (which decides the CPU reference's order) does not change its bits; the
//! two agree within tolerance (`tests/cuda_mamba2.rs`).
//!
//! Per block (rows `M`, `E = d_inner`, `N = d_state`, `G` groups, `H`
//! heads of `P`, `cd = E + 2GN` conv channels, `w = E + cd + H`):
//! ```text
//! xn  = RMSNorm(x_in)                        kernel  [M, d]   (shared buffer)
//! zx  = xn . W_in^T                          cuBLAS  [M, w]   (z | x B C | dt_raw)
//! uc  = SiLU(conv1d(x B C) + b)              kernel  [M, cd]
//! dt  = softplus(dt_raw + dt_bias)           kernels [M, H]
//! y, g = ssd(x, dt, B, C of uc, A_log, D),
//!        g = y SiLU(z)                       kernels [M, E]
//! gn  = RMSNorm(g) * norm.weight             kernel  [M, E]   (shared buffer)
//! x_out = x_in + gn . W_out^T                copy + cuBLAS (beta = 1)
//! ```
//! and back, from `dres = dL/dx_out`:
//! ```text
//! dgn = dres . W_out   gn again   dW_out = dres^T . gn
//! d norm.weight = colsum(dgn * g * rstd_g)
//! dy, dz = gate_bwd(RMSNorm_bwd(dgn), y, z)  one kernel; dD = head sums of colsum(dy * x)
//! dx dB dC (into duc), d dt_raw (into zx's dt columns), dA_log = ssd_bwd(...)
//! d dt_bias = colsum(d dt_raw)
//! conv backward -> dx dB dC of zx, d conv   dW_in, dxn   pre-norm backward
//! ```
//!
//! Over 450 lines: one concept, the Mamba-2 block's forward and backward,
//! which must stay in step (the backward's scan reads the forward's kept
//! activations through the same `ssd_inputs`, and remakes the gated norm
//! with the same call); split, the two halves of one block's buffer
//! contract would sit in two files.

use cudarc::driver::{CudaSlice, CudaView};
use kernels::mamba::heads::GroupShape;
use kernels::mamba::{
    ColSum, ScanShape, SsdBackward, SsdForward, SsdInputs, SsdShape, Store, Stored,
};

use super::backward::block_norm_bwd;
use super::blas::{Elems, Operand};
use super::forward::{again, block_norm, half, op, op_t, store_into, stored};
use super::workspace::{
    ssd_conv_channels, ssd_in_width, ActBuf, SsdActs, SsdBufs, SsdGradBufs, SsdScanScratch,
    Workspace,
};
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
    /// d_model, d_inner, heads, conv width.
    d: usize,
    e: usize,
    h: usize,
    k: usize,
    /// Conv channels and in_proj width.
    cd: usize,
    w: usize,
    /// The scan's shape.
    ssd: SsdShape,
}

impl Dims {
    fn of(cfg: &ModelConfig, batch: usize, seq_len: usize) -> Result<Self> {
        let Some(s) = cfg.ssd() else {
            return Err(TrainError::Config(
                "a Mamba-2 block needs a Mamba-2 config".into(),
            ));
        };
        let h = cfg.num_heads();
        Ok(Dims {
            m: batch * seq_len,
            t: seq_len,
            d: cfg.d_model,
            e: cfg.d_inner(),
            h,
            k: cfg.d_conv,
            cd: ssd_conv_channels(cfg),
            w: ssd_in_width(cfg),
            ssd: SsdShape {
                batch,
                seq_len,
                heads: h,
                head_dim: s.head_dim,
                d_state: cfg.d_state,
                groups: s.n_groups,
            },
        })
    }
}

/// The scan's inputs of one block: its kept conv output (x, B, C) and
/// `dt`, and its `A_log` and `D` (the forward and the backward read them
/// through this one function).
fn ssd_inputs<'a>(
    (uc, dt): (Stored<'a>, &'a CudaView<'a, f32>),
    (a_log, d): (&'a CudaView<'a, f32>, &'a CudaView<'a, f32>),
    cd: usize,
) -> SsdInputs<'a> {
    SsdInputs {
        xbc: uc,
        ldu: cd,
        dt,
        a_log,
        d,
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
    let dm = Dims::of(cfg, shape.batch, shape.seq_len)?;
    let Workspace {
        resid,
        xn,
        xn_of,
        g,
        ssd,
        ..
    } = ws;
    let SsdBufs { acts, scan, .. } = ssd.as_mut().ok_or_else(missing_buffers)?;
    for (l, lo) in lay.ssd_layers.iter().enumerate() {
        let (before, after) = resid.split_at_mut(l + 1);
        block_forward(
            e,
            lo,
            (p, pb),
            dm,
            (&before[l], Some(&mut after[0])),
            (acts.slot_mut(l), scan),
            (xn, g),
        )?;
        acts.resident = Some(l);
        *xn_of = Some(l);
    }
    Ok(())
}

/// One Mamba-2 block's forward pass from `x_in` (the module docs): its
/// activations into `a` (the scan's scratch in `scan`) and, when `x_out` is
/// given, its output into `x_out`; without it, the recomputation of the
/// activations alone (`--recompute`: the same kernels on the same input,
/// the same bits). `xn` and `gn` are the shared norm output buffers
/// ([`Workspace::xn`], [`Workspace::g`]).
#[allow(clippy::too_many_arguments)]
fn block_forward(
    e: &Engine,
    lo: &SsdLayerOffsets,
    (p, pb): (&CudaSlice<f32>, Option<&CudaSlice<u16>>),
    dm: Dims,
    (x_in, x_out): (&CudaSlice<f32>, Option<&mut CudaSlice<f32>>),
    (a, scan): (&mut SsdActs, &mut SsdScanScratch),
    (xn, gn): (&mut ActBuf, &mut ActBuf),
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
        ssd: shape,
    } = dm;
    let (s, kr) = (&e.stream, &e.kernels);
    let wv = |range: &std::ops::Range<usize>| p.slice(range.clone());

    block_norm(e, &lo.norm, p, (m, d), x_in, xn, &mut a.rstd)?;
    e.blas.gemm_into(
        "in_proj",
        m,
        w,
        d,
        op(xn.elems(), d),
        op_t(&wv(&lo.in_proj), d).with_bf16(half(pb, &lo.in_proj)),
        0.0,
        a.zx.gemm_out(),
        w,
    )?;
    let xbc = a.zx.view_from(di);
    kr.conv_fwd(
        s,
        xbc.stored(),
        w,
        &wv(&lo.conv_w),
        &wv(&lo.conv_b),
        a.uc.produce(),
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
    let dt_raw = a.zx.view_from(di + cd);
    kr.group_bcast(s, dt_raw.stored(), &mut a.dt.as_view_mut(), dt_cols)?;
    kr.dt_softplus(s, &mut a.dt.as_view_mut(), None, &wv(&lo.dt_bias), m, h)?;

    let (uc, dt) = (a.uc.view(), a.dt.as_view());
    let (a_log, dskip) = (wv(&lo.a_log), wv(&lo.d));
    let z = a.zx.view();
    kr.ssd_forward(
        s,
        e.ssd_products,
        shape,
        ssd_inputs((uc.stored(), &dt), (&a_log, &dskip), cd),
        &mut scan.views(),
        SsdForward {
            z: z.stored(),
            ldz: w,
            y: a.y.produce(),
            gate: a.g.produce(),
        },
    )?;
    kr.rmsnorm_fwd(
        s,
        a.g.view().stored(),
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
    let dm = Dims::of(cfg, shape.batch, shape.seq_len)?;
    let Dims {
        m,
        t,
        d,
        e: di,
        h,
        k,
        cd,
        w,
        ssd: sshape,
    } = dm;
    let hp = di / h.max(1);
    let (s, kr) = (&e.stream, &e.kernels);
    let wv = |range: &std::ops::Range<usize>| p.slice(range.clone());
    let Workspace {
        resid,
        xn,
        xn_of,
        g: gn,
        ssd,
        dres,
        dres_h,
        dout: dgn,
        dy,
        dxn,
        colsum,
        ..
    } = ws;
    let SsdBufs {
        acts,
        scan,
        grads: block_grads,
    } = ssd.as_mut().ok_or_else(missing_buffers)?;
    let SsdGradBufs {
        dy_h,
        duc,
        dd_e,
        dzx,
        dzx_h,
        rstd_again,
    } = block_grads;
    for (l, lo) in lay.ssd_layers.iter().enumerate().rev() {
        if acts.shared() && acts.resident != Some(l) {
            // --recompute: this block's activations again, from its input.
            block_forward(
                e,
                lo,
                (p, pb),
                dm,
                (&resid[l], None),
                (acts.slot_mut(l), scan),
                (xn, gn),
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
            a.g.view().stored(),
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
        let (gv, rstd_g) = (a.g.view(), a.rstd_g.as_view());
        kr.colsum(
            s,
            ColSum::ProductRowScaled {
                a: &dgn.as_view(),
                lda: di,
                b: gv.stored(),
                ldb: di,
                row_scale: &rstd_g,
            },
            m,
            di,
            &mut colsum.as_view_mut(),
            &mut grads.slice_mut(g(&lo.norm_gated)),
        )?;
        let (y, zx) = (a.y.view(), a.zx.view());
        kr.gated_norm_bwd(
            s,
            &dgn.as_view(),
            gv.stored(),
            &wv(&lo.norm_gated),
            &rstd_g,
            y.stored(),
            zx.stored(),
            w,
            match dy_h.as_mut() {
                Some(h) => Store::Bf16(h.as_view_mut()),
                None => Store::F32(dy.as_view_mut()),
            },
            dzx_cols(dzx, dzx_h, 0),
            m,
            di,
        )?;

        // The scan: D's gradient per head (its column sums over x, then
        // summed per head), then dx dB dC into duc, d dt_raw into zx's dt
        // columns and dA_log.
        let (uc, dtv) = (a.uc.view(), a.dt.as_view());
        let (dy_f, dy_hv) = (dy.as_view(), dy_h.as_ref().map(|h| h.as_view()));
        let dyv = match &dy_hv {
            Some(h) => Stored::Bf16(h),
            None => Stored::F32(&dy_f),
        };
        kr.colsum(
            s,
            ColSum::Product {
                a: dyv,
                lda: di,
                b: uc.stored(),
                ldb: cd,
            },
            m,
            di,
            &mut colsum.as_view_mut(),
            &mut dd_e.as_view_mut(),
        )?;
        let skip = GroupShape::dense(1, h, hp);
        kr.group_sum(s, &dd_e.as_view(), &mut grads.slice_mut(g(&lo.d)), skip)?;
        let (a_log, dskip) = (wv(&lo.a_log), wv(&lo.d));
        kr.ssd_backward(
            s,
            e.ssd_products,
            sshape,
            ssd_inputs((uc.stored(), &dtv), (&a_log, &dskip), cd),
            &mut scan.views(),
            SsdBackward {
                dy: dyv,
                dxbc: &mut duc.as_view_mut(),
                lddx: cd,
                ddt_raw: match dzx_h.as_mut() {
                    Some(h) => Store::Both(dzx.slice_mut(di + cd..), h.slice_mut(di + cd..)),
                    None => Store::F32(dzx.slice_mut(di + cd..)),
                },
                ld_ddt: w,
                da_log: &mut grads.slice_mut(g(&lo.a_log)),
            },
        )?;
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

        // Conv + SiLU over x, B, C, one pass: duc (the scan's dx | dB dC) to
        // the input gradient in zx's conv columns and the conv's weight and
        // bias gradients.
        let (wr, br) = (g(&lo.conv_w), g(&lo.conv_b));
        if wr.end != br.start {
            return Err(TrainError::Config(format!(
                "layer {l}: conv1d.weight {wr:?} must be followed by conv1d.bias {br:?} in the \
                 arena"
            )));
        }
        kr.conv_bwd(
            s,
            a.zx.view_from(di).stored(),
            w,
            &wv(&lo.conv_w),
            &wv(&lo.conv_b),
            &duc.as_view(),
            dzx_cols(dzx, dzx_h, di),
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
        let dzx_hv = dzx_h.as_ref().map(|h| h.as_view());
        e.blas.gemm(
            "in_proj dW",
            w,
            d,
            m,
            dzx_operand(&dzx_v, &dzx_hv, w, op_t),
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
            dzx_operand(&dzx_v, &dzx_hv, w, op),
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

/// in_proj's output gradient from column `start` on, for a kernel that
/// makes those columns: in bf16 runs (`dzx_h` given) its bf16 rounding
/// alone, which only in_proj's two GEMMs read (the bits a cast of the f32
/// values gives, without the cast pass), else the f32 values.
fn dzx_cols<'b>(
    dzx: &'b mut CudaSlice<f32>,
    dzx_h: &'b mut Option<CudaSlice<u16>>,
    start: usize,
) -> Store<'b> {
    match dzx_h {
        Some(h) => Store::Bf16(h.slice_mut(start..)),
        None => Store::F32(dzx.slice_mut(start..)),
    }
}

/// in_proj's output gradient as its GEMMs read it (`make`: [`op`] or
/// [`op_t`]): the bf16 copy its producers wrote in bf16 runs, else the f32
/// values.
fn dzx_operand<'b>(
    f32s: &CudaView<'b, f32>,
    h: &Option<CudaView<'b, u16>>,
    ld: usize,
    make: fn(Elems<'b>, usize) -> Operand<'b>,
) -> Operand<'b> {
    match h {
        Some(h) => make(Elems::Bf16(h.slice(..)), ld),
        None => make(Elems::F32(f32s.slice(..)), ld),
    }
}

fn missing_buffers() -> TrainError {
    TrainError::Cuda {
        what: "running a Mamba-2 block".into(),
        detail: "the workspace has no Mamba-2 buffers (it was built for Mamba-1)".into(),
    }
}
