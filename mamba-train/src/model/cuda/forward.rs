//! The forward pass on the device: embedding, `n_layer` blocks of
//! `x + Mixer(RMSNorm(x))`, final RMSNorm (the tied LM head and the loss
//! follow in [`super::head`], over chunks of rows). Every activation the
//! backward pass needs is left in the [`Workspace`].
//!
//! Per block (rows `M = batch * seq_len`, `E = d_inner`, `R = dt_rank`,
//! `ldbc = R + 2 d_state`):
//! ```text
//! xn  = RMSNorm(x_in)                    kernel   [M, d]    (one shared buffer)
//! xz  = xn . W_in^T                      cuBLAS   [M, 2E]   (x | z)
//! u   = SiLU(conv1d(x) + b)              kernel   [M, E]
//! dbc = u . W_x^T                        cuBLAS   [M, ldbc] (dt_raw | B | C)
//! dt  = softplus(dt_raw . W_dt^T + b_dt) cuBLAS + kernel [M, E]
//! y, g = scan(u, dt, B, C, A, D), y SiLU(z)   kernels [M, E]  (g: one shared buffer)
//! x_out = x_in + g . W_out^T             copy + cuBLAS (beta = 1)
//! ```
//! `xn` and `g` are not kept per block: the backward makes them again with
//! the same bits ([`super::workspace`]'s docs). Mamba-2 blocks are
//! [`super::ssd`]'s, around the same embedding and final norm.

use cudarc::driver::CudaSlice;
use kernels::mamba::{ScanForward, ScanInputs, ScanShape, Store, Stored};

use super::blas::{Elems, Operand};
use super::workspace::{ActBuf, LayerActs, Workspace};
use super::Engine;
use crate::config::{ModelConfig, RMS_EPS};
use crate::error::{Result, TrainError};
use crate::params::{LayerOffsets, ParamLayout};

/// `A` (not transposed) with leading dimension `ld`; its elements f32 or
/// bf16 (a view of either).
pub(super) fn op<'b>(elems: impl Into<Elems<'b>>, ld: usize) -> Operand<'b> {
    Operand {
        elems: elems.into(),
        ld,
        trans: false,
    }
}

/// `A^T` (stored untransposed) with leading dimension `ld`.
pub(super) fn op_t<'b>(elems: impl Into<Elems<'b>>, ld: usize) -> Operand<'b> {
    Operand {
        elems: elems.into(),
        ld,
        trans: true,
    }
}

/// The bf16 copy of the parameter tensor `range` (bf16 runs only).
pub(super) fn half<'p>(
    pb: Option<&'p CudaSlice<u16>>,
    range: &std::ops::Range<usize>,
) -> Option<cudarc::driver::CudaView<'p, u16>> {
    pb.map(|h| h.slice(range.clone()))
}

/// bf16 runs (`dst` given): `src` cast into `dst` once, the copy every GEMM
/// reading `src` shares (see [`Workspace`]'s docs); otherwise nothing. For
/// cuBLAS outputs: a kernel's output has its copy stored by the kernel.
pub(super) fn cast_copy<'h>(
    e: &Engine,
    src: &cudarc::driver::CudaView<'_, f32>,
    dst: Option<&'h mut CudaSlice<u16>>,
) -> Result<Option<cudarc::driver::CudaView<'h, u16>>> {
    let Some(dst) = dst else {
        return Ok(None);
    };
    e.blas.cast_into(src, dst)?;
    Ok(Some(dst.slice(0..src.len())))
}

/// `h`'s first `len` elements, as the bf16 copy a kernel stored there.
pub(super) fn stored(
    h: &Option<CudaSlice<u16>>,
    len: usize,
) -> Option<cudarc::driver::CudaView<'_, u16>> {
    h.as_ref().map(|h| h.slice(0..len))
}

/// `h`'s first `len` elements, for a kernel to store a bf16 copy into.
pub(super) fn store_into(
    h: &mut Option<CudaSlice<u16>>,
    len: usize,
) -> Option<cudarc::driver::CudaViewMut<'_, u16>> {
    h.as_mut().map(|h| h.slice_mut(0..len))
}

/// A second handle on the same bf16 copy (for the second GEMM sharing it).
pub(super) fn again<'h>(
    h: &Option<cudarc::driver::CudaView<'h, u16>>,
) -> Option<cudarc::driver::CudaView<'h, u16>> {
    h.as_ref().map(|v| v.slice(..))
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
    let m = ws.batch * ws.seq_len;
    let (d, v) = (cfg.d_model, cfg.vocab_size);
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

    if ws.ssd.is_some() {
        super::ssd::forward_blocks(e, cfg, lay, (p, pb), shape, ws)?;
    }
    for (l, lo) in lay.layers.iter().enumerate() {
        let (before, after) = ws.resid.split_at_mut(l + 1);
        let acts = ws.acts.slot_mut(l);
        block_forward(
            e,
            cfg,
            lo,
            (p, pb),
            shape,
            &before[l],
            Some(&mut after[0]),
            acts,
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

    let last = &ws.resid[cfg.n_layer];
    let norm_f = p.slice(lay.norm_f.clone());
    kr.rmsnorm_fwd(
        s,
        Stored::F32(&last.as_view()),
        &norm_f,
        Store::f32_and(ws.xf.as_view_mut(), store_into(&mut ws.xf_h, m * d)),
        &mut ws.rstd_f.as_view_mut(),
        m,
        d,
        RMS_EPS,
    )?;
    Ok(())
}

/// Device scratch a block's forward pass borrows from the workspace.
pub(super) struct Scratch<'w> {
    /// The scan's per-segment scratch.
    pub scan_seg: &'w mut CudaSlice<f32>,
    /// `[rows, d_inner]` f32: dt_proj's output on its way into a `dt` kept
    /// in bf16 (the backward's `ddtr`, free whenever a forward runs).
    pub dt_raw: &'w mut CudaSlice<f32>,
    /// The block's norm output ([`Workspace::xn`]).
    pub xn: &'w mut ActBuf,
    /// The block's gated output ([`Workspace::g`]).
    pub g: &'w mut ActBuf,
}

