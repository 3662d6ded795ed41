//! Recurrent decoding on a CUDA device: [`CudaDecoder`], the [`Decoder`]
//! of the CUDA model.
//!
//! A step is `forward::forward` for one row (the same kernels and cuBLAS
//! GEMMs with `m = 1`), except that the conv and the scan read the carried
//! state through `kernels::mamba::DecodeKernels` instead of earlier rows.
//! The state stays on the device between steps (`[n_layer, d_conv - 1,
//! d_inner]` conv inputs and `[n_layer, d_inner, d_state]` SSM states, the
//! layout of [`DecodeState`]); only the token goes up and the logits come
//! down, so a step costs the same at every position. All work is on the
//! model's one stream; a step synchronizes it once, to read the logits.
//!
//! Numbers: within f32 rounding of the CPU step (`tests/cuda_decode.rs`
//! states the tolerance), not bit for bit (cuBLAS's order, `expf`).
//!
//! Mamba-2: the same step with its block (`ssd_layer_step`): the conv over
//! x, B, C, the per-head `dt`, `A`, `D` broadcast to channels for Mamba-1's
//! scan step (its SSM state `[d_inner, d_state]` per layer is the CPU's
//! per-head `[head_dim, d_state]` matrices in head order; with several
//! groups of B and C, one step per group over its heads' channels), and the
//! gated RMSNorm.
//!
//! Over 450 lines: one decoder, its buffers and the step of each
//! architecture's layer, which share the scan step and the residual +
//! out_proj helpers at the end of the file; splitting by architecture
//! would put those shared pieces and the one buffer struct in a third
//! file for no reader's gain.

use cudarc::driver::CudaSlice;
use kernels::mamba::heads::GroupShape;
use kernels::mamba::{DecodeKernels, ScanStepInputs, Store, Stored};

use super::forward::{op, op_t};
use super::workspace::ssd_in_width;
use super::{cuda, CudaModel};
use crate::config::{ModelConfig, RMS_EPS};
use crate::error::Result;
use crate::model::decode::{check_token, DecodeState, Decoder};
use crate::params::SsdLayerOffsets;

/// The CUDA model decoding one sequence, token by token.
///
/// Owns the model (its stream, kernels and cuBLAS handle), the weights on
/// the device, the recurrent state and one token's activations.
pub struct CudaDecoder {
    model: CudaModel,
    kernels: DecodeKernels,
    params: CudaSlice<f32>,
    conv: CudaSlice<f32>,
    ssm: CudaSlice<f32>,
    buf: StepBuffers,
    logits: Vec<f32>,
    pos: u64,
}

/// One token's device activations (single rows of `forward`'s buffers).
struct StepBuffers {
    tok: CudaSlice<u32>,
    x: CudaSlice<f32>,
    x_next: CudaSlice<f32>,
    xn: CudaSlice<f32>,
    rstd: CudaSlice<f32>,
    xz: CudaSlice<f32>,
    u: CudaSlice<f32>,
    dbc: CudaSlice<f32>,
    dt: CudaSlice<f32>,
    y: CudaSlice<f32>,
    g: CudaSlice<f32>,
    /// Mamba-2: dt per head (`dt` holds it per channel) and the gated
    /// norm's output.
    dt_h: CudaSlice<f32>,
    gn: CudaSlice<f32>,
    /// Mamba-2: every layer's `A_log` and `D` per channel (`[n_layer,
    /// d_inner * d_state]`, `[n_layer, d_inner]`), broadcast once from the
    /// decoder's fixed weights.
    a_log_e: CudaSlice<f32>,
    d_e: CudaSlice<f32>,
    xf: CudaSlice<f32>,
    logits: CudaSlice<f32>,
}

