//! [`Decoder`]: what the one generation engine ([`crate::generate`]) asks
//! of a device — feed one token, get the next token's logits — and
//! [`DecodeState`], the recurrent state a decoder carries between tokens.
//! Defined here, with the models, so that the models implement it and the
//! engine above uses it (no import cycle between `model` and `generate`).
//!
//! **Recurrent decoding.** A Mamba block is causal and its only memory of
//! the past is, per layer, the last `d_conv - 1` inputs of the causal conv
//! (per channel) and the SSM state `h` (`d_inner x d_state`). A step for
//! token `x_t`: embedding -> per layer RMSNorm, in_proj to (x, z), conv over
//! the kept inputs and x (+ bias) then SiLU = u, x_proj to (dt_raw, B, C),
//! `dt = softplus(dt_proj(dt_raw) + b)`, `h = exp(dt A) h + (dt u) B`,
//! `y = C.h + D u`, `y SiLU(z)`, out_proj, residual -> final RMSNorm -> tied
//! LM head. The logits equal the full forward pass's at the same position
//! (the CPU step runs the same operations in the same order as the CPU
//! forward, so they are the same bits; see `tests/decode_parity.rs`).
//!
//! **Mamba-2.** The same frame; per layer the conv runs over x, B and C
//! (`conv_dim = d_inner + 2 * n_groups * d_state` channels) and the SSM
//! state is one `[head_dim, d_state]` matrix per head, `h = exp(dt A) h +
//! dt x B^T`, `y = h C + D x` with one scalar `dt`, `A`, `D` per head; then
//! the gated RMSNorm and out_proj. The CPU step equals the forward pass to
//! rounding only: the forward's chunked scan reassociates the sums
//! (`tests/mamba2_decode.rs` states the tolerance).
//!
//! **Constant cost per token.** The state is [`DecodeState::len_for`] =
//! `n_layer * ((d_conv - 1) * conv_dim + d_inner * d_state)` floats
//! (`conv_dim` = `d_inner` for Mamba-1) whatever the position, and a step
//! touches each weight once, so every token costs the same time and memory
//! however long the sequence is.

use crate::config::ModelConfig;
use crate::error::{Result, TrainError};

/// One model's recurrent decoder over a single sequence, on some device.
///
/// Contract: deterministic — the same weights and token sequence since the
/// last [`reset`](Self::reset) give the same logits bits; [`step`](Self::step)
/// refuses a token outside the vocabulary with an error (never undefined
/// behaviour), and the state it keeps has [`DecodeState::len_for`]
/// floats at every position.
pub trait Decoder {
    /// The model's shape.
    fn config(&self) -> &ModelConfig;

    /// The device's name for reports (`cpu`, `cuda`).
    fn device_name(&self) -> &'static str;

    /// Forget the sequence: the state before its first token (all zero).
    fn reset(&mut self) -> Result<()>;

    /// Feed `token` at the next position; returns the logits (`vocab_size`
    /// floats, on the host) of the token after it.
    fn step(&mut self, token: u32) -> Result<&[f32]>;

    /// Tokens fed since the last reset.
    fn position(&self) -> u64;

    /// A host copy of the recurrent state (for tests and tools).
    fn snapshot(&mut self) -> Result<DecodeState>;

    /// Replace the recurrent state with `state` (of this model's shape) at
    /// position `position`; the next [`step`](Self::step) continues from it.
    fn restore(&mut self, state: &DecodeState, position: u64) -> Result<()>;
}

/// The recurrent state of every layer, on the host, f32.
///
/// `conv` is `[n_layer, d_conv - 1, conv_dim]`: per layer the last
/// `d_conv - 1` conv inputs, oldest first — Mamba-1: the x half of
/// in_proj's output (`conv_dim = d_inner`); Mamba-2: its x, B, C columns
/// (`conv_dim = d_inner + 2 * n_groups * d_state`, in that order). At
/// position `p < d_conv - 1` only the newest `p` rows hold inputs (the conv
/// never reads the others: the sequence has no tokens before its start).
/// `ssm` is `[n_layer, d_inner, d_state]`: the scan state `h` after the
/// last token (Mamba-2: `[n_layer, n_heads, head_dim, d_state]`, the same
/// count since `d_inner = n_heads * head_dim`).
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeState {
    /// Conv inputs, `[n_layer, d_conv - 1, conv_dim]`.
    pub conv: Vec<f32>,
    /// SSM states, `[n_layer, d_inner, d_state]`.
    pub ssm: Vec<f32>,
}

impl DecodeState {
    /// The all-zero state of `cfg` (before the first token).
    pub fn zeros(cfg: &ModelConfig) -> Self {
        DecodeState {
            conv: vec![0.0; Self::conv_len(cfg)],
            ssm: vec![0.0; Self::ssm_len(cfg)],
        }
    }

    /// Channels of one conv-window row ([`DecodeState`]'s `conv_dim`):
    /// `d_inner` for Mamba-1, `d_inner + 2 * n_groups * d_state` for Mamba-2.
    pub fn conv_dim(cfg: &ModelConfig) -> usize {
        cfg.d_inner() + cfg.ssd().map_or(0, |s| 2 * s.n_groups * cfg.d_state)
    }

    /// Conv-state floats of `cfg`: `n_layer * (d_conv - 1) * conv_dim`.
    pub fn conv_len(cfg: &ModelConfig) -> usize {
        cfg.n_layer * (cfg.d_conv - 1) * Self::conv_dim(cfg)
    }

    /// SSM-state floats of `cfg`: `n_layer * d_inner * d_state`.
    pub fn ssm_len(cfg: &ModelConfig) -> usize {
        cfg.n_layer * cfg.d_inner() * cfg.d_state
    }

    /// Floats of the whole state of `cfg`: a function of the shape alone,
    /// never of the position (the constant cost per token).
    pub fn len_for(cfg: &ModelConfig) -> usize {
        Self::conv_len(cfg) + Self::ssm_len(cfg)
    }

    /// Floats held.
    pub fn len(&self) -> usize {
        self.conv.len() + self.ssm.len()
    }

    /// True for the state of no layer (never produced by a valid config).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Refuse a state of another shape than `cfg`'s, naming both.
    pub fn check_shape(&self, cfg: &ModelConfig) -> Result<()> {
        let (c, s) = (Self::conv_len(cfg), Self::ssm_len(cfg));
        if self.conv.len() != c || self.ssm.len() != s {
            return Err(TrainError::Config(format!(
                "decode state has {} conv and {} SSM floats; this model ({} layers, d_inner {}, \
                 conv_dim {}, d_conv {}, d_state {}) needs {c} and {s}",
                self.conv.len(),
                self.ssm.len(),
                cfg.n_layer,
                cfg.d_inner(),
                Self::conv_dim(cfg),
                cfg.d_conv,
                cfg.d_state
            )));
        }
        Ok(())
    }
}

/// Refuse a token outside the vocabulary of `cfg`, naming it and the
/// position (every decoder applies the same rule).
pub(crate) fn check_token(cfg: &ModelConfig, token: u32, position: u64) -> Result<()> {
    if token as usize >= cfg.vocab_size {
        return Err(TrainError::Data(format!(
            "token {token} at position {position} is outside the vocabulary (size {})",
            cfg.vocab_size
        )));
    }
    Ok(())
}
