//! The self-spawn supervisor: one child process per rank, watched until the
//! world ends, torn down at the first failure.
//!
//! Over 450 lines: spawning, the wait loop (failure teardown, deadline,
//! stop-request forwarding) and reaping share the `Supervisor`'s private
//! child table; the stop forwarding joined this round. Splitting the wait
//! loop into its own file is the next step when it grows again.

use std::fs;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, RecvTimeoutError, Sender};

use super::behind::{observe, rings_text, RankFlight};
use super::{RankExit, RankStatus, SpawnOptions, WorldReport};
use crate::bootstrap::{
    default_rendezvous_root, new_launch_id, validate_id, vars, Launcher, ProcessEnv, WorldPlace,
};
use crate::rendezvous::file::{make_owned_launch_dir, prepare_root, purge_stale};
use crate::stop_signal::StopSignal;
use crate::{CommError, Result};

/// How often the supervisor looks for a stop request while it waits.
const STOP_POLL: Duration = Duration::from_millis(50);
/// How long the other ranks may take to follow a rank that stopped on
/// request before the supervisor kills them (they end the same step; rank
/// 0 writes a checkpoint first).
pub const STOP_GRACE: Duration = Duration::from_secs(10);

/// A running world of child processes.
///
/// Ownership: the supervisor owns every child until it is reaped. Dropping
/// a supervisor that was not waited for kills (SIGKILL) and reaps the
/// children that are still running.
///
/// Linux: each child is started with `PR_SET_PDEATHSIG = SIGKILL`, so it
/// dies when the supervisor dies. The kernel ties that signal to the
/// *thread* that spawned the child: keep the thread that called
/// [`Supervisor::spawn`] alive until the world ends (as [`spawn_world`]
/// does, by waiting on the same thread).
#[derive(Debug)]
pub struct Supervisor {
    world: usize,
    launch_id: String,
    job_dir: PathBuf,
    launch_dir: PathBuf,
    /// Held (flock) while this supervisor lives: marks the launch directory
    /// live, so no other launch's purge removes it.
    _owner_lock: fs::File,
    children: Vec<Option<Child>>,
    pids: Vec<u32>,
    exits: Vec<Option<RankExit>>,
    killed: Vec<bool>,
    started: Instant,
    opts: SpawnOptions,
    /// Exit notices from the waiter threads: (rank, when it ended).
    exited: Receiver<(usize, Instant)>,
    exited_tx: Sender<(usize, Instant)>,
    /// What the ranks looked like when the world failed (see
    /// [`Supervisor::observe_failure`]).
    flight: Option<Vec<RankFlight>>,
}

/// Spawn a world and wait for it: [`Supervisor::spawn`] then
/// [`Supervisor::wait`]. `Ok` means every rank was started and reaped; look
/// at the report (or call [`WorldReport::check`]) for how they ended.
pub fn spawn_world(world: usize, opts: SpawnOptions) -> Result<WorldReport> {
    Supervisor::spawn(world, opts)?.wait()
}

/// Rank, world and local-rank variables of the external launchers. The
/// supervisor removes them from its ranks' environments: a rank of ours is
/// described by `MAMBA_*` alone, and a launcher around the supervisor (whose
/// variables would otherwise leak down) describes the supervisor, not the
/// ranks.
const SCRUBBED_LAUNCHER_VARS: [&str; 9] = [
    vars::RANK,
    vars::WORLD_SIZE,
    vars::LOCAL_RANK,
    vars::OMPI_COMM_WORLD_RANK,
    vars::OMPI_COMM_WORLD_SIZE,
    vars::OMPI_COMM_WORLD_LOCAL_RANK,
    vars::SLURM_PROCID,
    vars::SLURM_NTASKS,
    vars::SLURM_LOCALID,
];