impl CudaDecoder {
    /// A decoder of `model` with the host weights `params` (uploaded), at
    /// position 0.
    pub fn new(model: CudaModel, params: &[f32]) -> Result<Self> {
        let params = model.upload(params)?;
        let kernels = DecodeKernels::load(model.kernels())?;
        let cfg = model.config().clone();
        let s = model.stream().clone();
        let zeros = |what: &str, n: usize| {
            s.alloc_zeros::<f32>(n.max(1))
                .map_err(|e| cuda(&format!("allocating the decoder's {what}"), e))
        };
        let (d, e) = (cfg.d_model, cfg.d_inner());
        // Mamba-2 rows are wider (in_proj: z, x B C, dt; the conv: x B C)
        // and it keeps per-channel copies of every layer's A_log and D.
        let conv_dim = DecodeState::conv_dim(&cfg);
        let (in_width, heads, ssd_layers) = match cfg.ssd() {
            Some(_) => (ssd_in_width(&cfg), cfg.num_heads(), cfg.n_layer),
            None => (2 * e, 0, 0),
        };
        let buf = StepBuffers {
            tok: s
                .alloc_zeros::<u32>(1)
                .map_err(|e| cuda("allocating the decoder's token", e))?,
            x: zeros("residual", d)?,
            x_next: zeros("residual", d)?,
            xn: zeros("norm output", d)?,
            rstd: zeros("norm scale", 1)?,
            xz: zeros("in_proj output", in_width)?,
            u: zeros("conv output", conv_dim)?,
            dbc: zeros("x_proj output", cfg.dt_rank + 2 * cfg.d_state)?,
            dt: zeros("dt", e)?,
            y: zeros("scan output", e)?,
            g: zeros("gated output", e)?,
            dt_h: zeros("dt per head", heads)?,
            gn: zeros("gated norm output", e)?,
            a_log_e: zeros("A_log per channel", ssd_layers * e * cfg.d_state)?,
            d_e: zeros("D per channel", ssd_layers * e)?,
            xf: zeros("final norm output", d)?,
            logits: zeros("logits", cfg.vocab_size)?,
        };
        let mut buf = buf;
        if cfg.ssd().is_some() {
            ssd_channel_params(&model, &params, &mut buf)?;
        }
        Ok(CudaDecoder {
            conv: zeros("conv state", DecodeState::conv_len(&cfg))?,
            ssm: zeros("SSM state", DecodeState::ssm_len(&cfg))?,
            logits: vec![0.0; cfg.vocab_size],
            model,
            kernels,
            params,
            buf,
            pos: 0,
        })
    }

    /// A decoder of `cfg` on device `ordinal` with the host weights `params`.
    pub fn on_device(cfg: ModelConfig, params: &[f32], ordinal: usize) -> Result<Self> {
        Self::new(CudaModel::new(cfg, ordinal)?, params)
    }

