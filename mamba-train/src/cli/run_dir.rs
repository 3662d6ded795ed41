//! Rank 0's run directory: the metrics log, the loss plot, and where
//! checkpoints go; its lock (one run at a time); which directory a run
//! uses by default; and that a run never deletes another run's checkpoints
//! or metrics unless told to (`--overwrite`).

use std::fs::{self, File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::args::TrainArgs;
use super::context::RankContext;
use super::progress::stderr_line;
use crate::checkpoint::{self, atomic, CHECKPOINTS_DIR, LATEST};
use crate::error::{Result, TrainError};
use crate::metrics::{read_records, MetricsLog};
use crate::plot::loss_svg;
use crate::train::RunConfig;

/// Metrics file name in the run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// Loss plot file name in the run directory.
pub const PLOT_FILE: &str = "loss.svg";
pub(crate) fn io_err(path: &Path, source: std::io::Error) -> TrainError {
    TrainError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// `--out` when neither it nor `--resume` is given.
pub const DEFAULT_OUT: &str = "runs/latest";
/// The lock file in a run directory: held (`flock`) by the rank 0 of the
/// run training there; holds that run's pid, host and start time.
pub const LOCK_FILE: &str = ".lock";

/// The run directory of `args`: `--out`, else (with `--resume X`) the run
/// directory whose `checkpoints/` holds X, else [`DEFAULT_OUT`].
pub fn run_dir_of(args: &TrainArgs) -> Result<PathBuf> {
    if let Some(out) = &args.out {
        return Ok(out.clone());
    }
    let Some(resume) = &args.resume else {
        return Ok(PathBuf::from(DEFAULT_OUT));
    };
    let ck = checkpoint::resolve(resume)?;
    match ck.parent() {
        Some(root) if root.file_name().is_some_and(|n| n == CHECKPOINTS_DIR) => Ok(root
            .parent()
            .map_or_else(|| PathBuf::from("."), Path::to_path_buf)),
        _ => Err(TrainError::Config(format!(
            "--resume {}: the checkpoint is not inside a run directory's {CHECKPOINTS_DIR}/, \
             so there is no run directory to continue in; pass --out DIR for the continued run",
            resume.display()
        ))),
    }
}

/// This process's hold on a run directory's [`LOCK_FILE`]. The OS releases
/// it when the process ends, however it ends; a clean end also empties the
/// holder information, so only a crashed run leaves a stale one.
pub(crate) struct RunLock {
    file: File,
}

/// The holder information written into a lock file.
fn holder_info() -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!(
        "pid={}\nhost={}\nstarted={}\n",
        std::process::id(),
        host_name(),
        utc_time(secs)
    )
}

/// `key=value` lines of a lock file's holder information.
fn holder_field<'a>(info: &'a str, key: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
        .map(str::trim)
}

/// "pid P on host H, started T" from a lock file's contents.
fn describe_holder(info: &str) -> String {
    let f = |k| holder_field(info, k).unwrap_or("?");
    format!(
        "pid {} on host {}, started {}",
        f("pid"),
        f("host"),
        f("started")
    )
}

impl RunLock {
    /// Lock `dir` (which exists) for this run, or refuse naming the holder.
    /// A lock file left by a run that died is taken over with a note.
    pub(crate) fn acquire(dir: &Path) -> Result<RunLock> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| io_err(&path, e))?;
        // SAFETY: flock on a descriptor this function owns (through `file`).
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        let mut prev = String::new();
        let _ = file.read_to_string(&mut prev);
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                return Err(in_use(dir, &path, &prev));
            }
            return Err(io_err(&path, e));
        }
        if holder_field(&prev, "pid").is_some() {
            let dead = match (
                holder_field(&prev, "host"),
                holder_field(&prev, "pid").and_then(|p| p.parse::<i32>().ok()),
            ) {
                (Some(h), Some(pid)) if h == host_name() && !pid_alive(pid) => {
                    "; that process is no longer alive"
                }
                _ => "",
            };
            stderr_line(&format!(
                "note: taking over the lock of {} left by a run that did not end cleanly ({}{dead})",
                dir.display(),
                describe_holder(&prev)
            ));
        }
        let info = holder_info();
        file.set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)).map(|_| ()))
            .and_then(|()| file.write_all(info.as_bytes()))
            .and_then(|()| file.sync_all())
            .map_err(|e| io_err(&path, e))?;
        Ok(RunLock { file })
    }
}

