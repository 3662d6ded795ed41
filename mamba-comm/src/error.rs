//! The one error type of `mamba-comm`.
//!
//! Every variant's message says what went wrong *and* what was expected or
//! what to do, because these errors are usually read in the log of one rank
//! out of many, long after the fact.

use std::time::Duration;

/// Result alias used throughout the crate.
pub type Result<T, E = CommError> = std::result::Result<T, E>;

/// Everything that can go wrong while a world of ranks starts, talks and
/// ends.
#[derive(Debug, thiserror::Error)]
pub enum CommError {
    /// The caller asked for something impossible (a bug on the caller's side:
    /// a peer equal to self, a range past a buffer's end, an unsupported
    /// library version, a library that cannot be opened).
    #[error("configuration error: {0}")]
    Config(String),

    /// The launcher environment is malformed or contradicts itself.
    #[error("environment contract violated by {var}: {detail}")]
    EnvContract {
        /// The variable (or variables) at fault, as spelled in the environment.
        var: String,
        /// What was found and what was expected.
        detail: String,
    },

    /// Ranks could not meet: a unique id that never appeared, a rendezvous
    /// directory that cannot be made private, a TCP store that never
    /// answered.
    #[error("rendezvous failed for rank {rank} at {location} after {timeout:?}: {detail}")]
    Rendezvous {
        /// The rank that gave up.
        rank: usize,
        /// Path or address that was being waited on.
        location: String,
        /// How long the rank waited.
        timeout: Duration,
        /// What was expected there.
        detail: String,
    },

    /// Moving bytes failed: an NCCL call returned an error, a collective
    /// missed its deadline and the communicator was aborted, a socket broke.
    #[error("transport error during {op}: {detail}")]
    Transport {
        /// The operation in flight (`"all_reduce_sum_f32"`, `"init"`, ...).
        op: String,
        /// What happened, including the library's own error text.
        detail: String,
    },

    /// Another rank of the world failed; this rank is stopping because of it.
    #[error("rank {rank} failed: {detail}")]
    PeerFailed {
        /// The failed rank.
        rank: usize,
        /// What is known of its failure (exit status, signal, closed socket).
        detail: String,
    },

    /// The world stopped on a stop request (SIGTERM or SIGINT, to the
    /// supervisor or to any rank): every rank ended the current step in
    /// agreement and exited with `128 + signal`. Not a failure of any rank;
    /// the program that ran decides what was saved (`mamba-train` writes a
    /// checkpoint and says how to resume).
    #[error("the world stopped on {}: every rank ended the step in agreement and exited", crate::stop_signal::signal_name(*signal))]
    Stopped {
        /// The signal (15 = SIGTERM, 2 = SIGINT).
        signal: i32,
    },

    /// Ranks that must hold identical replicas do not.
    #[error("replica divergence: {detail}")]
    ReplicaDivergence {
        /// Which ranks disagree and on what.
        detail: String,
    },
}

impl CommError {
    /// Shorthand for [`CommError::Transport`].
    pub fn transport(op: impl Into<String>, detail: impl Into<String>) -> Self {
        CommError::Transport {
            op: op.into(),
            detail: detail.into(),
        }
    }

    /// Shorthand for [`CommError::Config`].
    pub fn config(detail: impl Into<String>) -> Self {
        CommError::Config(detail.into())
    }

    /// Shorthand for [`CommError::EnvContract`].
    pub fn env(var: impl Into<String>, detail: impl Into<String>) -> Self {
        CommError::EnvContract {
            var: var.into(),
            detail: detail.into(),
        }
    }
}
