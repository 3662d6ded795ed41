//! The Mamba-2 language model on the CPU (Hugging Face `Mamba2ForCausalLM`,
//! the `torch_forward` path), forward and backward by hand over the flat
//! arena, generic over the same `Float` as the Mamba-1 reference beside
//! it: f32 for training, f64 for gradient checks, one program.
//!
//! Model: embedding; `n_layer` blocks of `x + Mixer(RMSNorm(x))`; final
//! RMSNorm; LM head tied to the embedding; mean cross-entropy over targets
//! other than [`IGNORE`](crate::model::IGNORE). Mixer: in_proj (no bias) to
//! z, x, B, C, dt; causal depthwise conv1d (with bias) + SiLU over x, B, C;
//! `dt = softplus(dt + dt_bias)`; `A = -exp(A_log)` one scalar per head; the
//! chunked SSD scan (`ssd`) over `d_inner / head_dim` heads, B and C shared
//! by the heads of a group; `y + D x`; gated RMSNorm `norm(y * silu(z))`
//! over all of `d_inner` (transformers' `MambaRMSNormGated`); out_proj (no
//! bias). Shapes and names: [`crate::params::SsdLayerOffsets`].
//!
//! Determinism: as the Mamba-1 reference (every sum in one fixed order,
//! work split only between independent outputs), so the bits are a function
//! of (params, batch, chunk_size) only, whatever the thread count. The
//! chunk size is part of the config because it decides the scan's order.

mod acts;
pub(crate) mod decode;
mod gate;
mod net;
pub(crate) mod ssd;

use super::host;
use crate::config::ModelConfig;
use crate::error::Result;

/// The f32 CPU Mamba-2 model; a [`HostModel`](crate::model::HostModel), so
/// the one engine ([`Trainer`](crate::train::Trainer), data parallelism,
/// checkpoints) runs it as it runs [`CpuModel`](super::CpuModel).
///
/// It keeps the buffers of its last f32 pass for the next call; calls from
/// several threads at once are fine (one gets the cached buffers, the
/// others allocate).
pub struct Mamba2Model(host::Net<net::Mamba2>);

impl Mamba2Model {
    /// A model of shape `cfg`, which must be a valid Mamba-2 config.
    pub fn new(cfg: ModelConfig) -> Result<Self> {
        host::Net::new(cfg).map(Mamba2Model)
    }
}

host::cpu_model_api!(Mamba2Model);