/// The block's RMSNorm of `x_in` into `xn` (and its 1/rms into `rstd`):
/// the forward's first step, and how the backward remakes `xn` (the same
/// kernel on the same input, so the same bits).
pub(super) fn block_norm(
    e: &Engine,
    norm: &std::ops::Range<usize>,
    p: &CudaSlice<f32>,
    (m, d): (usize, usize),
    x_in: &CudaSlice<f32>,
    xn: &mut ActBuf,
    rstd: &mut CudaSlice<f32>,
) -> Result<()> {
    e.kernels.rmsnorm_fwd(
        &e.stream,
        Stored::F32(&x_in.as_view()),
        &p.slice(norm.clone()),
        xn.produce(),
        &mut rstd.as_view_mut(),
        m,
        d,
        RMS_EPS,
    )?;
    Ok(())
}

/// One block's forward pass from `x_in`: its activations into `a` (what
/// its backward pass reads) and, when `x_out` is given, its output
/// `x_in + Mixer(RMSNorm(x_in))` into `x_out`. Without `x_out` it is the
/// recomputation of the activations alone (`--recompute`): the same kernels
/// on the same input, so the same bits as the forward pass left.
#[allow(clippy::too_many_arguments)]
pub(super) fn block_forward(
    e: &Engine,
    cfg: &ModelConfig,
    lo: &LayerOffsets,
    (p, pb): (&CudaSlice<f32>, Option<&CudaSlice<u16>>),
    shape: ScanShape,
    x_in: &CudaSlice<f32>,
    x_out: Option<&mut CudaSlice<f32>>,
    a: &mut LayerActs,
    scratch: Scratch<'_>,
) -> Result<()> {
    let (t, m) = (shape.seq_len, shape.batch * shape.seq_len);
    let (d, di, r, k) = (cfg.d_model, cfg.d_inner(), cfg.dt_rank, cfg.d_conv);
    let ldbc = r + 2 * cfg.d_state;
    let (s, kr) = (&e.stream, &e.kernels);
    let w = |range: &std::ops::Range<usize>| p.slice(range.clone());

    block_norm(e, &lo.norm, p, (m, d), x_in, scratch.xn, &mut a.rstd)?;
    e.blas.gemm_into(
        "in_proj",
        m,
        2 * di,
        d,
        op(scratch.xn.elems(), d),
        op_t(&w(&lo.in_proj), d).with_bf16(half(pb, &lo.in_proj)),
        0.0,
        a.xz.gemm_out(),
        2 * di,
    )?;
    kr.conv_fwd(
        s,
        a.xz.view().stored(),
        2 * di,
        &w(&lo.conv_w),
        &w(&lo.conv_b),
        a.u.produce_with(store_into(&mut a.u_h, m * di)),
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
        op(a.u.elems(), di).with_bf16(stored(&a.u_h, m * di)),
        op_t(&w(&lo.x_proj), di).with_bf16(half(pb, &lo.x_proj)),
        0.0,
        &mut a.dbc.as_view_mut(),
        ldbc,
    )?;
    let dbc_h = cast_copy(e, &a.dbc.as_view(), a.dbc_h.as_mut())?;
    // dt_proj's f32 output goes into dt itself when it is kept in f32 (the
    // softplus then runs in place), else through the scratch.
    let (raw, dt_out) = match &mut a.dt {
        ActBuf::F32(dt) => (dt, None),
        ActBuf::Bf16(h) => (&mut *scratch.dt_raw, Some(Store::Bf16(h.as_view_mut()))),
    };
    let mut raw = raw.slice_mut(0..m * di);
    e.blas.gemm(
        "dt_proj",
        m,
        di,
        r,
        op(&a.dbc.as_view(), ldbc).with_bf16(dbc_h),
        op_t(&w(&lo.dt_proj_w), r).with_bf16(half(pb, &lo.dt_proj_w)),
        0.0,
        &mut raw,
        di,
    )?;
    kr.dt_softplus(s, &mut raw, dt_out, &w(&lo.dt_proj_b), m, di)?;

    let (u, dt, bc, a_log, dpar) = (
        a.u.view(),
        a.dt.view(),
        a.dbc.slice(r..),
        w(&lo.a_log),
        w(&lo.d),
    );
    let z = a.xz.view_from(di);
    kr.scan_forward(
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
        ScanForward {
            z: z.stored(),
            ldz: 2 * di,
            hin: &mut a.hin.as_view_mut(),
            y: a.y.produce(),
            out: scratch.g.produce(),
            scratch_seg: &mut scratch.scan_seg.as_view_mut(),
        },
    )?;

    let Some(x_out) = x_out else {
        return Ok(());
    };
    s.memcpy_dtod(x_in, x_out).map_err(|e| TrainError::Cuda {
        what: "copying the residual stream".into(),
        detail: e.to_string(),
    })?;
    e.blas.gemm(
        "out_proj",
        m,
        d,
        di,
        op(scratch.g.elems(), di),
        op_t(&w(&lo.out_proj), di).with_bf16(half(pb, &lo.out_proj)),
        1.0,
        &mut x_out.as_view_mut(),
        d,
    )?;
    Ok(())
}
