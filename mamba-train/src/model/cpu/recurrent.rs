//! The frame of recurrent decoding on the CPU, written once for every
//! architecture and generic over [`Float`]: [`Recurrent`] holds the weights,
//! the recurrent state and one token's frame buffers, and runs a step as
//! embedding row -> the architecture's blocks ([`StepBlocks`]) -> final
//! RMSNorm -> tied LM head, with the training forward's functions in its
//! order (`frame::forward`). The architectures' block steps are `decode`
//! (Mamba-1) and `mamba2::decode` (Mamba-2).
//!
//! The state is kept in the layout of [`DecodeState`] (per layer the conv
//! window, oldest row first, then the SSM state), so a snapshot is a copy,
//! and its size is [`DecodeState::len_for`] at every position.

use super::float::Float;
use super::gemm::{gemm, Accum, MatRef};
use super::ops::{self, silu};
use crate::config::{ModelConfig, RMS_EPS};
use crate::error::Result;
use crate::model::decode::{check_token, DecodeState};
use crate::params::ParamLayout;

/// An architecture's blocks for one token, with whatever it derives from
/// the weights once (`A`, transposed conv weights) and one token's buffers.
///
/// Contract: [`step`](Self::step) maps the residual row through every
/// block in place, reading and advancing each layer's part of the state
/// ([`StepState`]).
pub(crate) trait StepBlocks<F>: Send {
    /// One token through every block.
    fn step(&mut self, lay: &ParamLayout, p: &[F], st: StepState<'_, F>, panels: &mut Vec<F>);
}

/// What a step of the blocks reads and advances.
pub(crate) struct StepState<'a, F> {
    /// The residual row (`d_model`), in and out.
    pub(crate) x: &'a mut Vec<F>,
    /// Every layer's conv window, laid out as [`DecodeState::conv`].
    pub(crate) conv: &'a mut [F],
    /// Every layer's SSM state, laid out as [`DecodeState::ssm`].
    pub(crate) ssm: &'a mut [F],
    /// The newest conv-window rows that hold inputs of this sequence
    /// (`min(position, d_conv - 1)`): the older ones are never read.
    pub(crate) filled: usize,
}

/// One sequence's recurrent decoder on the CPU, in `F`.
pub(crate) struct Recurrent<F> {
    pub(crate) cfg: ModelConfig,
    layout: ParamLayout,
    pub(crate) params: Vec<F>,
    blocks: Box<dyn StepBlocks<F>>,
    /// `[n_layer, d_conv - 1, conv channels]`, as [`DecodeState::conv`].
    pub(crate) conv: Vec<F>,
    /// `[n_layer, d_inner, d_state]`, as [`DecodeState::ssm`].
    pub(crate) ssm: Vec<F>,
    pub(crate) pos: u64,
    x: Vec<F>,
    xf: Vec<F>,
    rstd: Vec<F>,
    logits: Vec<F>,
    panels: Vec<F>,
}

impl<F: Float> Recurrent<F> {
    /// A decoder of `cfg` (validated) with weights `params` (checked
    /// against the layout) at position 0; `blocks` builds the
    /// architecture's block step from them.
    pub(crate) fn new(
        cfg: ModelConfig,
        params: Vec<F>,
        blocks: impl FnOnce(&ModelConfig, &ParamLayout, &[F]) -> Box<dyn StepBlocks<F>>,
    ) -> Result<Self> {
        cfg.validate()?;
        let layout = ParamLayout::new(&cfg);
        crate::model::check_arena_len(&cfg, &layout, "params arena", params.len())?;
        let blocks = blocks(&cfg, &layout, &params);
        let d = cfg.d_model;
        Ok(Recurrent {
            conv: vec![F::ZERO; DecodeState::conv_len(&cfg)],
            ssm: vec![F::ZERO; DecodeState::ssm_len(&cfg)],
            pos: 0,
            x: vec![F::ZERO; d],
            xf: vec![F::ZERO; d],
            rstd: vec![F::ZERO; 1],
            logits: vec![F::ZERO; cfg.vocab_size],
            panels: Vec::new(),
            cfg,
            layout,
            params,
            blocks,
        })
    }

    /// Forget the sequence (the all-zero state at position 0).
    pub(crate) fn reset(&mut self) {
        self.conv.fill(F::ZERO);
        self.ssm.fill(F::ZERO);
        self.pos = 0;
    }

    /// Feed `token` (refused, state untouched, when outside the
    /// vocabulary); the logits of the next token.
    pub(crate) fn step(&mut self, token: u32) -> Result<&[F]> {
        check_token(&self.cfg, token, self.pos)?;
        let (d, v) = (self.cfg.d_model, self.cfg.vocab_size);
        let (lay, p) = (&self.layout, &self.params[..]);
        let emb = &p[lay.embedding.clone()];
        let tok = token as usize;
        self.x.copy_from_slice(&emb[tok * d..(tok + 1) * d]);
        let filled = self.pos.min(self.cfg.d_conv as u64 - 1) as usize;
        let st = StepState {
            x: &mut self.x,
            conv: &mut self.conv,
            ssm: &mut self.ssm,
            filled,
        };
        self.blocks.step(lay, p, st, &mut self.panels);
        let eps = F::from_f64(RMS_EPS as f64);
        let nf = &p[lay.norm_f.clone()];
        ops::rmsnorm_fwd(&self.x, nf, eps, &mut self.xf, &mut self.rstd);
        gemm(
            MatRef::new(&self.xf, 1, d, d),
            MatRef::new(emb, v, d, d).t(),
            &mut self.logits,
            v,
            Accum::Overwrite,
            &mut self.panels,
        );
        self.pos += 1;
        Ok(&self.logits)
    }
}

/// One causal-conv step over the `e = x.len()` channels of one layer, in
/// `conv::conv_silu_fwd`'s order: `acc = 0`, then `acc = acc + w[c,j] * in`
/// for ascending taps `j` inside the sequence (the newest `filled` rows of
/// the window `st`, `[k-1, e]` oldest first, then the new input `x` at
/// `j = k-1`), `u = silu(acc + bias)`; then `x` is shifted into `st`.
pub(crate) fn conv_step<F: Float>(
    x: &[F],
    wt: &[F],
    bias: &[F],
    st: &mut [F],
    filled: usize,
    u: &mut [F],
) {
    let e = x.len();
    let kk = st.len() / e.max(1);
    for c in 0..e {
        let mut acc = F::ZERO;
        for j in kk - filled..kk {
            acc = acc + wt[j * e + c] * st[j * e + c];
        }
        acc = acc + wt[kk * e + c] * x[c];
        u[c] = silu(acc + bias[c]);
    }
    if kk > 0 {
        st.copy_within(e.., 0);
        st[(kk - 1) * e..].copy_from_slice(x);
    }
}

/// `a[i] = -exp(A_log[i])` with the model's `exp` (the fixed polynomial
/// in f32, as the forward pass).
pub(crate) fn a_of<F: Float>(a_log: &[F]) -> Vec<F> {
    a_log.iter().map(|&v| -v.exp()).collect()
}
