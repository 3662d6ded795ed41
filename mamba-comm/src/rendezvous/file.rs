//! The file rendezvous: a private directory per job, one subdirectory per
//! launch, one file per key.
//!
//! Layout: `<root>/<job_id>/<launch>/<key>`.
//! - `<root>` is shared by every rank (`MAMBA_RENDEZVOUS_DIR`, or a private
//!   default under the temporary directory on one host). It is created 0700
//!   when missing and refused when it is not a directory, is owned by another
//!   user, or group or others may write into it.
//! - `<job_id>` and `<launch>` are created 0700 and must be directories (not
//!   links) owned by this user with no group/other permissions.
//! - Values are written to a temporary file in the launch directory and
//!   renamed over the key: a reader sees all of a value or nothing.
//!
//! Why a launch never reads an earlier launch's value: every key lives under
//! `<launch>`, a 128-bit random nonce. Under the self-spawn supervisor the
//! nonce is chosen by the supervisor and handed to every rank
//! (`MAMBA_LAUNCH_ID`; the supervisor also purges the job directory before
//! spawning). Under external launchers ranks agree on one by handshake in the
//! job directory ([`FileRendezvous::join`]): each rank `r > 0` writes
//! `hello.<r>` holding its own fresh nonce `n_r`; rank 0 draws the launch
//! nonce `K`, creates `<K>/` and answers every hello it sees with
//! `ack.<r> = n_r ++ K`; rank `r` accepts only an ack that echoes its own
//! `n_r`, and confirms with `<K>/joined.<r>`; rank 0 returns once every rank
//! confirmed inside `<K>/`. Stale hellos, acks or launch directories left by
//! an earlier launch can therefore never be taken for this one's: a stale
//! ack does not echo the new `n_r`, and a stale confirmation is not inside
//! the new `K`. Once all ranks joined, rank 0 deletes the spent handshake
//! files and the launch directories of earlier launches of the job.

use std::fs::{self, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use super::barrier::BarrierCounts;
pub use super::dir::{
    hold_owner_lock, job_dir, make_private_dir, prepare_root, purge_job_dir, purge_stale,
    OWNER_LOCK,
};
pub(crate) use super::dir::{is_live_launch, make_owned_launch_dir};
use crate::bootstrap::{new_launch_id, validate_id};
use crate::poll::Backoff;
use crate::{CommError, Rendezvous, Result};

/// Longest key accepted, in bytes.
const MAX_KEY: usize = 200;
/// Length of a nonce in hex digits.
const NONCE_HEX: usize = 32;

/// A rendezvous over a shared directory. See the [module docs](self).
#[derive(Debug)]
pub struct FileRendezvous {
    rank: usize,
    world: usize,
    launch_dir: PathBuf,
    barrier_counts: BarrierCounts,
    tmp_counter: AtomicU64,
}

fn check_key(key: &str) -> Result<()> {
    let ok = !key.is_empty()
        && key.len() <= MAX_KEY
        && !key.starts_with('.')
        && key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(CommError::config(format!(
            "rendezvous key {key:?} is not usable: expected 1..={MAX_KEY} characters of \
             [A-Za-z0-9._-], not starting with '.'"
        )))
    }
}

fn is_nonce(s: &str) -> bool {
    s.len() == NONCE_HEX && s.bytes().all(|b| b.is_ascii_hexdigit())
}

impl FileRendezvous {
    /// Meet under a launch id chosen by the supervisor (`MAMBA_LAUNCH_ID`):
    /// keys live in `<root>/<job_id>/<launch_id>/`, created here if needed.
    pub fn with_launch_id(
        root: &Path,
        job_id: &str,
        launch_id: &str,
        rank: usize,
        world: usize,
    ) -> Result<Self> {
        check_place(rank, world)?;
        validate_id(crate::bootstrap::vars::MAMBA_LAUNCH_ID, launch_id)?;
        prepare_root(root, rank)?;
        let job = job_dir(root, job_id)?;
        make_private_dir(&job, rank)?;
        let launch_dir = job.join(launch_id);
        make_private_dir(&launch_dir, rank)?;
        Ok(FileRendezvous::at(rank, world, launch_dir))
    }