fn status_of(status: std::process::ExitStatus) -> RankStatus {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => RankStatus::Exited(c),
        (None, Some(s)) => RankStatus::Signaled(s),
        // Neither code nor signal cannot happen for a reaped child on Unix;
        // report it as a failure rather than inventing success.
        (None, None) => RankStatus::Exited(-1),
    }
}

impl Supervisor {
    /// Start `world` ranks: purge the job's stale directory, create a fresh
    /// private launch directory named by a new launch nonce, and run the
    /// program once per rank with the `MAMBA_*` contract added to this
    /// process's environment (everything else, e.g. `NCCL_NVLS_ENABLE`, is
    /// inherited). If any spawn fails, the ranks already started are killed
    /// and reaped and the error names the rank.
    pub fn spawn(world: usize, opts: SpawnOptions) -> Result<Supervisor> {
        Supervisor::spawn_with(world, opts, |_, cmd| cmd.spawn())
    }

    /// [`Supervisor::spawn`] with the final `Command::spawn` replaceable,
    /// so tests can make one rank's start fail.
    fn spawn_with(
        world: usize,
        opts: SpawnOptions,
        mut start: impl FnMut(usize, &mut Command) -> std::io::Result<Child>,
    ) -> Result<Supervisor> {
        if world == 0 {
            return Err(CommError::config("a world needs at least one rank, got 0"));
        }
        if let Some(l) = opts.logical_world {
            if l == 0 || l % world != 0 {
                return Err(CommError::env(
                    vars::MAMBA_LOGICAL_WORLD,
                    format!("the world of {world} processes must divide the logical world {l}"),
                ));
            }
        }
        let program = match &opts.program {
            Some(p) => p.clone(),
            None => std::env::current_exe().map_err(|e| {
                CommError::config(format!("cannot find this program to re-execute: {e}"))
            })?,
        };
        let args = opts
            .args
            .clone()
            .unwrap_or_else(|| std::env::args_os().skip(1).collect());
        let root = opts
            .rendezvous_root
            .clone()
            .unwrap_or_else(|| default_rendezvous_root(&ProcessEnv));
        let job_id = opts
            .job_id
            .clone()
            .unwrap_or_else(|| format!("pid-{}", std::process::id()));
        validate_id(vars::MAMBA_JOB_ID, &job_id)?;
        let launch_id = new_launch_id()?;

        prepare_root(&root, 0)?;
        purge_stale(&root, &job_id)?;
        let job_dir = root.join(&job_id);
        let (launch_dir, owner_lock) = make_owned_launch_dir(&job_dir, &launch_id)?;

        let (exited_tx, exited) = unbounded();
        let mut sup = Supervisor {
            world,
            launch_id: launch_id.clone(),
            job_dir,
            launch_dir,
            _owner_lock: owner_lock,
            children: Vec::with_capacity(world),
            pids: Vec::with_capacity(world),
            exits: vec![None; world],
            killed: vec![false; world],
            started: Instant::now(),
            opts,
            exited,
            exited_tx,
            flight: None,
        };
        for rank in 0..world {
            let place = WorldPlace {
                rank,
                world,
                local_rank: rank,
                job_id: job_id.clone(),
                launch_id: Some(launch_id.clone()),
                rendezvous_dir: Some(root.clone()),
                master: None,
                seed: sup.opts.seed,
                logical_world: sup.opts.logical_world,
                launcher: Launcher::Mamba,
            };
            let mut cmd = Command::new(&program);
            for var in SCRUBBED_LAUNCHER_VARS {
                cmd.env_remove(var);
            }
            cmd.args(&args)
                .envs(place.contract_env())
                .stdin(Stdio::null());
            for (k, v) in &sup.opts.env {
                cmd.env(k, v);
            }
            set_parent_death_signal(&mut cmd);
            let started = start(rank, &mut cmd).and_then(|child| {
                let pid = child.id();
                sup.pids.push(pid);
                sup.children.push(Some(child));
                watch_exit(rank, pid, sup.exited_tx.clone())
            });
            match started {
                Ok(()) => {}
                Err(e) => {
                    sup.kill_all();
                    sup.reap_all();
                    sup.cleanup();
                    return Err(CommError::transport(
                        format!("spawn rank {rank}"),
                        format!(
                            "could not start rank {rank} of {world} ({}): {e}; the {rank} rank(s) \
                             already started were killed and reaped",
                            program.display()
                        ),
                    ));
                }
            }
        }
        Ok(sup)
    }