    /// Enqueue one step for `token` (already validated); the logits end in
    /// `buf.logits`.
    fn enqueue_step(&mut self, token: u32) -> Result<()> {
        let CudaDecoder {
            model,
            kernels: dk,
            params: p,
            conv,
            ssm,
            buf: b,
            pos,
            ..
        } = self;
        let (cfg, lay, eng) = (&model.cfg, &model.layout, &model.engine);
        let (s, kr) = (&eng.stream, &eng.kernels);
        let (d, e, n, r, k, v) = (
            cfg.d_model,
            cfg.d_inner(),
            cfg.d_state,
            cfg.dt_rank,
            cfg.d_conv,
            cfg.vocab_size,
        );
        let ldbc = r + 2 * n;
        let kk = k - 1;
        let filled = (*pos).min(kk as u64) as usize;
        s.memcpy_htod(&[token], &mut b.tok)
            .map_err(|err| cuda("uploading the token", err))?;
        let emb = p.slice(lay.embedding.clone());
        kr.embed_fwd(s, &b.tok.as_view(), &emb, &mut b.x.as_view_mut(), d, v)?;
        for (i, lo) in lay.ssd_layers.iter().enumerate() {
            ssd_layer_step(model, dk, p, (i, lo), (conv, ssm), b, filled)?;
        }
        for (i, lo) in lay.layers.iter().enumerate() {
            let w = |range: &std::ops::Range<usize>| p.slice(range.clone());
            kr.rmsnorm_fwd(
                s,
                Stored::F32(&b.x.as_view()),
                &w(&lo.norm),
                Store::F32(b.xn.as_view_mut()),
                &mut b.rstd.as_view_mut(),
                1,
                d,
                RMS_EPS,
            )?;
            let in_proj = w(&lo.in_proj);
            eng.blas.gemm(
                "decode in_proj",
                1,
                2 * e,
                d,
                op(&b.xn.as_view(), d),
                op_t(&in_proj, d),
                0.0,
                &mut b.xz.as_view_mut(),
                2 * e,
            )?;
            dk.conv_step(
                s,
                &b.xz.slice(..e),
                &w(&lo.conv_w),
                &w(&lo.conv_b),
                &mut conv.slice_mut(i * kk * e..(i + 1) * kk * e),
                &mut b.u.as_view_mut(),
                e,
                k,
                filled,
            )?;
            let x_proj = w(&lo.x_proj);
            eng.blas.gemm(
                "decode x_proj",
                1,
                ldbc,
                e,
                op(&b.u.as_view(), e),
                op_t(&x_proj, e),
                0.0,
                &mut b.dbc.as_view_mut(),
                ldbc,
            )?;
            let dt_proj = w(&lo.dt_proj_w);
            eng.blas.gemm(
                "decode dt_proj",
                1,
                e,
                r,
                op(&b.dbc.as_view(), ldbc),
                op_t(&dt_proj, r),
                0.0,
                &mut b.dt.as_view_mut(),
                e,
            )?;
            kr.dt_softplus(s, &mut b.dt.as_view_mut(), None, &w(&lo.dt_proj_b), 1, e)?;
            let (u, dt, bc, a_log, dpar, z) = (
                b.u.as_view(),
                b.dt.as_view(),
                b.dbc.slice(r..),
                w(&lo.a_log),
                w(&lo.d),
                b.xz.slice(e..),
            );
            let inputs = ScanStepInputs {
                u: &u,
                dt: &dt,
                bc: &bc,
                a_log: &a_log,
                d: &dpar,
                z: &z,
            };
            scan_step(dk, s, inputs, ssm, (&mut b.y, &mut b.g), (i, e, n), 0..e)?;
            residual_out_proj(model, (&b.x, &mut b.x_next), &b.g, &w(&lo.out_proj), i)?;
            std::mem::swap(&mut b.x, &mut b.x_next);
        }
        kr.rmsnorm_fwd(
            s,
            Stored::F32(&b.x.as_view()),
            &p.slice(lay.norm_f.clone()),
            Store::F32(b.xf.as_view_mut()),
            &mut b.rstd.as_view_mut(),
            1,
            d,
            RMS_EPS,
        )?;
        eng.blas.gemm(
            "decode lm_head",
            1,
            v,
            d,
            op(&b.xf.as_view(), d),
            op_t(&emb, d),
            0.0,
            &mut b.logits.as_view_mut(),
            v,
        )?;
        Ok(())
    }
}

impl Decoder for CudaDecoder {
    fn config(&self) -> &ModelConfig {
        self.model.config()
    }

    fn device_name(&self) -> &'static str {
        "cuda"
    }

    fn reset(&mut self) -> Result<()> {
        let s = self.model.stream();
        s.memset_zeros(&mut self.conv)
            .map_err(|e| cuda("clearing the conv state", e))?;
        s.memset_zeros(&mut self.ssm)
            .map_err(|e| cuda("clearing the SSM state", e))?;
        self.pos = 0;
        Ok(())
    }

    fn step(&mut self, token: u32) -> Result<&[f32]> {
        check_token(self.model.config(), token, self.pos)?;
        self.enqueue_step(token)?;
        let s = self.model.stream();
        s.memcpy_dtoh(&self.buf.logits, &mut self.logits)
            .map_err(|e| cuda("downloading the logits", e))?;
        s.synchronize()
            .map_err(|e| cuda("waiting for the decode step", e))?;
        self.pos += 1;
        Ok(&self.logits)
    }

    fn position(&self) -> u64 {
        self.pos
    }

    fn snapshot(&mut self) -> Result<DecodeState> {
        let cfg = self.model.config();
        let (nc, ns) = (DecodeState::conv_len(cfg), DecodeState::ssm_len(cfg));
        let s = self.model.stream();
        let mut conv = s
            .clone_dtoh(&self.conv)
            .map_err(|e| cuda("downloading the conv state", e))?;
        let mut ssm = s
            .clone_dtoh(&self.ssm)
            .map_err(|e| cuda("downloading the SSM state", e))?;
        // Buffers hold at least one element (CUDA allocations are never
        // empty); the state is the first `len` of each.
        conv.truncate(nc);
        ssm.truncate(ns);
        Ok(DecodeState { conv, ssm })
    }

    fn restore(&mut self, state: &DecodeState, position: u64) -> Result<()> {
        state.check_shape(self.model.config())?;
        let s = self.model.stream();
        if !state.conv.is_empty() {
            s.memcpy_htod(&state.conv, &mut self.conv.slice_mut(..state.conv.len()))
                .map_err(|e| cuda("uploading the conv state", e))?;
        }
        s.memcpy_htod(&state.ssm, &mut self.ssm.slice_mut(..state.ssm.len()))
            .map_err(|e| cuda("uploading the SSM state", e))?;
        s.synchronize()
            .map_err(|e| cuda("waiting for the state upload", e))?;
        self.pos = position;
        Ok(())
    }
}

