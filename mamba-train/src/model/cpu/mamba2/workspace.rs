//! The buffers of the Mamba-2 passes ([`Workspace`]) and the sizes of one
//! call ([`Dims`]).

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
    pub(super) v: usize,
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
            v: cfg.vocab_size,
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

/// Every buffer of a pass, kept between calls; each is resized to the
/// call's shapes and fully overwritten before it is read.
#[derive(Default)]
pub(crate) struct Workspace<F> {
    pub(super) layers: Vec<LayerActs<F>>,
    /// `xs[0]` = embeddings, `xs[i+1]` = output of block i.
    pub(super) xs: Vec<Vec<F>>,
    pub(super) rstd_f: Vec<F>,
    pub(super) xf: Vec<F>,
    /// `[T, vocab]` after a forward.
    pub(crate) logits: Vec<F>,
    pub(super) dlogits: Vec<F>,
    pub(super) dxf: Vec<F>,
    pub(super) dx: Vec<F>,
    pub(super) dgn: Vec<F>,
    pub(super) dg: Vec<F>,
    pub(super) dy: Vec<F>,
    pub(super) dzx: Vec<F>,
    pub(super) du: Vec<F>,
    pub(super) ddt: Vec<F>,
    pub(super) dxn: Vec<F>,
    pub(super) da_log: Vec<F>,
    pub(super) dd: Vec<F>,
    pub(super) a: Vec<F>,
    pub(super) panels: Vec<F>,
    pub(super) conv_wt: Vec<F>,
}

impl<F: Float> Workspace<F> {
    pub(super) fn size_forward(&mut self, dm: &Dims, n_layer: usize) {
        let Dims {
            t,
            d,
            e,
            h,
            cd,
            w,
            v,
            ..
        } = *dm;
        self.layers.resize_with(n_layer, LayerActs::default);
        self.xs.resize_with(n_layer + 1, Vec::new);
        for x in &mut self.xs {
            size(x, t * d);
        }
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
        size(&mut self.rstd_f, t);
        size(&mut self.xf, t * d);
        size(&mut self.logits, t * v);
        size(&mut self.a, h);
    }

    pub(super) fn size_backward(&mut self, dm: &Dims) {
        let Dims {
            t,
            d,
            e,
            h,
            cd,
            w,
            v,
            ..
        } = *dm;
        size(&mut self.dlogits, t * v);
        for b in [&mut self.dxf, &mut self.dx, &mut self.dxn] {
            size(b, t * d);
        }
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
