//! The private directories of the file rendezvous: the shared root (created
//! 0700; refused when another user owns it or group/others may write into
//! it), the per-job and per-launch directories (created 0700, refused when
//! another user owns them or has any access), and the supervisor's purge of
//! stale job directories.

use std::fs::{self, DirBuilder};
use std::io::ErrorKind;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::bootstrap::vars::MAMBA_RENDEZVOUS_DIR;
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
/// that is not a directory, is owned by another user, or that group or
/// others may write into (sticky bit or not: another local user could
/// pre-create the predictable default root or squat job directories in it).
pub fn prepare_root(root: &Path, rank: usize) -> Result<()> {
    let inspect = |root: &Path| {
        fs::metadata(root).map_err(|e| {
            dir_error(
                rank,
                root,
                format!("cannot inspect the rendezvous root: {e}"),
            )
        })
    };
    let md = match fs::metadata(root) {
        Ok(md) => md,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(root)
                .map_err(|e| {
                    dir_error(
                        rank,
                        root,
                        format!(
                            "cannot create the rendezvous root: {e}; set {MAMBA_RENDEZVOUS_DIR} \
                             to a directory this user may create"
                        ),
                    )
                })?;
            inspect(root)?
        }
        Err(_) => inspect(root)?,
    };
    check_root(md.is_dir(), md.uid(), md.mode(), current_uid())
        .map_err(|detail| dir_error(rank, root, detail))
}

/// The checks of [`prepare_root`] on a root's metadata (`owner`, `mode`),
/// for a process of user `me`.
fn check_root(is_dir: bool, owner: u32, mode: u32, me: u32) -> std::result::Result<(), String> {
    let what_to_do = format!(
        "set {MAMBA_RENDEZVOUS_DIR} to a private directory of this user (mode 700), or leave it \
         unset for the private default under $TMPDIR"
    );
    if !is_dir {
        return Err(format!(
            "the rendezvous root is not a directory (a file is in the way); remove it, or {what_to_do}"
        ));
    }
    if owner != me {
        return Err(format!(
            "the rendezvous root is owned by uid {owner}, not by this user (uid {me}): another \
             user could read or plant rendezvous values there; {what_to_do}"
        ));
    }
    if mode & 0o022 != 0 {
        let who = if mode & 0o002 != 0 {
            "others"
        } else {
            "its group"
        };
        return Err(format!(
            "the rendezvous root (mode {:o}) is writable by {who}, who could pre-create this \
             user's job directories in it; chmod 700 it, or {what_to_do}",
            mode & 0o7777
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_root_of_another_user_is_refused_naming_both_uids() {
        let e = check_root(true, 1000, 0o40700, 1001).expect_err("foreign owner");
        assert!(e.contains("uid 1000") && e.contains("uid 1001"), "{e}");
        assert!(e.contains(MAMBA_RENDEZVOUS_DIR), "{e}");
        check_root(true, 1001, 0o40700, 1001).expect("own private root");
        check_root(true, 1001, 0o40755, 1001).expect("readable by others is fine");
        assert!(check_root(true, 1001, 0o41777, 1001).is_err());
        assert!(check_root(false, 1001, 0o100600, 1001)
            .expect_err("file")
            .contains("not a directory"));
    }
}