    /// Process ids of the ranks, in rank order.
    pub fn pids(&self) -> &[u32] {
        &self.pids
    }

    /// The launch nonce handed to every rank.
    pub fn launch_id(&self) -> &str {
        &self.launch_id
    }

    /// This launch's rendezvous directory (`<root>/<job>/<launch>`).
    pub fn launch_dir(&self) -> &std::path::Path {
        &self.launch_dir
    }

    /// Watch the ranks until all have ended. At the first non-zero exit or
    /// signal, wait `grace`, then kill (SIGKILL) every rank still running and
    /// reap it; likewise at the world's deadline. Removes the launch
    /// directory at the end and returns every rank's exit.
    ///
    /// "First" is exact: one waiter thread per child blocks in
    /// `waitid(WNOWAIT)` and reports the moment its child ends (without
    /// reaping it, so its pid cannot be reused before this thread reaps).
    pub fn wait(mut self) -> Result<WorldReport> {
        let deadline = self.opts.deadline.map(|d| self.started + d);
        let mut first_failure = None;
        let mut kill_at: Option<Instant> = None;
        let mut timed_out = false;
        let mut killed_all = false;
        // SIGTERM/SIGINT to the supervisor: forwarded once to every rank,
        // which stop in agreement; a second one ends this process at once
        // (and its ranks with it: their parent-death signal).
        let stop = StopSignal::install()?;
        let mut forwarded = None;
        while self.children.iter().any(Option::is_some) {
            if forwarded.is_none() {
                if let Some(sig) = stop.requested() {
                    self.forward(sig);
                    forwarded = Some(sig);
                }
            }
            let poll = (forwarded.is_none() && !killed_all).then(|| Instant::now() + STOP_POLL);
            let wake = if killed_all {
                None
            } else {
                match (deadline, kill_at) {
                    (Some(d), Some(k)) => Some(d.min(k)),
                    (d, k) => d.or(k),
                }
            };
            let woken_to_poll = match (wake, poll) {
                (Some(w), Some(p)) => p < w,
                (None, Some(_)) => true,
                _ => false,
            };
            let wake = match (wake, poll) {
                (Some(w), Some(p)) => Some(w.min(p)),
                (w, p) => w.or(p),
            };
            let notice = match wake {
                Some(w) => self.exited.recv_deadline(w),
                None => self
                    .exited
                    .recv()
                    .map_err(|_| RecvTimeoutError::Disconnected),
            };
            match notice {
                Ok((rank, at)) => {
                    let status = match self.children[rank].as_mut() {
                        Some(child) => match child.wait() {
                            Ok(st) => status_of(st),
                            Err(_) => RankStatus::Signaled(libc::SIGKILL),
                        },
                        None => continue,
                    };
                    self.record(rank, status, at);
                    if status.failed() && first_failure.is_none() {
                        first_failure = Some(rank);
                    }
                    // A stopped rank also starts the teardown clock: its
                    // peers stop at the same step and follow within
                    // STOP_GRACE (they finish the step, rank 0 writes a
                    // checkpoint), or are stuck and get killed.
                    if !status.success() && kill_at.is_none() {
                        let grace = if status.failed() {
                            self.opts.grace
                        } else {
                            self.opts.grace.max(STOP_GRACE)
                        };
                        kill_at = Some(Instant::now() + grace);
                    }
                }
                Err(RecvTimeoutError::Timeout) if woken_to_poll => {}
                Err(RecvTimeoutError::Timeout) => {
                    timed_out =
                        first_failure.is_none() && deadline.is_some_and(|d| Instant::now() >= d);
                    if first_failure.is_some() || timed_out {
                        self.observe_failure();
                    }
                    self.kill_all();
                    killed_all = true;
                }
                Err(RecvTimeoutError::Disconnected) => {
                    // Unreachable while we hold a sender; reap directly.
                    self.kill_all();
                    self.reap_all();
                }
            }
        }
        if first_failure.is_some() || timed_out {
            self.observe_failure();
        }
        let flight = self.flight.take().unwrap_or_default();
        let mut report = WorldReport {
            ranks: self.exits.iter().flatten().cloned().collect(),
            first_failure,
            forwarded_stop: forwarded,
            timed_out,
            launch_id: self.launch_id.clone(),
            elapsed: self.started.elapsed(),
            flight,
            flight_file: None,
        };
        if report.ranks.len() == self.world {
            report.flight_file = self.keep_rings(&report);
        }
        self.cleanup();
        let ranks: Vec<RankExit> = self.exits.iter_mut().filter_map(Option::take).collect();
        if ranks.len() != self.world {
            return Err(CommError::transport(
                "supervise",
                format!(
                    "only {} of {} ranks could be reaped",
                    ranks.len(),
                    self.world
                ),
            ));
        }
        report.ranks = ranks;
        report.elapsed = self.started.elapsed();
        Ok(report)
    }