impl RunLock {
    /// Refuse now, naming the holder, if another run holds `dir`'s lock;
    /// changes nothing (the supervisor of a world checks before it starts
    /// the ranks; rank 0 then takes the lock).
    pub(crate) fn check_free(dir: &Path) -> Result<()> {
        let path = dir.join(LOCK_FILE);
        let Ok(mut file) = File::open(&path) else {
            return Ok(());
        };
        // SAFETY: flock on a descriptor owned by `file`; closing it (at the
        // end of this function) releases a lock taken here.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_SH | libc::LOCK_NB) };
        if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut info = String::new();
            let _ = file.read_to_string(&mut info);
            return Err(in_use(dir, &path, &info));
        }
        Ok(())
    }
}

/// The refusal of a run directory locked by another run.
fn in_use(dir: &Path, lock: &Path, info: &str) -> TrainError {
    TrainError::Config(format!(
        "--out {}: the run directory is in use by another run ({}; lock file {}); \
         wait for it to end, or pass another --out",
        dir.display(),
        describe_holder(info),
        lock.display()
    ))
}

impl Drop for RunLock {
    fn drop(&mut self) {
        // A clean end: no holder left to report (the OS drops the lock).
        let _ = self.file.set_len(0);
    }
}

/// Whether process `pid` exists on this host.
fn pid_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let rc = unsafe { libc::kill(pid, 0) };
    rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// This machine's host name.
fn host_name() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: the buffer is writable for its length.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".into();
    }
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// `secs` since the Unix epoch as `YYYY-MM-DDTHH:MM:SSZ`.
fn utc_time(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days to a civil date (proleptic Gregorian), after H. Hinnant.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// What of another run's files `run_dir` holds (empty: none).
fn other_run_files(run_dir: &Path) -> Vec<String> {
    let mut what = Vec::new();
    let ck = run_dir.join(CHECKPOINTS_DIR);
    if let Ok(rd) = fs::read_dir(&ck) {
        let mut steps: Vec<String> = rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("step-") || n == LATEST)
            .collect();
        steps.sort();
        if !steps.is_empty() {
            what.push(format!("{CHECKPOINTS_DIR}/ ({})", steps.join(", ")));
        }
    }
    if run_dir.join(METRICS_FILE).exists() {
        what.push(METRICS_FILE.to_string());
    }
    what
}

/// Whether `run_dir` may take this run, resumed from the checkpoint
/// directory `resumed_from` (if any): true when the run continues in its
/// own directory. A run that does not (fresh, or resumed from elsewhere)
/// refuses a directory holding another run's checkpoints or metrics unless
/// `overwrite`. Touches nothing.
pub fn check_run_dir(run_dir: &Path, resumed_from: Option<&Path>, overwrite: bool) -> Result<bool> {
    let in_place = resumed_from.is_some_and(|ck| same_run_dir(ck, run_dir));
    if in_place {
        if overwrite {
            return Err(TrainError::Config(format!(
                "--overwrite would delete the checkpoint being resumed: it lives in --out {}; \
                 drop --overwrite to continue the run there, or pass another --out",
                run_dir.display()
            )));
        }
        return Ok(true);
    }
    let what = other_run_files(run_dir);
    if !what.is_empty() && !overwrite {
        return Err(TrainError::Config(format!(
            "--out {dir} holds another run ({}); pass --overwrite to replace it, \
             --resume {dir} to continue it, or another --out",
            what.join(", "),
            dir = run_dir.display()
        )));
    }
    Ok(false)
}

