//! The private directories of the file rendezvous: the shared root, and the
//! per-job and per-launch directories (created 0700, refused when another
//! user owns them or may write into them), and the supervisor's purge of a
//! stale job directory.

use std::fs::{self, DirBuilder};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::bootstrap::{current_uid, validate_id};
use crate::{CommError, Result};

/// A rendezvous error about `path` that is not a timeout.
pub(crate) fn dir_error(rank: usize, path: &Path, detail: String) -> CommError {
    CommError::Rendezvous {
        rank,
        location: path.display().to_string(),
        timeout: Duration::ZERO,
        detail,
    }
}

/// Create the rendezvous root if it is missing (0700) and refuse a root
/// that anyone may write into without the sticky bit.
pub fn prepare_root(root: &Path, rank: usize) -> Result<()> {
    DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
        .map_err(|e| {
            dir_error(
                rank,
                root,
                format!("cannot create the rendezvous root: {e}"),
            )
        })?;
    let md = fs::metadata(root).map_err(|e| {
        dir_error(
            rank,
            root,
            format!("cannot inspect the rendezvous root: {e}"),
        )
    })?;
    if !md.is_dir() {
        return Err(dir_error(
            rank,
            root,
            "the rendezvous root is not a directory".into(),
        ));
    }
    if md.mode() & 0o002 != 0 && md.mode() & 0o1000 == 0 {
        return Err(dir_error(
            rank,
            root,
            format!(
                "the rendezvous root (mode {:o}) is writable by every user without the sticky \
                 bit; expected a directory only this user (or a trusted group) can write",
                md.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

/// Create `path` with mode 0700 if missing, then insist that it is a real
/// directory owned by this user and closed to everyone else.
pub fn make_private_dir(path: &Path, rank: usize) -> Result<()> {
    match DirBuilder::new().mode(0o700).create(path) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(dir_error(
                rank,
                path,
                format!("cannot create the directory: {e}"),
            ))
        }
    }
    let md = fs::symlink_metadata(path)
        .map_err(|e| dir_error(rank, path, format!("cannot inspect the directory: {e}")))?;
    if !md.file_type().is_dir() {
        return Err(dir_error(
            rank,
            path,
            "is not a directory (a file or symbolic link is in the way); remove it".into(),
        ));
    }
    if md.uid() != current_uid() {
        return Err(dir_error(
            rank,
            path,
            format!(
                "is owned by uid {}, not by this user (uid {})",
                md.uid(),
                current_uid()
            ),
        ));
    }
    if md.mode() & 0o077 != 0 {
        return Err(dir_error(
            rank,
            path,
            format!(
                "has mode {:o}, open to other users; expected 0700 (chmod 700 it or remove it)",
                md.mode() & 0o7777
            ),
        ));
    }
    Ok(())
}

/// `<root>/<job_id>`, after validating the job id.
pub fn job_dir(root: &Path, job_id: &str) -> Result<PathBuf> {
    validate_id(crate::bootstrap::vars::MAMBA_JOB_ID, job_id)?;
    Ok(root.join(job_id))
}

/// Remove `<root>/<job_id>` and everything in it, if present: what the
/// supervisor does before spawning so no earlier launch's files survive.
/// Refuses to follow a symbolic link or delete a directory of another user.
/// Returns whether something was removed.
pub fn purge_job_dir(root: &Path, job_id: &str) -> Result<bool> {
    let dir = job_dir(root, job_id)?;
    let md = match fs::symlink_metadata(&dir) {
        Ok(md) => md,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(false),
        Err(e) => {
            return Err(dir_error(
                0,
                &dir,
                format!("cannot inspect the stale job directory: {e}"),
            ))
        }
    };
    if !md.file_type().is_dir() || md.uid() != current_uid() {
        return Err(dir_error(
            0,
            &dir,
            "a stale job entry that is not this user's directory is in the way; remove it by hand"
                .into(),
        ));
    }
    fs::remove_dir_all(&dir).map_err(|e| {
        dir_error(
            0,
            &dir,
            format!("cannot purge the stale job directory: {e}"),
        )
    })?;
    Ok(true)
}
