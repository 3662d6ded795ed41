//! CPU reference model: forward and backward written by hand over the flat
//! arenas of [`crate::params`], in f32 for training and, through the same
//! generic code, in f64 for gradient checks.
//!
//! Model (SPEC.md, Hugging Face `MambaForCausalLM`, slow path): embedding;
//! `n_layer` blocks of `x + Mixer(RMSNorm(x))`; final RMSNorm; LM head tied
//! to the embedding; mean cross-entropy over targets other than
//! [`IGNORE`](crate::model::IGNORE).
//!
//! Determinism: the result bits are a function of (params, batch) only.
//! Work runs on the caller's rayon pool, split over token chunks, sequences,
//! channels or GEMM row blocks, but every sum keeps one fixed order, so 1 or
//! 64 threads give the same bits. Hot loops are compiled three times
//! (baseline, AVX2, AVX-512F) and dispatched at run time; they vectorise
//! across independent elements only and never fuse a multiply-add, so the
//! instruction set does not change bits either ([`set_max_simd`] caps it,
//! for tests). `exp` and `ln_1p` in f32 are fixed polynomials
//! ([`exp_f32`], [`ln_1p_f32`]), not the system libm.
//!
//! Layout: the parts every architecture shares are written once — the
//! frame around the blocks (`frame`: embedding, final norm, tied head,
//! loss) and its buffers (`workspace`), the ends of a residual block
//! (`block`), the host model and its public methods (`host`), the frame of
//! recurrent decoding (`recurrent`); each architecture brings its block
//! stack (Mamba-1: `net`, `acts`, `decode`; Mamba-2: [`mamba2`]).
//!
//! Numerical contract, for implementations pinned against this one (the
//! module docs of `gemm`, `ops` and `scan` give every formula's order):
//! matrix products are one ascending chain over the inner dimension per
//! output; weight gradients sum over tokens in ascending (sequence, token)
//! order; the scan's dB/dC sum over channels by a 16-lane tree per block
//! then ascending blocks; dA_log/dD sum per sequence, then over sequences
//! ascending; the loss is the f64 sum of per-token f32 losses, ascending.

mod acts;
mod block;
mod conv;
mod decode;
mod float;
mod frame;
mod gemm;
mod host;
pub mod mamba2;
mod net;
mod ops;
mod recurrent;
mod scan;
mod simd;
mod workspace;

pub use decode::CpuDecoder;
pub use float::{exp_f32, ln_1p_f32, EXP_F32_HI, EXP_F32_LO};
pub use mamba2::Mamba2Model;
pub use simd::{set_max_simd, SimdLevel};

use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::Decoder;

/// The f32 CPU model (Mamba-1).
///
/// It keeps the buffers of its last f32 pass (activations and backward
/// scratch, `O(batch * seq_len * d_inner * n_layer)` floats) for reuse by the
/// next call. Calls from several threads at once are fine: one of them gets
/// the cached buffers, the others allocate their own.
pub struct CpuModel(host::Net<net::Mamba1>);

impl CpuModel {
    /// A model of shape `cfg` (validated; Mamba-1).
    pub fn new(cfg: ModelConfig) -> Result<Self> {
        host::Net::new(cfg).map(CpuModel)
    }
}

host::cpu_model_api!(CpuModel);

/// A recurrent decoder of the f32 CPU model `cfg` (Mamba-1 or Mamba-2,
/// validated) with weights `params` (its layout's length), at position 0:
/// [`CpuDecoder::new`] as the trait object the generation engine takes.
pub fn cpu_decoder(cfg: ModelConfig, params: Vec<f32>) -> Result<Box<dyn Decoder>> {
    Ok(Box::new(CpuDecoder::new(cfg, params)?))
}

/// The logits `[tokens.len(), vocab]` of feeding `tokens` one by one to the
/// recurrent decoder of `cfg` (either architecture) in f64, from the zero
/// state: the same program as [`CpuDecoder`] over f64, the reference that
/// checks the step against [`CpuModel::logits_f64`] /
/// [`Mamba2Model::logits_f64`] without f32 rounding in the way.
pub fn decode_logits_f64(cfg: &ModelConfig, params: &[f64], tokens: &[u32]) -> Result<Vec<f64>> {
    let mut dec = decode::recurrent(cfg.clone(), params.to_vec())?;
    let mut out = Vec::with_capacity(tokens.len() * cfg.vocab_size);
    for &t in tokens {
        out.extend_from_slice(dec.step(t)?);
    }
    Ok(out)
}
