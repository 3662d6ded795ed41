//! The one error type of `mamba-train`.

/// Result alias for the crate.
pub type Result<T, E = TrainError> = std::result::Result<T, E>;

/// Everything that can go wrong while building, training or saving a model.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A model, optimizer or run setting that cannot work; says which and
    /// what is accepted.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// One setting outside what works. `setting` is its name in this
    /// crate's types (`n_layer`, `peak_lr`); front ends that spell settings
    /// otherwise (the CLI's `--layers`, `--lr`) re-render it with their
    /// own name, so a user reads the flag they typed.
    #[error("invalid configuration: {setting} {detail}")]
    Setting {
        /// The field's name in this crate's types.
        setting: &'static str,
        /// What is wrong and what is accepted, phrased to follow the name
        /// ("must be at least 1, got 0").
        detail: String,
    },
    /// A checkpoint that cannot be written or read, or that does not match
    /// the run it is loaded into.
    #[error("checkpoint {path}: {detail}")]
    Checkpoint {
        /// The file or directory involved.
        path: String,
        /// What is wrong and what was expected.
        detail: String,
    },
    /// Reading data failed.
    #[error("data: {0}")]
    Data(String),
    /// I/O outside checkpoints (metrics, plots).
    #[error("i/o on {path}: {source}")]
    Io {
        /// The file involved.
        path: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// The run stopped on a stop request (SIGTERM or SIGINT, to the
    /// supervisor or to any rank) at a step boundary every rank agreed on;
    /// rank 0 wrote a checkpoint of that step first. `detail` says where it
    /// is and how to continue.
    #[error("stopped by {} (received by rank {rank}) after step {step}: {detail}", mamba_comm::stop_signal::signal_name(*signal))]
    Stopped {
        /// The signal (15 = SIGTERM, 2 = SIGINT).
        signal: i32,
        /// The lowest rank that received it.
        rank: usize,
        /// The last completed step.
        step: u64,
        /// The checkpoint and the command that continues the run.
        detail: String,
    },
    /// The communicator failed.
    #[error(transparent)]
    Comm(#[from] mamba_comm::CommError),
    /// A CUDA kernel could not be loaded or launched (including "this build
    /// has no kernels", whose message says how to get them).
    #[error(transparent)]
    Kernel(#[from] kernels::KernelError),
    /// A CUDA driver or cuBLAS call failed, or a library is missing; `what`
    /// names the step, `detail` the cause and what to check.
    #[error("CUDA error while {what}: {detail}")]
    Cuda {
        /// The step that failed.
        what: String,
        /// The library's error, and what to do about it.
        detail: String,
    },
}

impl TrainError {
    /// The exit status a program should end with for this error: `128 +
    /// signal` for a run (or a supervised world) that stopped on request,
    /// else `None` (the caller's failure status).
    pub fn stop_status(&self) -> Option<i32> {
        match self {
            TrainError::Stopped { signal, .. }
            | TrainError::Comm(mamba_comm::CommError::Stopped { signal }) => {
                Some(mamba_comm::stop_signal::stop_status(*signal))
            }
            _ => None,
        }
    }

    /// A [`TrainError::Setting`]: `setting` followed by `detail`.
    pub fn setting(setting: &'static str, detail: impl Into<String>) -> Self {
        TrainError::Setting {
            setting,
            detail: detail.into(),
        }
    }
}
