//! Helpers shared by the tests that run the `mamba-train` binary
//! (`cli_train.rs`, `dp_world.rs`): locating the binary and reading its
//! exit status, output and summary digest.

use std::path::PathBuf;
use std::process::Output;

/// The binary under test: cargo's path, or `MAMBA_TRAIN_BIN` when the test
/// runs from a bundle on a host where cargo's target directory does not exist.
pub fn bin() -> PathBuf {
    std::env::var_os("MAMBA_TRAIN_BIN")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_mamba-train").into())
}

/// Process output as text (lossy: a test must not fail on a stray byte).
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Stdout of a run that must have succeeded (else fails showing both streams).
pub fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "failed: {}\nstdout:\n{}\nstderr:\n{}",
        o.status,
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stdout)
}

/// Stderr of a run that must have failed (else fails showing both streams).
pub fn err(o: &Output) -> String {
    assert!(
        !o.status.success(),
        "should have failed; stdout:\n{}\nstderr:\n{}",
        text(&o.stdout),
        text(&o.stderr)
    );
    text(&o.stderr)
}

/// The hex digest of stdout's last line, which must be the
/// `weights-digest: <64 characters>` summary line.
pub fn last_line_digest(stdout: &str) -> String {
    let last = stdout.lines().last().unwrap_or_default();
    let hex = last
        .strip_prefix("weights-digest: ")
        .unwrap_or_else(|| panic!("last line is not the digest: {last:?}\n{stdout}"));
    assert_eq!(hex.len(), 64, "{hex}");
    hex.to_string()
}