    /// Once, when the world has failed and before anything is killed: every
    /// rank's process state and flight recorder ring (a stopped or hung
    /// rank cannot write its own; its memory-mapped ring is in the launch
    /// directory).
    fn observe_failure(&mut self) {
        if self.flight.is_none() {
            let alive: Vec<bool> = self.children.iter().map(Option::is_some).collect();
            self.flight = Some(observe(&self.launch_dir, &self.pids, &alive));
        }
    }

    /// Keep every rank's ring as text beside the launch directory (which
    /// `cleanup` removes): `<root>/<job>/flight-<launch>.txt`, written
    /// atomically; the job's next launch purges it. `None` when no rank
    /// kept a ring or the file could not be written (the report still
    /// holds the rings).
    fn keep_rings(&self, report: &WorldReport) -> Option<PathBuf> {
        if report.flight.iter().all(|r| r.ring.is_none()) {
            return None;
        }
        let path = self.job_dir.join(format!("flight-{}.txt", self.launch_id));
        let text = rings_text(&report.flight, &report.headline());
        crate::flight::write_atomic(&path, text.as_bytes()).ok()?;
        Some(path)
    }

    fn record(&mut self, rank: usize, status: RankStatus, at: Instant) {
        self.children[rank] = None;
        self.exits[rank] = Some(RankExit {
            rank,
            pid: self.pids[rank],
            status,
            killed_by_supervisor: self.killed[rank],
            at: at.saturating_duration_since(self.started),
        });
    }

    fn kill(&mut self, rank: usize) {
        if let Some(child) = self.children[rank].as_mut() {
            self.killed[rank] = true;
            // Fails only if the child already exited; reaping will tell.
            let _ = child.kill();
        }
    }

    /// Send `sig` to every rank still running.
    fn forward(&mut self, sig: i32) {
        for child in self.children.iter().flatten() {
            // SAFETY: kill has no memory preconditions; the pid is a child
            // not yet reaped (its waiter uses WNOWAIT), so it cannot have
            // been reused.
            unsafe { libc::kill(child.id() as libc::pid_t, sig) };
        }
    }

    fn kill_all(&mut self) {
        for rank in 0..self.children.len() {
            self.kill(rank);
        }
    }

