//! The private directories of the file rendezvous: the shared root (created
//! 0700; refused when another user owns it or group/others may write into
//! it), the per-job and per-launch directories (created 0700, refused when
//! another user owns them or has any access), and the supervisor's purge of
//! stale job directories.

use std::fs::{self, DirBuilder, File, OpenOptions};
use std::io::ErrorKind;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
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

/// Name of the liveness marker in a launch directory: a file that the
/// owning supervisor holds an exclusive `flock` on for as long as it runs.
/// The kernel drops the lock when that process dies however it dies, so a
/// lock that can be taken marks a stale launch.
pub const OWNER_LOCK: &str = ".owner.lock";

/// Create `dir/`[`OWNER_LOCK`] (0600) and take its exclusive lock; keep the
/// returned file open for as long as the launch in `dir` is alive.
pub fn hold_owner_lock(dir: &Path) -> Result<File> {
    let path = dir.join(OWNER_LOCK);
    let f = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(|e| {
            dir_error(
                0,
                &path,
                format!("cannot create the launch's lock file: {e}"),
            )
        })?;
    // SAFETY: flock on a file descriptor we own, no pointers involved.
    if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
        let e = std::io::Error::last_os_error();
        return Err(dir_error(
            0,
            &path,
            format!("cannot lock the launch's lock file ({e}): is another launch using it?"),
        ));
    }
    Ok(f)
}

/// `Some(true)` when `dir` holds an owner lock that nobody holds (its owner
/// is gone), `Some(false)` when a live process holds it, `None` when there
/// is no lock file (a launch not made by a supervisor, or still being made).
fn owner_gone(dir: &Path) -> Option<bool> {
    let f = File::open(dir.join(OWNER_LOCK)).ok()?;
    // SAFETY: as in `hold_owner_lock`; the probe's lock is released when `f`
    // closes at the end of this function.
    let got = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0;
    Some(got)
}

/// Whether `dir` (a launch directory) is held by a live launch.
pub(crate) fn is_live_launch(dir: &Path) -> bool {
    owner_gone(dir) == Some(false)
}

/// Remove the stale entries of `<root>/<job_id>`, if present: what the
/// supervisor does before spawning so no earlier launch's files survive.
/// Launch directories whose owner is alive (see [`OWNER_LOCK`]) are kept,
/// so two launches that share a job id never delete each other's; launch
/// directories being made (`.new-*` without a lock yet) too. Everything
/// else goes, and the job directory itself when it ends up empty.
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
    let entries = fs::read_dir(&dir)
        .map_err(|e| dir_error(0, &dir, format!("cannot list the stale job directory: {e}")))?;
    let mut removed = false;
    for e in entries.flatten() {
        let path = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        let is_dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
        let res = if is_dir {
            match owner_gone(&path) {
                Some(false) => continue,
                None if name.starts_with(".new-") => continue,
                _ => fs::remove_dir_all(&path),
            }
        } else {
            fs::remove_file(&path)
        };
        res.map_err(|err| {
            dir_error(
                0,
                &path,
                format!("cannot purge this stale rendezvous entry: {err}"),
            )
        })?;
        removed = true;
    }
    // Fails (and is left) when a live launch is inside.
    let _ = fs::remove_dir(&dir);
    Ok(removed)
}

/// Purge what killed or failed launches left under `root`: `<root>/<job_id>`
/// as [`purge_job_dir`] does, and in every other job directory of this user
/// the launch directories whose owner is gone (and the job directory when
/// that empties it). Launch directories without an owner lock in other
/// jobs are left alone: they may belong to a live launch that meets by
/// handshake. Returns how many entries were removed.
pub fn purge_stale(root: &Path, job_id: &str) -> Result<usize> {
    let mut removed = usize::from(purge_job_dir(root, job_id)?);
    let Ok(jobs) = fs::read_dir(root) else {
        return Ok(removed);
    };
    for job in jobs.flatten() {
        let name = job.file_name().to_string_lossy().into_owned();
        let Ok(md) = fs::symlink_metadata(job.path()) else {
            continue;
        };
        if name == job_id || !md.file_type().is_dir() || md.uid() != current_uid() {
            continue;
        }
        let Ok(launches) = fs::read_dir(job.path()) else {
            continue;
        };
        let mut emptied = false;
        for l in launches.flatten() {
            let is_dir = l.file_type().map(|t| t.is_dir()).unwrap_or(false);
            if is_dir && owner_gone(&l.path()) == Some(true) && fs::remove_dir_all(l.path()).is_ok()
            {
                removed += 1;
                emptied = true;
            }
        }
        if emptied {
            // Fails (and is left) when anything else is inside.
            let _ = fs::remove_dir(job.path());
        }
    }
    Ok(removed)
}

/// Make this launch's directory `<job_dir>/<launch_id>` (0700) with its
/// owner lock already held, so no concurrent purge ever sees it unlocked:
/// it is built as `.new-<launch_id>` and renamed into place. Retries when a
/// concurrent purge removed the (then empty) job directory under it.
pub(crate) fn make_owned_launch_dir(job_dir: &Path, launch_id: &str) -> Result<(PathBuf, File)> {
    validate_id(crate::bootstrap::vars::MAMBA_LAUNCH_ID, launch_id)?;
    let tmp = job_dir.join(format!(".new-{launch_id}"));
    let launch_dir = job_dir.join(launch_id);
    let mut last = None;
    for _ in 0..5 {
        let made = make_private_dir(job_dir, 0)
            .and_then(|()| make_private_dir(&tmp, 0))
            .and_then(|()| hold_owner_lock(&tmp))
            .and_then(|lock| {
                fs::rename(&tmp, &launch_dir)
                    .map(|()| lock)
                    .map_err(|e| dir_error(0, &launch_dir, format!("cannot create: {e}")))
            });
        match made {
            Ok(lock) => return Ok((launch_dir, lock)),
            Err(e) => {
                let _ = fs::remove_dir_all(&tmp);
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| dir_error(0, &launch_dir, "cannot create".into())))
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
