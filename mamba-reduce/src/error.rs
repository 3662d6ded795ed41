//! The one error type of `mamba-reduce`.
//!
//! Every message names what was wrong and what was expected, because a
//! reduction error is usually read in the log of one rank out of many.

use mamba_comm::CommError;

/// Result alias used throughout the crate.
pub type Result<T, E = ReduceError> = std::result::Result<T, E>;

/// Everything that can go wrong while reducing.
#[derive(Debug, thiserror::Error)]
pub enum ReduceError {
    /// The transport failed (a peer died, a deadline passed, NCCL returned
    /// an error). The reducer is unusable afterwards; tear the world down.
    #[error("reduction transport failed: {0}")]
    Comm(#[from] CommError),

    /// A device kernel could not be loaded or launched.
    #[error("reduction kernel failed: {0}")]
    Kernel(#[from] kernels::KernelError),

    /// A CUDA driver call made by the reducer itself (a device copy, a
    /// stream synchronisation) failed.
    #[error("CUDA driver call {op} failed: {detail}")]
    Device {
        /// The call (`"memcpy_dtod"`, `"stream synchronize"`, ...).
        op: String,
        /// The driver's error text.
        detail: String,
    },

    /// The caller asked for something this rank cannot do (a bug on the
    /// caller's side: wrong number of local arenas, arenas of different
    /// lengths, a logical world that the physical world does not divide).
    #[error("reducer configuration error: {0}")]
    Config(String),

    /// Ranks presented different identities to the agreement check. Every
    /// rank reports the same disagreement.
    #[error("ranks disagree before the first reduction: {detail}")]
    Disagreement {
        /// Which ranks differ on which field, with both values.
        detail: String,
    },

    /// An internal invariant of the dataflow did not hold (a plan whose
    /// sends and receives do not match, emulated replicas that differ).
    /// This is a bug in `mamba-reduce`; please report it with the message.
    #[error("reducer invariant violated (bug in mamba-reduce): {0}")]
    Invariant(String),
}

impl ReduceError {
    /// Shorthand for [`ReduceError::Config`].
    pub fn config(detail: impl Into<String>) -> Self {
        ReduceError::Config(detail.into())
    }

    /// Shorthand for [`ReduceError::Invariant`].
    pub fn invariant(detail: impl Into<String>) -> Self {
        ReduceError::Invariant(detail.into())
    }

    /// Shorthand for [`ReduceError::Device`].
    pub fn device(op: impl Into<String>, detail: impl std::fmt::Display) -> Self {
        ReduceError::Device {
            op: op.into(),
            detail: detail.to_string(),
        }
    }
}
