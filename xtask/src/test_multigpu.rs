//! `cargo xtask test-multigpu`.
use crate::util::TaskResult;
pub fn run() -> TaskResult {
    Err("test-multigpu is not implemented yet".into())
}
