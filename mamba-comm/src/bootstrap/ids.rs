//! Job and launch identities: validation and fresh random nonces.
//!
//! A job id names a directory under the rendezvous root, so it must not be
//! able to escape it or alias another: no separators, no `..`, no NUL or
//! other control characters, printable ASCII only, at most
//! [`MAX_ID_LEN`] bytes.

use std::fs::File;
use std::io::Read;

use crate::{CommError, Result};

/// Longest accepted job or launch id, in bytes.
pub const MAX_ID_LEN: usize = 128;

/// Check that `value` (read from variable `var`) may name a directory
/// component. An empty id is refused here; whether an id is needed at all
/// is the caller's decision.
pub fn validate_id(var: &str, value: &str) -> Result<()> {
    let fail = |why: &str| {
        Err(CommError::env(
            var,
            format!(
                "{value:?} is not a usable id: {why} (expected 1..={MAX_ID_LEN} printable ASCII \
                 characters without '/', '\\' or '..')"
            ),
        ))
    };
    if value.is_empty() {
        return fail("it is empty");
    }
    if value.len() > MAX_ID_LEN {
        return fail("it is too long");
    }
    if value.contains('/') || value.contains('\\') {
        return fail("it contains a path separator");
    }
    if value.contains("..") {
        return fail("it contains '..'");
    }
    if value == "." {
        return fail("it is '.'");
    }
    if value.contains('\0') {
        return fail("it contains a NUL byte");
    }
    if !value.bytes().all(|b| b.is_ascii_graphic()) {
        return fail("it contains whitespace, control or non-ASCII characters");
    }
    Ok(())
}

/// `N` bytes from the kernel's random source (`/dev/urandom`).
pub fn random_bytes<const N: usize>() -> Result<[u8; N]> {
    let mut out = [0u8; N];
    File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut out))
        .map_err(|e| {
            CommError::config(format!("cannot read /dev/urandom for a random nonce: {e}"))
        })?;
    Ok(out)
}

/// Lower-case hex of `bytes`.
pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fresh per-launch nonce: 128 random bits as 32 hex digits. Two launches
/// never share one (with overwhelming probability), which is what makes a
/// stale rendezvous value from an earlier launch unreachable.
pub fn new_launch_id() -> Result<String> {
    Ok(hex(&random_bytes::<16>()?))
}

/// This process's real user id: the owner the rendezvous directories must
/// have, and part of the default rendezvous root's name.
pub(crate) fn current_uid() -> u32 {
    // SAFETY: getuid has no preconditions and cannot fail.
    unsafe { libc::getuid() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_ids_are_refused_with_the_variable_named() {
        for bad in [
            "",
            "a/b",
            "a\\b",
            "..",
            "x..y",
            ".",
            "a\0b",
            "a b",
            "tab\t",
            "é",
            &"x".repeat(129),
        ] {
            match validate_id("MAMBA_JOB_ID", bad) {
                Err(CommError::EnvContract { var, .. }) => assert_eq!(var, "MAMBA_JOB_ID"),
                other => panic!("{bad:?} accepted: {other:?}"),
            }
        }
    }

    #[test]
    fn ordinary_ids_pass() {
        for good in [
            "job-1",
            "slurm-123.0",
            "run_7@host",
            "a.b",
            &"x".repeat(128),
        ] {
            validate_id("MAMBA_JOB_ID", good).expect(good);
        }
    }

    #[test]
    fn launch_ids_are_fresh() {
        let a = new_launch_id().expect("nonce");
        let b = new_launch_id().expect("nonce");
        assert_eq!(a.len(), 32);
        assert_ne!(a, b);
        validate_id("MAMBA_LAUNCH_ID", &a).expect("nonce is a valid id");
    }
}
