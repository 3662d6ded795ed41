//! `cargo xtask bindgen --header PATH` (issue 2).
use crate::util::TaskResult;
pub fn run(_header: &std::path::Path) -> TaskResult {
    Err("bindgen is not implemented yet".into())
}