/// Mamba-2: every layer's `A_log` and `D` of `params` per channel into
/// `buf` (exact broadcasts; the weights are the decoder's and do not
/// change).
fn ssd_channel_params(
    model: &CudaModel,
    params: &CudaSlice<f32>,
    buf: &mut StepBuffers,
) -> Result<()> {
    let (cfg, lay, eng) = (&model.cfg, &model.layout, &model.engine);
    let (s, kr) = (&eng.stream, &eng.kernels);
    let (e, n, h) = (cfg.d_inner(), cfg.d_state, cfg.num_heads());
    let hp = e / h.max(1);
    for (i, lo) in lay.ssd_layers.iter().enumerate() {
        kr.group_bcast(
            s,
            Stored::F32(&params.slice(lo.a_log.clone())),
            &mut buf.a_log_e.slice_mut(i * e * n..(i + 1) * e * n),
            GroupShape::dense(1, h, hp * n),
        )?;
        kr.group_bcast(
            s,
            Stored::F32(&params.slice(lo.d.clone())),
            &mut buf.d_e.slice_mut(i * e..(i + 1) * e),
            GroupShape::dense(1, h, hp),
        )?;
    }
    Ok(())
}

/// One Mamba-2 layer of a decode step: `b.x` (the residual) to `b.x` again,
/// advancing layer `i`'s slices of the conv and SSM states (`filled`: conv
/// inputs already in the window).
fn ssd_layer_step(
    model: &CudaModel,
    dk: &DecodeKernels,
    p: &CudaSlice<f32>,
    (i, lo): (usize, &SsdLayerOffsets),
    (conv, ssm): (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
    b: &mut StepBuffers,
    filled: usize,
) -> Result<()> {
    let (cfg, eng) = (&model.cfg, &model.engine);
    let (s, kr) = (&eng.stream, &eng.kernels);
    let (d, e, n, k) = (cfg.d_model, cfg.d_inner(), cfg.d_state, cfg.d_conv);
    let (h, cd, w) = (
        cfg.num_heads(),
        DecodeState::conv_dim(cfg),
        ssd_in_width(cfg),
    );
    let (hp, kk) = (e / h.max(1), k - 1);
    let wv = |range: &std::ops::Range<usize>| p.slice(range.clone());
    kr.rmsnorm_fwd(
        s,
        Stored::F32(&b.x.as_view()),
        &wv(&lo.norm),
        Store::F32(b.xn.as_view_mut()),
        &mut b.rstd.as_view_mut(),
        1,
        d,
        RMS_EPS,
    )?;
    eng.blas.gemm(
        "decode in_proj",
        1,
        w,
        d,
        op(&b.xn.as_view(), d),
        op_t(&wv(&lo.in_proj), d),
        0.0,
        &mut b.xz.as_view_mut(),
        w,
    )?;
    dk.conv_step(
        s,
        &b.xz.slice(e..e + cd),
        &wv(&lo.conv_w),
        &wv(&lo.conv_b),
        &mut conv.slice_mut(i * kk * cd..(i + 1) * kk * cd),
        &mut b.u.as_view_mut(),
        cd,
        k,
        filled,
    )?;
    kr.group_bcast(
        s,
        Stored::F32(&b.xz.slice(e + cd..e + cd + h)),
        &mut b.dt_h.as_view_mut(),
        GroupShape::dense(1, h, 1),
    )?;
    kr.dt_softplus(s, &mut b.dt_h.as_view_mut(), None, &wv(&lo.dt_bias), 1, h)?;
    kr.group_bcast(
        s,
        Stored::F32(&b.dt_h.as_view()),
        &mut b.dt.as_view_mut(),
        GroupShape::dense(1, h, hp),
    )?;
    // One scan step per group of B and C over its heads' channels; with
    // several groups, the group's B and C are copied side by side first
    // (the step reads B then C; with one they already are).
    let groups = cfg.ssd().map_or(1, |c| c.n_groups).max(1);
    let per = e / groups;
    for gi in 0..groups {
        let ch = gi * per..(gi + 1) * per;
        if groups > 1 {
            for (from, to) in [(e + gi * n, 0), (e + (groups + gi) * n, n)] {
                s.memcpy_dtod(&b.u.slice(from..from + n), &mut b.dbc.slice_mut(to..to + n))
                    .map_err(|err| cuda(&format!("staging group {gi}'s B and C"), err))?;
            }
        }
        let (u, dt, a_log, dpar, z) = (
            b.u.slice(ch.clone()),
            b.dt.slice(ch.clone()),
            b.a_log_e
                .slice(i * e * n + ch.start * n..i * e * n + ch.end * n),
            b.d_e.slice(i * e + ch.start..i * e + ch.end),
            b.xz.slice(ch.clone()),
        );
        let bc = if groups > 1 {
            b.dbc.slice(..2 * n)
        } else {
            b.u.slice(e..e + 2 * n)
        };
        let inputs = ScanStepInputs {
            u: &u,
            dt: &dt,
            bc: &bc,
            a_log: &a_log,
            d: &dpar,
            z: &z,
        };
        scan_step(dk, s, inputs, ssm, (&mut b.y, &mut b.g), (i, e, n), ch)?;
    }
    kr.rmsnorm_fwd(
        s,
        Stored::F32(&b.g.as_view()),
        &wv(&lo.norm_gated),
        Store::F32(b.gn.as_view_mut()),
        &mut b.rstd.as_view_mut(),
        1,
        e,
        RMS_EPS,
    )?;
    residual_out_proj(model, (&b.x, &mut b.x_next), &b.gn, &wv(&lo.out_proj), i)?;
    std::mem::swap(&mut b.x, &mut b.x_next);
    Ok(())
}

/// Layer `i`'s scan step of either architecture over the channels `ch`
/// (`inputs` holds theirs): advances their slice of the SSM state `ssm`
/// (`[n_layer, e, n]`) and writes their `y` and gated output `g`.
fn scan_step(
    dk: &DecodeKernels,
    s: &cudarc::driver::CudaStream,
    inputs: ScanStepInputs<'_>,
    ssm: &mut CudaSlice<f32>,
    (y, g): (&mut CudaSlice<f32>, &mut CudaSlice<f32>),
    (i, e, n): (usize, usize, usize),
    ch: std::ops::Range<usize>,
) -> Result<()> {
    let state = i * e * n;
    dk.scan_step(
        s,
        inputs,
        &mut ssm.slice_mut(state + ch.start * n..state + ch.end * n),
        &mut y.slice_mut(ch.clone()),
        &mut g.slice_mut(ch.clone()),
        ch.len(),
        n,
    )?;
    Ok(())
}

/// A layer's output, either architecture: `x_next = x + input . W_out^T`
/// (`input` is out_proj's input row, `d_inner` wide; layer `i` names a
/// failed copy).
fn residual_out_proj(
    model: &CudaModel,
    (x, x_next): (&CudaSlice<f32>, &mut CudaSlice<f32>),
    input: &CudaSlice<f32>,
    w_out: &cudarc::driver::CudaView<'_, f32>,
    i: usize,
) -> Result<()> {
    let (d, e) = (model.cfg.d_model, model.cfg.d_inner());
    let eng = &model.engine;
    eng.stream
        .memcpy_dtod(x, x_next)
        .map_err(|err| cuda(&format!("copying the residual of layer {i}"), err))?;
    eng.blas.gemm(
        "decode out_proj",
        1,
        d,
        e,
        op(&input.as_view(), e),
        op_t(w_out, e),
        1.0,
        &mut x_next.as_view_mut(),
        d,
    )?;
    Ok(())
}