    /// Meet without a launch id from outside: agree on a fresh one by the
    /// handshake described in the [module docs](self). Returns once every
    /// rank has joined (rank 0) or once this rank has been admitted (others);
    /// fails after `timeout` naming the rank, the directory and the ranks
    /// that are missing.
    pub fn join(
        root: &Path,
        job_id: &str,
        rank: usize,
        world: usize,
        timeout: Duration,
    ) -> Result<Self> {
        check_place(rank, world)?;
        prepare_root(root, rank)?;
        let job = job_dir(root, job_id)?;
        make_private_dir(&job, rank)?;
        let deadline = Instant::now() + timeout;
        let fail = |detail: String| CommError::Rendezvous {
            rank,
            location: job.display().to_string(),
            timeout,
            detail,
        };
        if rank == 0 {
            let k = new_launch_id()?;
            let launch_dir = job.join(&k);
            make_private_dir(&launch_dir, rank)?;
            let me = FileRendezvous::at(rank, world, launch_dir.clone());
            let mut acked: Vec<Option<String>> = vec![None; world];
            let mut backoff = Backoff::rendezvous();
            loop {
                for (r, seen) in acked.iter_mut().enumerate().skip(1) {
                    let Ok(hello) = fs::read_to_string(job.join(format!("hello.{r}"))) else {
                        continue;
                    };
                    if is_nonce(&hello) && seen.as_deref() != Some(hello.as_str()) {
                        write_atomic(
                            &job,
                            &format!("ack.{r}"),
                            format!("{hello}{k}").as_bytes(),
                            &me.tmp_name("ack"),
                        )
                        .map_err(|e| fail(format!("cannot answer rank {r}: {e}")))?;
                        *seen = Some(hello);
                    }
                }
                let missing: Vec<usize> = (1..world)
                    .filter(|r| !launch_dir.join(format!("joined.{r}")).exists())
                    .collect();
                if missing.is_empty() {
                    break;
                }
                if backoff.pause(deadline).is_err() {
                    return Err(fail(format!(
                        "ranks {missing:?} never joined (no hello seen, or never confirmed): are \
                         they running with the same rendezvous root and job id {job_id:?}? \
                         On several hosts the root must be a shared directory \
                         (MAMBA_RENDEZVOUS_DIR) or use MASTER_ADDR/MASTER_PORT"
                    )));
                }
            }
            // Everyone holds the launch nonce now; the handshake files are
            // spent, and launch directories of earlier launches of this job
            // are stale (two live launches cannot share a job id anyway: their
            // hellos would collide).
            for r in 1..world {
                let _ = fs::remove_file(job.join(format!("hello.{r}")));
                let _ = fs::remove_file(job.join(format!("ack.{r}")));
            }
            if let Ok(entries) = fs::read_dir(&job) {
                for e in entries.flatten() {
                    let name = e.file_name().to_string_lossy().into_owned();
                    let is_dir = e.file_type().map(|t| t.is_dir()).unwrap_or(false);
                    if is_dir && is_nonce(&name) && name != k && !is_live_launch(&e.path()) {
                        let _ = fs::remove_dir_all(e.path());
                    }
                }
            }
            Ok(me)
        } else {
            let n = new_launch_id()?;
            let tmp = format!(".tmp-hello-{rank}-{}", std::process::id());
            write_atomic(&job, &format!("hello.{rank}"), n.as_bytes(), &tmp)
                .map_err(|e| fail(format!("cannot write hello.{rank}: {e}")))?;
            let mut backoff = Backoff::rendezvous();
            let k = loop {
                if let Ok(ack) = fs::read_to_string(job.join(format!("ack.{rank}"))) {
                    if ack.len() == 2 * NONCE_HEX
                        && ack[..NONCE_HEX] == n
                        && is_nonce(&ack[NONCE_HEX..])
                    {
                        break ack[NONCE_HEX..].to_string();
                    }
                }
                if backoff.pause(deadline).is_err() {
                    return Err(fail(format!(
                        "rank 0 never answered this rank's hello.{rank} in {job_id:?}: is rank 0 \
                         running with the same rendezvous root? On several hosts the root must be \
                         a shared directory (MAMBA_RENDEZVOUS_DIR) or use MASTER_ADDR/MASTER_PORT"
                    )));
                }
            };
            let launch_dir = job.join(&k);
            make_private_dir(&launch_dir, rank)?;
            let me = FileRendezvous::at(rank, world, launch_dir);
            me.publish(&format!("joined.{rank}"), b"")?;
            Ok(me)
        }
    }

