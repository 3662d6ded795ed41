//! `cargo xtask bench reduce|train`.
use crate::util::TaskResult;

/// The benchmarks.
#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub enum Which {
    /// FixedOrder and NcclSum against NCCL's own all-reduce.
    Reduce,
    /// The training step against its references.
    Train,
}

pub fn run(_which: Which) -> TaskResult {
    Err("bench is not implemented yet".into())
}