    /// Blocking wait for every child still held (after `kill_all`).
    fn reap_all(&mut self) {
        for rank in 0..self.children.len() {
            let status = match self.children[rank].as_mut() {
                Some(child) => match child.wait() {
                    Ok(st) => status_of(st),
                    // Already reaped elsewhere or not waitable: it was killed.
                    Err(_) => RankStatus::Signaled(libc::SIGKILL),
                },
                None => continue,
            };
            self.record(rank, status, Instant::now());
        }
    }

    fn cleanup(&mut self) {
        let _ = fs::remove_dir_all(&self.launch_dir);
        // Leaves the job directory if another launch of the job is using it.
        let _ = fs::remove_dir(&self.job_dir);
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        if self.children.iter().any(Option::is_some) {
            self.kill_all();
            self.reap_all();
            self.cleanup();
        }
    }
}

/// Start a thread that reports (rank, time) on `tx` when child `pid` ends,
/// without reaping it.
fn watch_exit(rank: usize, pid: u32, tx: Sender<(usize, Instant)>) -> std::io::Result<()> {
    thread::Builder::new()
        .name(format!("mamba-watch-{rank}"))
        .spawn(move || loop {
            // SAFETY: siginfo_t is plain data; all-zero is a valid value.
            let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
            // SAFETY: waits (without reaping: WNOWAIT) for a child of this
            // process; `info` is a valid out-pointer.
            let r = unsafe {
                libc::waitid(
                    libc::P_PID,
                    pid as libc::id_t,
                    &mut info,
                    libc::WEXITED | libc::WNOWAIT,
                )
            };
            if r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // Ended (or already reaped: ECHILD). Either way, report it.
            let _ = tx.send((rank, Instant::now()));
            return;
        })?;
    Ok(())
}

