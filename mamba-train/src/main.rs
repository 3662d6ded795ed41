//! The `mamba-train` command (filled in by issue 5).
fn main() {}