    fn at(rank: usize, world: usize, launch_dir: PathBuf) -> Self {
        FileRendezvous {
            rank,
            world,
            launch_dir,
            barrier_counts: BarrierCounts::default(),
            tmp_counter: AtomicU64::new(0),
        }
    }

    /// The directory holding this launch's keys.
    pub fn launch_dir(&self) -> &Path {
        &self.launch_dir
    }

    fn tmp_name(&self, what: &str) -> String {
        let n = self.tmp_counter.fetch_add(1, Ordering::Relaxed);
        format!(".tmp-{what}-{}-{}-{n}", self.rank, std::process::id())
    }

    fn timeout_error(&self, path: &Path, timeout: Duration, detail: String) -> CommError {
        CommError::Rendezvous {
            rank: self.rank,
            location: path.display().to_string(),
            timeout,
            detail,
        }
    }
}

fn check_place(rank: usize, world: usize) -> Result<()> {
    if world == 0 || rank >= world {
        return Err(CommError::config(format!(
            "rank {rank} of world {world}: expected world >= 1 and rank < world"
        )));
    }
    Ok(())
}

/// Write `value` to `dir/tmp` (mode 0600), flush it to storage, then
/// rename it over `dir/key`.
fn write_atomic(dir: &Path, key: &str, value: &[u8], tmp: &str) -> std::io::Result<()> {
    let tmp_path = dir.join(tmp);
    let res = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&tmp_path)?;
        f.write_all(value)?;
        f.sync_all()?;
        fs::rename(&tmp_path, dir.join(key))
    })();
    if res.is_err() {
        let _ = fs::remove_file(&tmp_path);
    }
    res
}

impl Rendezvous for FileRendezvous {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        write_atomic(&self.launch_dir, key, value, &self.tmp_name("pub")).map_err(|e| {
            self.timeout_error(
                &self.launch_dir.join(key),
                Duration::ZERO,
                format!("cannot publish: {e}"),
            )
        })
    }

    fn fetch(&self, key: &str, len: usize, timeout: Duration) -> Result<Vec<u8>> {
        check_key(key)?;
        let path = self.launch_dir.join(key);
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::rendezvous();
        let mut seen_len = None;
        loop {
            match fs::read(&path) {
                Ok(v) if v.len() == len => return Ok(v),
                Ok(v) => seen_len = Some(v.len()),
                Err(e) if e.kind() == ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(self.timeout_error(&path, timeout, format!("cannot read: {e}")))
                }
            }
            if backoff.pause(deadline).is_err() {
                let detail = match seen_len {
                    Some(n) => format!("expected exactly {len} bytes; the file holds {n}"),
                    None => format!(
                        "expected a file of exactly {len} bytes; it never appeared (the publishing \
                         rank has not reached this point, died, or uses another rendezvous root)"
                    ),
                };
                return Err(self.timeout_error(&path, timeout, detail));
            }
        }
    }

    fn peek(&self, key: &str) -> Result<Option<Vec<u8>>> {
        check_key(key)?;
        let path = self.launch_dir.join(key);
        match fs::read(&path) {
            Ok(v) => Ok(Some(v)),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(None),
            Err(e) => Err(self.timeout_error(&path, Duration::ZERO, format!("cannot read: {e}"))),
        }
    }

    fn barrier(&self, name: &str, timeout: Duration) -> Result<()> {
        check_key(name)?;
        let gen = self.barrier_counts.next(name);
        let file = |r: usize| format!("barrier.{name}.{gen}.{r}");
        self.publish(&file(self.rank), b"")?;
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::rendezvous();
        loop {
            let missing: Vec<usize> = (0..self.world)
                .filter(|&r| !self.launch_dir.join(file(r)).exists())
                .collect();
            if missing.is_empty() {
                return Ok(());
            }
            if backoff.pause(deadline).is_err() {
                return Err(self.timeout_error(
                    &self.launch_dir,
                    timeout,
                    format!("barrier {name:?} (#{gen}): ranks {missing:?} did not arrive"),
                ));
            }
        }
    }

    fn shared_dir(&self) -> Option<&Path> {
        Some(&self.launch_dir)
    }
}
