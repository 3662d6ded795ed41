//! The Mamba-1 blocks' buffers ([`Mamba1Acts`], the architecture's part of
//! the frame's `Workspace`) and the sizes of one call ([`Dims`]); `net`
//! runs the blocks over them.

use super::conv::ConvDims;
use super::float::Float;
use super::scan::ScanDims;
use super::workspace::size;
use crate::config::ModelConfig;

/// Sizes of one call.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub(super) l: usize,
    pub(super) t: usize,
    pub(super) d: usize,
    pub(super) e: usize,
    pub(super) n: usize,
    pub(super) r: usize,
    pub(super) k: usize,
    pub(super) ld_bc: usize,
}

impl Dims {
    pub(super) fn new(cfg: &ModelConfig, nseq: usize, l: usize) -> Self {
        let (r, n) = (cfg.dt_rank, cfg.d_state);
        Dims {
            l,
            t: nseq * l,
            d: cfg.d_model,
            e: cfg.d_inner(),
            n,
            r,
            k: cfg.d_conv,
            ld_bc: r + 2 * n,
        }
    }
    pub(super) fn scan(&self) -> ScanDims {
        ScanDims {
            l: self.l,
            e: self.e,
            n: self.n,
            ld_bc: self.ld_bc,
            b_off: self.r,
            c_off: self.r + self.n,
        }
    }
    pub(super) fn conv(&self) -> ConvDims {
        ConvDims {
            l: self.l,
            e: self.e,
            k: self.k,
            ld_in: 2 * self.e,
        }
    }
}

/// What one block's backward needs from its forward (its input is the
/// workspace's residual stream `xs[i]`).
#[derive(Default)]
pub(super) struct LayerActs<F> {
    pub(super) rstd: Vec<F>,
    pub(super) xn: Vec<F>,
    pub(super) xz: Vec<F>,
    pub(super) xc: Vec<F>,
    pub(super) u: Vec<F>,
    pub(super) dbc: Vec<F>,
    pub(super) dtr: Vec<F>,
    pub(super) dt: Vec<F>,
    pub(super) y: Vec<F>,
    pub(super) g: Vec<F>,
}

/// The Mamba-1 blocks' buffers: what each block's backward needs from its
/// forward, and the backward's scratch (shared by the layers, which run one
/// after another). Resized per call and overwritten before being read.
#[derive(Default)]
pub(crate) struct Mamba1Acts<F> {
    pub(super) layers: Vec<LayerActs<F>>,
    pub(super) dg: Vec<F>,
    pub(super) dy: Vec<F>,
    pub(super) dxz: Vec<F>,
    pub(super) du: Vec<F>,
    pub(super) ddt: Vec<F>,
    pub(super) ddbc: Vec<F>,
    pub(super) dxn: Vec<F>,
    pub(super) da_log: Vec<F>,
    pub(super) dd: Vec<F>,
    /// One layer's conv weights transposed to `[d_conv, d_inner]`.
    pub(super) conv_wt: Vec<F>,
}

impl<F: Float> Mamba1Acts<F> {
    pub(super) fn size_forward(&mut self, dm: &Dims, n_layer: usize) {
        let Dims { t, d, e, ld_bc, .. } = *dm;
        self.layers.resize_with(n_layer, LayerActs::default);
        for la in &mut self.layers {
            size(&mut la.rstd, t);
            size(&mut la.xn, t * d);
            size(&mut la.xz, t * 2 * e);
            for b in [
                &mut la.xc,
                &mut la.u,
                &mut la.dtr,
                &mut la.dt,
                &mut la.y,
                &mut la.g,
            ] {
                size(b, t * e);
            }
            size(&mut la.dbc, t * ld_bc);
        }
    }

    pub(super) fn size_backward(&mut self, dm: &Dims) {
        let Dims {
            t, d, e, n, ld_bc, ..
        } = *dm;
        size(&mut self.dxn, t * d);
        for b in [&mut self.dg, &mut self.dy, &mut self.du, &mut self.ddt] {
            size(b, t * e);
        }
        size(&mut self.dxz, t * 2 * e);
        size(&mut self.ddbc, t * ld_bc);
        size(&mut self.da_log, e * n);
        size(&mut self.dd, e);
    }
}
