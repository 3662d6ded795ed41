//! The Mamba-2 blocks' buffers ([`Mamba2Acts`], the architecture's part of
//! the frame's `Workspace`) and the sizes of one call ([`Dims`]).

use super::super::conv::ConvDims;
use super::super::float::Float;
use super::super::workspace::size;
use super::ssd::SsdDims;
use crate::config::ModelConfig;

/// Sizes of one call: `t` tokens of `nseq` sequences of `l`; `e = H * P`;
/// `cd = e + 2 G N` (the conv's channels: x, B, C); `w = e + cd + H` (an
/// in_proj output row: z, x, B, C, dt).
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub(super) l: usize,
    pub(super) t: usize,
    pub(super) d: usize,
    pub(super) e: usize,
    pub(super) h: usize,
    pub(super) cd: usize,
    pub(super) w: usize,
    ssd: SsdDims,
    k: usize,
}

impl Dims {
    /// `cfg` must be a validated Mamba-2 config.
    pub(super) fn new(cfg: &ModelConfig, nseq: usize, l: usize) -> Self {
        let s = cfg
            .ssd()
            .copied()
            .unwrap_or(crate::config::SsdConfig::DEFAULT);
        let (e, n, g) = (cfg.d_inner(), cfg.d_state, s.n_groups);
        let h = cfg.num_heads();
        let cd = e + 2 * g * n;
        Dims {
            l,
            t: nseq * l,
            d: cfg.d_model,
            e,
            h,
            cd,
            w: e + cd + h,
            ssd: SsdDims {
                l,
                h,
                p: s.head_dim,
                n,
                g,
                q: s.chunk_size,
                ld_u: cd,
                b_off: e,
                c_off: e + g * n,
            },
            k: cfg.d_conv,
        }
    }
    pub(super) fn ssd(&self) -> SsdDims {
        self.ssd
    }
    /// The conv over the x, B, C columns of an in_proj row.
    pub(super) fn conv(&self) -> ConvDims {
        ConvDims {
            l: self.l,
            e: self.cd,
            k: self.k,
            ld_in: self.w,
        }
    }
    pub(super) fn k(&self) -> usize {
        self.k
    }
}

/// What one block's backward needs from its forward (its input is the
/// residual stream `xs[i]`). The scan's states are recomputed.
#[derive(Default)]
pub(super) struct LayerActs<F> {
    pub(super) rstd: Vec<F>,
    pub(super) xn: Vec<F>,
    /// in_proj output `[T, w]`: z, x, B, C, dt_raw.
    pub(super) zx: Vec<F>,
    /// conv output before / after SiLU, `[T, cd]`.
    pub(super) xc: Vec<F>,
    pub(super) u: Vec<F>,
    /// `dt_raw + dt_bias` and its softplus, `[T, H]`.
    pub(super) dtr: Vec<F>,
    pub(super) dt: Vec<F>,
    /// Scan output (with the D skip), the gated `y * silu(z)`, its RMSNorm.
    pub(super) y: Vec<F>,
    pub(super) g: Vec<F>,
    pub(super) rstd_g: Vec<F>,
    pub(super) gn: Vec<F>,
}

/// The Mamba-2 blocks' buffers: what each block's backward needs from its
/// forward, and the backward's scratch (shared by the layers, which run one
/// after another). Resized per call and overwritten before being read.
#[derive(Default)]
pub(crate) struct Mamba2Acts<F> {
    pub(super) layers: Vec<LayerActs<F>>,
    pub(super) dgn: Vec<F>,
    pub(super) dg: Vec<F>,
    pub(super) dy: Vec<F>,
    pub(super) dzx: Vec<F>,
    pub(super) du: Vec<F>,
    pub(super) ddt: Vec<F>,
    pub(super) dxn: Vec<F>,
    pub(super) da_log: Vec<F>,
    pub(super) dd: Vec<F>,
    /// One layer's `A = -exp(A_log)`, `[H]`.
    pub(super) a: Vec<F>,
    /// One layer's conv weights transposed to `[d_conv, cd]`.
    pub(super) conv_wt: Vec<F>,
}

impl<F: Float> Mamba2Acts<F> {
    pub(super) fn size_forward(&mut self, dm: &Dims, n_layer: usize) {
        let Dims {
            t, d, e, h, cd, w, ..
        } = *dm;
        self.layers.resize_with(n_layer, LayerActs::default);
        for la in &mut self.layers {
            size(&mut la.rstd, t);
            size(&mut la.rstd_g, t);
            size(&mut la.xn, t * d);
            size(&mut la.zx, t * w);
            size(&mut la.xc, t * cd);
            size(&mut la.u, t * cd);
            size(&mut la.dtr, t * h);
            size(&mut la.dt, t * h);
            for b in [&mut la.y, &mut la.g, &mut la.gn] {
                size(b, t * e);
            }
        }
        size(&mut self.a, h);
    }

    pub(super) fn size_backward(&mut self, dm: &Dims) {
        let Dims {
            t, d, e, h, cd, w, ..
        } = *dm;
        size(&mut self.dxn, t * d);
        for b in [&mut self.dgn, &mut self.dg, &mut self.dy] {
            size(b, t * e);
        }
        size(&mut self.dzx, t * w);
        size(&mut self.du, t * cd);
        size(&mut self.ddt, t * h);
        size(&mut self.da_log, h);
        size(&mut self.dd, h);
    }
}
