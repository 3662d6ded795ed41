//! The frame every CPU language model shares, forward and backward, generic
//! over [`Float`] and over the architecture's stack of residual blocks
//! ([`Blocks`]): embedding lookup; the blocks; final RMSNorm; LM head tied
//! to the embedding; mean cross-entropy.
//!
//! Written once so that Mamba-1 (`net`) and Mamba-2 (`mamba2::net`) cannot
//! drift apart in the parts they share. The orders are the Mamba-1
//! reference's, which its digest pins fix: in the backward, the head's
//! embedding gradient is written first (overwrite), the blocks run in
//! reverse, then the lookup's rows are added in ascending token order.
//!
//! Shapes (`T = nseq * l` tokens, token-major rows): residual streams `xs`
//! `[n_layer + 1][T, d_model]` (`xs[0]` the embeddings, `xs[i+1]` block i's
//! output), `xf = norm_f(xs[n_layer])`, `logits = xf . emb^T` `[T, vocab]`.

use rayon::prelude::*;

use super::float::Float;
use super::gemm::{gemm, linear_bwd, Accum, MatRef};
use super::ops::{self, TOK_CHUNK};
pub(crate) use super::workspace::Workspace;
use crate::config::{ModelConfig, RMS_EPS};
use crate::params::ParamLayout;

/// What one pass is over: the model, its weights and the batch's shape.
#[derive(Clone, Copy)]
pub(crate) struct Pass<'a, F> {
    pub(crate) cfg: &'a ModelConfig,
    pub(crate) lay: &'a ParamLayout,
    pub(crate) p: &'a [F],
    /// Sequences.
    pub(crate) nseq: usize,
    /// Tokens per sequence.
    pub(crate) l: usize,
}

impl<F> Pass<'_, F> {
    /// The RMSNorm epsilon in `F`.
    pub(crate) fn eps(&self) -> F
    where
        F: Float,
    {
        F::from_f64(RMS_EPS as f64)
    }
}

/// An architecture's stack of `n_layer` residual blocks
/// `x_{i+1} = x_i + Mixer_i(RMSNorm_i(x_i))`, with the buffers it keeps
/// between its forward and its backward (so the implementing type *is*
/// the per-architecture part of the [`Workspace`]).
///
/// Contract: [`forward`](Self::forward) reads `xs[0]` and overwrites every
/// `xs[i + 1]`; [`backward`](Self::backward), after that forward, gets
/// `dx` = d loss / d `xs[n_layer]`, overwrites every block parameter's
/// gradient in `grads` and leaves d loss / d `xs[0]` in `dx`. Neither
/// touches the frame's parameters (embedding, final norm).
pub(crate) trait Blocks<F: Float>: Default + Send {
    /// Every block forward.
    fn forward(&mut self, pass: &Pass<'_, F>, xs: &mut [Vec<F>], panels: &mut Vec<F>);

    /// Every block backward, last block first.
    fn backward(
        &mut self,
        pass: &Pass<'_, F>,
        xs: &[Vec<F>],
        dx: &mut [F],
        grads: &mut [F],
        panels: &mut Vec<F>,
    );
}

/// Forward pass over `tokens` (ids validated; `nseq * l > 0`) into `ws`;
/// the logits are left in `ws.logits`.
pub(crate) fn forward<F: Float, S: Blocks<F>>(
    pass: &Pass<'_, F>,
    tokens: &[u32],
    ws: &mut Workspace<F, S>,
) {
    let (cfg, lay, p) = (pass.cfg, pass.lay, pass.p);
    let (t, d, v) = (pass.nseq * pass.l, cfg.d_model, cfg.vocab_size);
    ws.size_forward(t, d, v, cfg.n_layer);
    let emb = &p[lay.embedding.clone()];
    ws.xs[0]
        .par_chunks_mut(TOK_CHUNK * d)
        .enumerate()
        .for_each(|(ci, xs)| {
            for (i, row) in xs.chunks_exact_mut(d).enumerate() {
                let tok = tokens[ci * TOK_CHUNK + i] as usize;
                row.copy_from_slice(&emb[tok * d..(tok + 1) * d]);
            }
        });
    ws.blocks.forward(pass, &mut ws.xs, &mut ws.panels);
    let x = &ws.xs[cfg.n_layer];
    let (eps, nf) = (pass.eps(), &p[lay.norm_f.clone()]);
    ops::rmsnorm_fwd(x, nf, eps, &mut ws.xf, &mut ws.rstd_f);
    gemm(
        MatRef::new(&ws.xf, t, d, d),
        MatRef::new(emb, v, d, d).t(),
        &mut ws.logits,
        v,
        Accum::Overwrite,
        &mut ws.panels,
    );
}

/// Mean cross-entropy of the forward pass in `ws` (0 when no target counts).
pub(crate) fn loss<F: Float, S>(ws: &Workspace<F, S>, targets: &[i32], v: usize) -> f64 {
    let count = targets.iter().filter(|&&t| t >= 0).count();
    if count == 0 {
        return 0.0;
    }
    ops::cross_entropy(&ws.logits, targets, v, None) / count as f64
}

/// Backward pass after [`forward`] filled `ws`: overwrites every element of
/// `grads` with d(mean loss)/d params and returns the mean loss. `targets`
/// are validated (index or negative = ignored).
pub(crate) fn backward<F: Float, S: Blocks<F>>(
    pass: &Pass<'_, F>,
    tokens: &[u32],
    targets: &[i32],
    ws: &mut Workspace<F, S>,
    grads: &mut [F],
) -> f64 {
    let (cfg, lay, p) = (pass.cfg, pass.lay, pass.p);
    let (t, d, v) = (pass.nseq * pass.l, cfg.d_model, cfg.vocab_size);
    let count = targets.iter().filter(|&&t| t >= 0).count();
    if count == 0 {
        grads.fill(F::ZERO);
        return 0.0;
    }
    ws.size_backward(t, d, v);
    let emb = &p[lay.embedding.clone()];
    let panels = &mut ws.panels;
    // Head: logits = xf . emb^T.
    let loss = ops::cross_entropy(&ws.logits, targets, v, Some(&mut ws.dlogits)) / count as f64;
    linear_bwd(
        MatRef::new(&ws.dlogits, t, v, v),
        MatRef::new(&ws.xf, t, d, d),
        MatRef::new(emb, v, d, d),
        &mut grads[lay.embedding.clone()],
        &mut ws.dxf,
        d,
        Accum::Overwrite,
        panels,
    );
    ops::rmsnorm_bwd(
        &ws.dxf,
        &ws.xs[cfg.n_layer],
        &ws.rstd_f,
        &p[lay.norm_f.clone()],
        &mut ws.dx,
        false,
        &mut grads[lay.norm_f.clone()],
    );
    ws.blocks.backward(pass, &ws.xs, &mut ws.dx, grads, panels);
    // Embedding lookup: rows added in ascending token order after the head
    // gradient.
    let gemb = &mut grads[lay.embedding.clone()];
    for (i, &tok) in tokens.iter().enumerate() {
        let tok = tok as usize;
        for (gv, &xv) in gemb[tok * d..(tok + 1) * d]
            .iter_mut()
            .zip(&ws.dx[i * d..(i + 1) * d])
        {
            *gv = *gv + xv;
        }
    }
    loss
}
