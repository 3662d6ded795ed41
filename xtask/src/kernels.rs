//! `cargo xtask kernels` (issue 4).
use crate::util::TaskResult;
pub fn run() -> TaskResult {
    Err("kernels is not implemented yet".into())
}
