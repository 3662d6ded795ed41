//! The buffers of a CPU model's passes ([`Workspace`]): the frame's own
//! (residual streams, final norm, logits and their gradients, GEMM packing
//! scratch) and, in `blocks`, the architecture's (`acts` for Mamba-1,
//! `mamba2::acts` for Mamba-2).

use super::float::Float;

/// Every buffer of a forward and backward pass, kept between calls so a
/// training step does not allocate (and page-fault) its activations anew.
/// Each buffer is resized to the call's shapes and fully overwritten before
/// it is read, so stale contents never leak into a result.
#[derive(Default)]
pub(crate) struct Workspace<F, S> {
    /// The architecture's per-layer activations and backward scratch.
    pub(super) blocks: S,
    /// Residual streams: `xs[0]` = embeddings, `xs[i+1]` = output of block i.
    pub(super) xs: Vec<Vec<F>>,
    pub(super) rstd_f: Vec<F>,
    pub(super) xf: Vec<F>,
    /// `[T, vocab]` after a forward.
    pub(crate) logits: Vec<F>,
    // Backward scratch.
    pub(super) dlogits: Vec<F>,
    pub(super) dxf: Vec<F>,
    pub(super) dx: Vec<F>,
    /// GEMM packing scratch, shared by the frame and the blocks.
    pub(super) panels: Vec<F>,
}

/// Resize to `len` (contents unspecified; the caller overwrites them).
pub(crate) fn size<F: Float>(v: &mut Vec<F>, len: usize) {
    v.resize(len, F::ZERO);
}

impl<F: Float, S> Workspace<F, S> {
    /// The frame's forward buffers for `t` tokens of width `d`, vocab `v`.
    pub(super) fn size_forward(&mut self, t: usize, d: usize, v: usize, n_layer: usize) {
        self.xs.resize_with(n_layer + 1, Vec::new);
        for x in &mut self.xs {
            size(x, t * d);
        }
        size(&mut self.rstd_f, t);
        size(&mut self.xf, t * d);
        size(&mut self.logits, t * v);
    }

    /// The frame's backward scratch.
    pub(super) fn size_backward(&mut self, t: usize, d: usize, v: usize) {
        size(&mut self.dlogits, t * v);
        size(&mut self.dxf, t * d);
        size(&mut self.dx, t * d);
    }
}
