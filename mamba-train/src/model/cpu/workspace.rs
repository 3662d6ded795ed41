//! The buffers of the CPU model's passes ([`Workspace`]) and the sizes of
//! one call ([`Dims`]); `net` runs the passes over them.

use super::conv::ConvDims;
use super::float::Float;
use super::scan::ScanDims;
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
    pub(super) v: usize,
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
            v: cfg.vocab_size,
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

/// Every buffer of a forward and backward pass, kept between calls so a
/// training step does not allocate (and page-fault) its activations anew.
/// Each buffer is resized to the call's shapes and fully overwritten before
/// it is read, so stale contents never leak into a result.
#[derive(Default)]
pub(crate) struct Workspace<F> {
    pub(super) layers: Vec<LayerActs<F>>,
    /// Residual streams: `xs[0]` = embeddings, `xs[i+1]` = output of block i.
    pub(super) xs: Vec<Vec<F>>,
    pub(super) rstd_f: Vec<F>,
    pub(super) xf: Vec<F>,
    /// `[T, vocab]` after [`forward`].
    pub(crate) logits: Vec<F>,
    // Backward scratch.
    pub(super) dlogits: Vec<F>,
    pub(super) dxf: Vec<F>,
    pub(super) dx: Vec<F>,
    pub(super) dg: Vec<F>,
    pub(super) dy: Vec<F>,
    pub(super) dxz: Vec<F>,
    pub(super) du: Vec<F>,
    pub(super) ddt: Vec<F>,
    pub(super) ddbc: Vec<F>,
    pub(super) dxn: Vec<F>,
    pub(super) da_log: Vec<F>,
    pub(super) dd: Vec<F>,
    // Small per-layer scratch.
    pub(super) panels: Vec<F>,
    pub(super) conv_wt: Vec<F>,
}

/// Resize to `len` (contents unspecified; the caller overwrites them).
pub(super) fn size<F: Float>(v: &mut Vec<F>, len: usize) {
    v.resize(len, F::ZERO);
}

impl<F: Float> Workspace<F> {
    pub(super) fn size_forward(&mut self, dm: &Dims, n_layer: usize) {
        let Dims {
            t, d, e, v, ld_bc, ..
        } = *dm;
        self.layers.resize_with(n_layer, LayerActs::default);
        self.xs.resize_with(n_layer + 1, Vec::new);
        for x in &mut self.xs {
            size(x, t * d);
        }
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
        size(&mut self.rstd_f, t);
        size(&mut self.xf, t * d);
        size(&mut self.logits, t * v);
    }

    pub(super) fn size_backward(&mut self, dm: &Dims) {
        let Dims {
            t,
            d,
            e,
            n,
            v,
            ld_bc,
            ..
        } = *dm;
        size(&mut self.dlogits, t * v);
        for b in [&mut self.dxf, &mut self.dx, &mut self.dxn] {
            size(b, t * d);
        }
        for b in [&mut self.dg, &mut self.dy, &mut self.du, &mut self.ddt] {
            size(b, t * e);
        }
        size(&mut self.dxz, t * 2 * e);
        size(&mut self.ddbc, t * ld_bc);
        size(&mut self.da_log, e * n);
        size(&mut self.dd, e);
    }
}