/// Rank 0's run directory: metrics log and where checkpoints go, locked
/// for the run's whole life.
pub(crate) struct RunDir {
    pub(crate) path: PathBuf,
    pub(crate) metrics: MetricsLog,
    pub(crate) last_ck: Option<PathBuf>,
    _lock: RunLock,
}

impl RunDir {
    /// Lock, then open (resumed in place) or start (fresh, or resumed from
    /// elsewhere: see [`check_run_dir`]) the run directory of `ctx`, at
    /// `step`.
    pub(crate) fn open(ctx: &RankContext<'_>, step: u64) -> Result<RunDir> {
        let path = ctx.out.clone();
        fs::create_dir_all(&path).map_err(|e| io_err(&path, e))?;
        let lock = RunLock::acquire(&path)?;
        let in_place = check_run_dir(&path, ctx.resumed_from.as_deref(), ctx.args.overwrite)?;
        let metrics_path = path.join(METRICS_FILE);
        let metrics = if in_place {
            MetricsLog::resume(&metrics_path, step)?
        } else {
            clear_run_dir(&path)?;
            MetricsLog::create(&metrics_path)?
        };
        // A run resumed in its own directory already has this step's
        // checkpoint.
        let last_ck = ctx.resumed_from.clone().filter(|_| in_place);
        Ok(RunDir {
            path,
            metrics,
            last_ck,
            _lock: lock,
        })
    }
}

/// True when the checkpoint `ck_dir` lives in `run_dir`'s checkpoints, i.e.
/// the run continues in its own directory.
fn same_run_dir(ck_dir: &Path, run_dir: &Path) -> bool {
    match (
        ck_dir.canonicalize(),
        run_dir.join(CHECKPOINTS_DIR).canonicalize(),
    ) {
        (Ok(a), Ok(b)) => a.starts_with(b),
        _ => false,
    }
}

/// Remove the previous run's artifacts that [`check_run_dir`] allowed to
/// replace (`--overwrite`): only the files this program writes (checkpoint
/// directories, `LATEST`, our temp files, metrics, plot); anything else
/// stays.
fn clear_run_dir(run_dir: &Path) -> Result<()> {
    let what = other_run_files(run_dir);
    let ck = run_dir.join(CHECKPOINTS_DIR);
    if let Ok(rd) = fs::read_dir(&ck) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            let p = e.path();
            let ours = n.starts_with("step-") || n.starts_with(".tmp-") || n == LATEST;
            if !ours {
                continue;
            }
            if p.is_dir() {
                fs::remove_dir_all(&p).map_err(|e| io_err(&p, e))?;
            } else {
                fs::remove_file(&p).map_err(|e| io_err(&p, e))?;
            }
        }
        // Only if nothing else was kept there.
        let _ = fs::remove_dir(&ck);
    }
    for f in [METRICS_FILE, PLOT_FILE] {
        let p = run_dir.join(f);
        if p.exists() {
            fs::remove_file(&p).map_err(|e| io_err(&p, e))?;
        }
    }
    if !what.is_empty() {
        stderr_line(&format!(
            "note: --overwrite: removed the previous run's {} from {}",
            what.join(", "),
            run_dir.display()
        ));
    }
    Ok(())
}

pub(crate) fn write_plot(run_dir: &Path, run: &RunConfig) -> Result<()> {
    let records = read_records(&run_dir.join(METRICS_FILE))?;
    let pts: Vec<(u64, f64)> = records.iter().map(|r| (r.step, r.loss)).collect();
    let title = format!(
        "{}: d_model {}, {} layers, batch {} x {}, seed {}",
        run.task.kind(),
        run.model.d_model,
        run.model.n_layer,
        run.batch,
        run.logical_world,
        run.seed
    );
    let path = run_dir.join(PLOT_FILE);
    atomic::replace_file(&path, loss_svg(&title, &pts).as_bytes()).map_err(|e| io_err(&path, e))
}