/// Linux: make the child die (SIGKILL) when the spawning thread of the
/// supervisor dies, and close the race where the supervisor died between
/// fork and prctl. Other systems: nothing (no such facility).
fn set_parent_death_signal(cmd: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: the closure runs in the forked child before exec and calls
        // only async-signal-safe functions (prctl, getppid); it allocates
        // nothing.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(
                    libc::PR_SET_PDEATHSIG,
                    libc::SIGKILL as libc::c_ulong,
                    0,
                    0,
                    0,
                ) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != parent {
                    // The supervisor is already gone: do not start an orphan rank.
                    return Err(std::io::Error::from_raw_os_error(libc::ESRCH));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn opts(root: &std::path::Path, job: &str) -> SpawnOptions {
        SpawnOptions {
            program: Some(PathBuf::from("/bin/sh")),
            rendezvous_root: Some(root.to_path_buf()),
            job_id: Some(job.to_string()),
            ..SpawnOptions::default()
        }
    }

    #[test]
    fn every_rank_gets_the_contract_and_success_is_reported() {
        let root = tempfile::tempdir().expect("tmp");
        let out = tempfile::tempdir().expect("tmp");
        let script = format!(
            "echo \"$MAMBA_RANK $MAMBA_WORLD_SIZE $MAMBA_LOCAL_RANK $MAMBA_JOB_ID $MAMBA_LAUNCH_ID $MAMBA_SEED $KEEP_ME $PATH\" > {}/$MAMBA_RANK",
            out.path().display()
        );
        let mut o = opts(root.path(), "contract");
        o.args = Some(vec!["-c".into(), script.into()]);
        o.seed = Some(17);
        let o = o.env("KEEP_ME", "kept");
        let report = spawn_world(3, o).expect("world");
        assert!(report.success(), "{report}");
        report.check().expect("check");
        for r in 0..3 {
            let line = fs::read_to_string(out.path().join(r.to_string())).expect("rank wrote");
            // The parent's environment (here PATH) is inherited unchanged.
            let path = std::env::var("PATH").unwrap_or_default();
            assert_eq!(
                line.trim(),
                format!("{r} 3 {r} contract {} 17 kept {path}", report.launch_id).trim()
            );
        }
        assert!(
            !root.path().join("contract").exists(),
            "launch directory left behind"
        );
    }

    /// Ranks of our supervisor are described by `MAMBA_*` alone: the rank
    /// variables of a launcher around the supervisor (e.g. `srun -n 1`
    /// running `cargo test`) are not handed down, where they would
    /// contradict the ranks' own.
    #[test]
    fn launcher_rank_variables_are_not_handed_to_the_ranks() {
        let root = tempfile::tempdir().expect("tmp");
        let mut seen = Vec::new();
        let res = Supervisor::spawn_with(2, opts(root.path(), "scrub"), |rank, cmd| {
            let removed: Vec<String> = cmd
                .get_envs()
                .filter(|(_, v)| v.is_none())
                .map(|(k, _)| k.to_string_lossy().into_owned())
                .collect();
            seen.push((rank, removed));
            Err(std::io::Error::other("stop after inspecting"))
        });
        assert!(res.is_err());
        let (_, removed) = &seen[0];
        for var in SCRUBBED_LAUNCHER_VARS {
            assert!(
                removed.iter().any(|k| k == var),
                "{var} handed down: {removed:?}"
            );
        }
        for var in [vars::RANK, vars::OMPI_COMM_WORLD_RANK, vars::SLURM_PROCID] {
            assert!(SCRUBBED_LAUNCHER_VARS.contains(&var));
        }
    }

    /// A launch directory as a supervisor leaves it: private, with the
    /// owner's lock file; `hold` keeps the lock like a live supervisor.
    fn fake_launch(root: &std::path::Path, job: &str, nonce: &str, hold: bool) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let dir = root.join(job).join(nonce);
        fs::create_dir_all(&dir).expect("mkdir");
        for d in [root.join(job), dir.clone()] {
            fs::set_permissions(&d, fs::Permissions::from_mode(0o700)).expect("chmod");
        }
        fs::write(dir.join("nccl-id"), [7u8; 128]).expect("stale value");
        let lock = crate::rendezvous::file::hold_owner_lock(&dir).expect("lock");
        if hold {
            std::mem::forget(lock);
        }
        dir
    }

    #[test]
    fn stale_launches_are_purged_and_live_ones_kept() {
        let root = tempfile::tempdir().expect("tmp");
        let dead_other = fake_launch(root.path(), "pid-4000000", &"a".repeat(32), false);
        let live_other = fake_launch(root.path(), "pid-4000001", &"b".repeat(32), true);
        let dead_same = fake_launch(root.path(), "shared", &"c".repeat(32), false);
        let live_same = fake_launch(root.path(), "shared", &"d".repeat(32), true);
        let mut o = opts(root.path(), "shared");
        o.args = Some(vec!["-c".into(), "exit 0".into()]);
        let report = spawn_world(2, o).expect("world");
        assert!(report.success(), "{report}");
        assert!(
            !dead_other.exists(),
            "a killed supervisor's launch survived"
        );
        assert!(
            !root.path().join("pid-4000000").exists(),
            "its empty job directory survived"
        );
        assert!(!dead_same.exists(), "a stale launch of this job survived");
        assert!(
            live_other.join("nccl-id").exists(),
            "a live launch was purged"
        );
        assert!(
            live_same.join("nccl-id").exists(),
            "a concurrent launch of this job was purged"
        );
    }

    #[test]
    fn first_failure_kills_the_rest_quickly() {
        let root = tempfile::tempdir().expect("tmp");
        let mut o = opts(root.path(), "failfast");
        o.args = Some(vec![
            "-c".into(),
            "if [ \"$MAMBA_RANK\" = 1 ]; then exit 3; fi; exec sleep 30".into(),
        ]);
        let start = Instant::now();
        let report = spawn_world(3, o).expect("world");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "teardown took {:?}",
            start.elapsed()
        );
        assert_eq!(report.first_failure, Some(1));
        assert_eq!(report.ranks[1].status, RankStatus::Exited(3));
        assert!(!report.ranks[1].killed_by_supervisor);
        for r in [0, 2] {
            assert_eq!(report.ranks[r].status, RankStatus::Signaled(libc::SIGKILL));
            assert!(report.ranks[r].killed_by_supervisor);
        }
        match report.check() {
            Err(CommError::PeerFailed { rank: 1, detail }) => {
                assert!(detail.contains("code 3"), "{detail}")
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn the_world_deadline_kills_a_hung_world() {
        let root = tempfile::tempdir().expect("tmp");
        let mut o = opts(root.path(), "deadline");
        o.args = Some(vec!["-c".into(), "exec sleep 30".into()]);
        o.deadline = Some(Duration::from_millis(300));
        let report = spawn_world(2, o).expect("world");
        assert!(report.timed_out);
        assert!(report.check().is_err());
        assert!(report.ranks.iter().all(|r| r.killed_by_supervisor));
    }

    #[test]
    fn a_spawn_failure_reaps_the_started_ranks() {
        let root = tempfile::tempdir().expect("tmp");
        let mut o = opts(root.path(), "spawnfail");
        o.args = Some(vec!["-c".into(), "exec sleep 30".into()]);
        let mut started = Vec::new();
        let res = Supervisor::spawn_with(4, o, |rank, cmd| {
            if rank == 2 {
                return Err(std::io::Error::other("injected: no more processes"));
            }
            let child = cmd.spawn()?;
            started.push(child.id());
            Ok(child)
        });
        match res {
            Err(CommError::Transport { op, detail }) => {
                assert_eq!(op, "spawn rank 2");
                assert!(detail.contains("injected"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(started.len(), 2);
        for pid in started {
            // SAFETY: signal 0 only checks for existence.
            let alive = unsafe { libc::kill(pid as libc::pid_t, 0) } == 0;
            assert!(!alive, "rank pid {pid} was left running (or unreaped)");
        }
        assert!(
            !root.path().join("spawnfail").exists(),
            "launch directory left behind"
        );
        // A program that cannot be executed fails the same way at rank 0.
        let mut o = opts(root.path(), "noprogram");
        o.program = Some(PathBuf::from("/nonexistent/mamba-no-such-program"));
        match Supervisor::spawn(2, o) {
            Err(CommError::Transport { op, detail }) => {
                assert_eq!(op, "spawn rank 0");
                assert!(detail.contains("mamba-no-such-program"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn bad_job_ids_and_worlds_are_refused_before_spawning() {
        let root = tempfile::tempdir().expect("tmp");
        let marker = root.path().join("spawned");
        for (world, job) in [(2, "../escape"), (2, "a/b"), (0, "ok")] {
            let mut o = opts(root.path(), job);
            o.args = Some(vec![
                "-c".into(),
                format!("touch {}", marker.display()).into(),
            ]);
            assert!(Supervisor::spawn(world, o).is_err(), "{world} {job}");
        }
        let mut o = opts(root.path(), "ok");
        o.logical_world = Some(3);
        assert!(matches!(
            Supervisor::spawn(2, o),
            Err(CommError::EnvContract { .. })
        ));
        assert!(!marker.exists(), "a rank was spawned");
    }

    #[test]
    fn a_stale_job_directory_is_purged_before_spawning() {
        let root = tempfile::tempdir().expect("tmp");
        let stale = root
            .path()
            .join("reused")
            .join("0123456789abcdef0123456789abcdef");
        fs::create_dir_all(&stale).expect("stale dir");
        fs::write(stale.join("nccl-unique-id"), [7u8; 128]).expect("stale id");
        let mut o = opts(root.path(), "reused");
        // Each rank reports whether it can still see the stale file.
        o.args = Some(vec![
            "-c".into(),
            format!("test ! -e {}", stale.join("nccl-unique-id").display()).into(),
        ]);
        let report = spawn_world(2, o).expect("world");
        assert!(report.success(), "ranks saw the stale file:\n{report}");
    }
}
