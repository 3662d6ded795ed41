//! `cargo xtask bundle DIR`.
use crate::util::TaskResult;
pub fn run(_dir: &std::path::Path) -> TaskResult {
    Err("bundle is not implemented yet".into())
}
