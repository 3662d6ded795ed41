//! Worlds of real processes: the supervisor, the host transport over
//! loopback sockets, and fault injection (kill -9, SIGSTOP, a killed
//! supervisor, malformed environments).
//!
//! Each `#[test]` runs twice over: once as the supervisor side (a normal
//! test), and once per rank in a child process that re-executes this test
//! binary with the same test name (`is_rank_process()` is true there).
//! Ranks report how they failed through their exit code.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use mamba_comm::bootstrap::{detect, is_rank_process, vars, Launcher, ProcessEnv, WorldPlace};
use mamba_comm::host::{HostOptions, HostTransport};
use mamba_comm::rendezvous;
use mamba_comm::supervisor::{
    start_world, test_spawn, test_world, test_world_with, RankStatus, Role, SpawnOptions,
};
use mamba_comm::{CommError, Rendezvous, Transport};

/// The rank failed with an error that names the expected culprit.
const EXIT_NAMED: i32 = 42;
/// The rank failed with an error that names someone else.
const EXIT_OTHER: i32 = 43;
/// The rank never saw an error (the fault did not propagate).
const EXIT_NO_ERROR: i32 = 44;

const PROGRESS_DIR: &str = "MAMBA_TEST_PROGRESS_DIR";

fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// Rank side: find the place, open the rendezvous, connect the transport.
fn join(timeout: Duration) -> (WorldPlace, Box<dyn Rendezvous>, HostTransport) {
    let place = detect(&ProcessEnv)
        .expect("valid contract")
        .expect("a rank has a place");
    let rdv = rendezvous::open(&place, Duration::from_secs(10)).expect("rendezvous");
    let t = HostTransport::connect(&*rdv, HostOptions::with_timeout(timeout)).expect("connect");
    (place, rdv, t)
}

fn names_rank(e: &CommError, r: usize) -> bool {
    match e {
        CommError::PeerFailed { rank, .. } => *rank == r,
        CommError::Transport { detail, .. } => detail.contains(&format!("for rank {r} ")),
        _ => false,
    }
}

/// Leave the process with the verdict on `e` (no destructors: this is
/// what a rank that gives up does).
fn exit_with(e: &CommError, culprit: usize, rank: usize) -> ! {
    eprintln!("rank {rank}: {e}");
    std::process::exit(if names_rank(e, culprit) {
        EXIT_NAMED
    } else {
        EXIT_OTHER
    });
}

/// Rank side of the fault tests: all-reduce forever; `marker` rank writes
/// the progress file after some rounds so the test knows the world is
/// mid-collective.
fn collective_loop(culprit: usize, timeout: Duration) -> ! {
    let (place, _rdv, mut t) = join(timeout);
    let progress = env_var(PROGRESS_DIR)
        .map(PathBuf::from)
        .expect("progress dir");
    let mut v = vec![0.0f32; 10_000];
    for round in 0..1_000_000u64 {
        if round == 20 && place.rank == culprit {
            fs::write(progress.join("ready"), b"").expect("progress file");
        }
        v.iter_mut().for_each(|x| *x = place.rank as f32);
        if let Err(e) = t.all_reduce_sum_f32(&mut v, 0..10_000) {
            exit_with(&e, culprit, place.rank);
        }
    }
    std::process::exit(EXIT_NO_ERROR)
}

fn wait_for(path: &Path, limit: Duration) {
    let start = Instant::now();
    while !path.exists() {
        assert!(start.elapsed() < limit, "{} never appeared", path.display());
        thread::sleep(Duration::from_millis(5));
    }
}

fn gone(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: sending a signal to a child we spawned.
    let r = unsafe { libc::kill(pid as libc::pid_t, sig) };
    assert_eq!(r, 0, "kill({pid}, {sig})");
}

#[test]
fn self_spawned_world_all_reduces() {
    if is_rank_process() {
        let (place, _rdv, mut t) = join(Duration::from_secs(20));
        assert_eq!(place.launcher, Launcher::Mamba);
        assert_eq!(place.seed, Some(1234));
        assert!(place.launch_id.is_some());
        let mut v = vec![place.rank as f32 + 1.0; 1000];
        t.all_reduce_sum_f32(&mut v, 0..1000).expect("sum");
        assert!(v.iter().all(|&x| x == 10.0), "sum of 1..=4");
        let mut m = [place.rank as i32];
        t.all_reduce_max_i32(&mut m).expect("max");
        assert_eq!(m, [3]);
        t.barrier().expect("barrier");
        t.shutdown().expect("shutdown");
        return;
    }
    let report = test_world(
        "self_spawned_world_all_reduces",
        4,
        &[(vars::MAMBA_SEED, "1234")],
    )
    .expect("spawn");
    report.check().expect("every rank succeeded");
    assert_eq!(report.ranks.len(), 4);
    assert!(
        report.ranks.iter().all(|r| gone(r.pid)),
        "a rank outlived the report"
    );
}

#[test]
fn kill_9_one_rank_mid_collective() {
    const VICTIM: usize = 2;
    if is_rank_process() {
        collective_loop(VICTIM, Duration::from_secs(30));
    }
    let progress = tempfile::tempdir().expect("tmp");
    let opts = SpawnOptions {
        grace: Duration::from_secs(5), // ranks must end by themselves, not by teardown
        ..SpawnOptions::default()
    }
    .env(PROGRESS_DIR, progress.path());
    let sup = test_spawn("kill_9_one_rank_mid_collective", 4, opts).expect("spawn");
    let pids = sup.pids().to_vec();
    wait_for(&progress.path().join("ready"), Duration::from_secs(10));
    let killed_at = Instant::now();
    signal(pids[VICTIM], libc::SIGKILL);
    let report = sup.wait().expect("reaped");
    let took = killed_at.elapsed();
    assert!(
        took < Duration::from_secs(2),
        "world ended {took:?} after the kill:\n{report}"
    );
    assert_eq!(report.first_failure, Some(VICTIM), "{report}");
    assert_eq!(
        report.ranks[VICTIM].status,
        RankStatus::Signaled(libc::SIGKILL)
    );
    for r in (0..4).filter(|&r| r != VICTIM) {
        assert_eq!(
            report.ranks[r].status,
            RankStatus::Exited(EXIT_NAMED),
            "rank {r} did not end with an error naming rank {VICTIM}:\n{report}"
        );
        assert!(
            !report.ranks[r].killed_by_supervisor,
            "rank {r} needed the supervisor:\n{report}"
        );
    }
    assert!(pids.iter().all(|&p| gone(p)), "a process was left behind");
    match report.check() {
        Err(CommError::PeerFailed { rank, .. }) => assert_eq!(rank, VICTIM),
        other => panic!("{other:?}"),
    }
}

#[test]
fn sigstop_rank_hits_the_deadline_and_the_world_is_torn_down() {
    const VICTIM: usize = 1;
    if is_rank_process() {
        collective_loop(VICTIM, Duration::from_secs(1));
    }
    let progress = tempfile::tempdir().expect("tmp");
    let opts = SpawnOptions {
        grace: Duration::from_millis(1500),
        ..SpawnOptions::default()
    }
    .env(PROGRESS_DIR, progress.path());
    let sup = test_spawn(
        "sigstop_rank_hits_the_deadline_and_the_world_is_torn_down",
        4,
        opts,
    )
    .expect("spawn");
    let pids = sup.pids().to_vec();
    wait_for(&progress.path().join("ready"), Duration::from_secs(10));
    let stopped_at = Instant::now();
    signal(pids[VICTIM], libc::SIGSTOP);
    let report = sup.wait().expect("reaped");
    let took = stopped_at.elapsed();
    // Deadline (1 s, followers 1.3 s) + grace (1.5 s) + slack.
    assert!(took < Duration::from_secs(5), "took {took:?}:\n{report}");
    assert!(
        took >= Duration::from_millis(900),
        "ended before the deadline could fire: {took:?}\n{report}"
    );
    for r in (0..4).filter(|&r| r != VICTIM) {
        assert_eq!(
            report.ranks[r].status,
            RankStatus::Exited(EXIT_NAMED),
            "rank {r}:\n{report}"
        );
    }
    // The stopped rank cannot end by itself: the supervisor killed it.
    assert_eq!(
        report.ranks[VICTIM].status,
        RankStatus::Signaled(libc::SIGKILL),
        "{report}"
    );
    assert!(report.ranks[VICTIM].killed_by_supervisor);
    assert!(pids.iter().all(|&p| gone(p)), "a process was left behind");
}

/// Reap `pid` (an orphan adopted by this subreaper) within `limit`.
fn reap_within(pid: u32, limit: Duration) -> Option<libc::c_int> {
    let start = Instant::now();
    while start.elapsed() < limit {
        let mut status = 0;
        // SAFETY: waitpid on a pid we adopted as subreaper.
        let r = unsafe { libc::waitpid(pid as libc::pid_t, &mut status, libc::WNOHANG) };
        if r == pid as libc::pid_t {
            return Some(status);
        }
        thread::sleep(Duration::from_millis(5));
    }
    None
}

#[test]
fn a_killed_supervisor_takes_its_ranks_with_it() {
    const ROLE: &str = "MAMBA_TEST_ROLE";
    const NAME: &str = "a_killed_supervisor_takes_its_ranks_with_it";
    if is_rank_process() {
        let (place, _rdv, mut t) = join(Duration::from_secs(60));
        let dir = env_var(PROGRESS_DIR).expect("pid dir");
        fs::write(
            Path::new(&dir).join(format!("rank{}.pid", place.rank)),
            std::process::id().to_string(),
        )
        .expect("pid file");
        // Park inside a collective that cannot complete (rank 0 never joins).
        if place.rank != 0 {
            let _ = t.barrier();
        }
        thread::sleep(Duration::from_secs(60));
        std::process::exit(EXIT_NO_ERROR);
    }
    if env_var(ROLE).as_deref() == Some("supervisor") {
        // The middle process: supervise until killed (its rendezvous under
        // the test's temporary directory, which the test removes).
        let root = Path::new(&env_var(PROGRESS_DIR).expect("dir")).join("rdv");
        let _ = test_world_with(
            NAME,
            2,
            SpawnOptions {
                rendezvous_root: Some(root),
                ..SpawnOptions::default()
            },
        );
        std::process::exit(EXIT_NO_ERROR);
    }
    // SAFETY: makes this test process adopt orphaned descendants so it can
    // reap (and thereby observe) the ranks after their supervisor dies.
    assert_eq!(
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) },
        0
    );
    let pids = tempfile::tempdir().expect("tmp");
    let exe = std::env::current_exe().expect("test binary");
    let mut supervisor = Command::new(exe)
        .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(ROLE, "supervisor")
        .env(PROGRESS_DIR, pids.path())
        .env_remove(vars::MAMBA_RANK)
        .spawn()
        .expect("start the supervisor");
    for r in 0..2 {
        wait_for(
            &pids.path().join(format!("rank{r}.pid")),
            Duration::from_secs(10),
        );
    }
    let rank_pids: Vec<u32> = (0..2)
        .map(|r| {
            fs::read_to_string(pids.path().join(format!("rank{r}.pid")))
                .expect("pid")
                .trim()
                .parse()
                .expect("pid")
        })
        .collect();
    signal(supervisor.id(), libc::SIGKILL);
    let killed_at = Instant::now();
    supervisor.wait().expect("reap the supervisor");
    for pid in rank_pids {
        let status = reap_within(pid, Duration::from_secs(2))
            .unwrap_or_else(|| panic!("rank pid {pid} outlived its supervisor by 2 s"));
        assert!(
            libc::WIFSIGNALED(status) && libc::WTERMSIG(status) == libc::SIGKILL,
            "status {status:#x}"
        );
    }
    assert!(killed_at.elapsed() < Duration::from_secs(2));
}

#[test]
fn a_malformed_contract_is_a_clear_error_before_any_spawn() {
    let marker_dir = tempfile::tempdir().expect("tmp");
    let marker = marker_dir.path().join("spawned");
    let opts = || SpawnOptions {
        program: Some("/bin/sh".into()),
        args: Some(vec![
            "-c".into(),
            format!("touch {}", marker.display()).into(),
        ]),
        rendezvous_root: Some(marker_dir.path().join("rdv")),
        job_id: Some("malformed".into()),
        ..SpawnOptions::default()
    };
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (vec![(vars::RANK, "1")], vars::WORLD_SIZE),
        (
            vec![(vars::MAMBA_RANK, "0"), (vars::MAMBA_WORLD_SIZE, "four")],
            vars::MAMBA_WORLD_SIZE,
        ),
        (
            vec![
                (vars::SLURM_PROCID, "4"),
                (vars::SLURM_NTASKS, "4"),
                (vars::SLURM_JOB_ID, "1"),
            ],
            vars::SLURM_PROCID,
        ),
        (vec![(vars::MAMBA_LAUNCH_ID, "abc")], vars::MAMBA_LAUNCH_ID),
        (vec![(vars::MAMBA_JOB_ID, "../../etc")], vars::MAMBA_JOB_ID),
        (
            vec![(vars::MAMBA_LOGICAL_WORLD, "6")],
            vars::MAMBA_LOGICAL_WORLD,
        ),
    ];
    for (env, var) in cases {
        match start_world(env.as_slice(), Some(4), opts()) {
            Err(CommError::EnvContract { var: got, detail }) => {
                assert!(
                    got.contains(var),
                    "{env:?}: named {got} ({detail}), expected {var}"
                );
                assert!(!detail.is_empty());
            }
            other => panic!("{env:?} was accepted: {other:?}"),
        }
        assert!(!marker.exists(), "{env:?}: a rank was spawned");
    }
    // Control: a clean environment does spawn (so the marker can appear).
    match start_world([].as_slice(), Some(2), opts()).expect("clean env") {
        Role::Supervised(report) => report.check().expect("ranks ran"),
        Role::Rank(p) => panic!("expected to supervise, got a rank {p:?}"),
    }
    assert!(marker.exists(), "the control world did not run");
}

#[test]
fn a_rank_with_a_malformed_contract_exits_with_a_clear_error() {
    if is_rank_process() {
        match detect(&ProcessEnv) {
            Err(CommError::EnvContract { var, detail }) if var == vars::MAMBA_LOCAL_RANK => {
                eprintln!("rank refused its environment: {var}: {detail}");
                std::process::exit(EXIT_NAMED);
            }
            other => {
                eprintln!("unexpected: {other:?}");
                std::process::exit(EXIT_OTHER);
            }
        }
    }
    let report = test_world(
        "a_rank_with_a_malformed_contract_exits_with_a_clear_error",
        2,
        &[(vars::MAMBA_LOCAL_RANK, "7")],
    )
    .expect("spawn");
    let first = report.first_failure.expect("a failure");
    assert_eq!(
        report.ranks[first].status,
        RankStatus::Exited(EXIT_NAMED),
        "{report}"
    );
}

// ---- the external-launcher lanes ---------------------------------------

const LANE: &str = "MAMBA_TEST_LANE";
const LANE_TAG: &str = "MAMBA_TEST_LAUNCH_TAG";

/// Every contract variable, removed from lane children so an outer launcher
/// (e.g. CI under SLURM) cannot leak in.
const CONTRACT_VARS: &[&str] = &[
    vars::MAMBA_RANK,
    vars::MAMBA_WORLD_SIZE,
    vars::MAMBA_LOCAL_RANK,
    vars::MAMBA_RENDEZVOUS_DIR,
    vars::MAMBA_JOB_ID,
    vars::MAMBA_LAUNCH_ID,
    vars::MAMBA_SEED,
    vars::MAMBA_LOGICAL_WORLD,
    vars::MAMBA_STORE_PORT,
    vars::RANK,
    vars::WORLD_SIZE,
    vars::LOCAL_RANK,
    vars::MASTER_ADDR,
    vars::MASTER_PORT,
    vars::TORCHELASTIC_RUN_ID,
    vars::TORCHELASTIC_USE_AGENT_STORE,
    vars::SLURM_PROCID,
    vars::SLURM_NTASKS,
    vars::SLURM_LOCALID,
    vars::SLURM_JOB_ID,
    vars::SLURM_STEP_ID,
    vars::OMPI_COMM_WORLD_RANK,
    vars::OMPI_COMM_WORLD_SIZE,
    vars::OMPI_COMM_WORLD_LOCAL_RANK,
    vars::OMPI_MCA_ESS_BASE_JOBID,
    vars::PMIX_NAMESPACE,
];

/// Launch `world` copies of the lane test the way an external launcher
/// would: no supervisor, only that launcher's variables.
fn launch_lane(
    lane: &str,
    world: usize,
    per_rank: impl Fn(usize) -> Vec<(String, String)>,
    tag: &str,
) {
    let exe = std::env::current_exe().expect("test binary");
    let children: Vec<_> = (0..world)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args([
                "launcher_lanes_meet_and_all_reduce",
                "--exact",
                "--nocapture",
                "--test-threads=1",
            ]);
            for v in CONTRACT_VARS {
                cmd.env_remove(v);
            }
            cmd.env(LANE, lane).env(LANE_TAG, tag).envs(per_rank(r));
            cmd.spawn().expect("spawn lane rank")
        })
        .collect();
    for (r, mut c) in children.into_iter().enumerate() {
        let st = c.wait().expect("wait");
        assert!(
            st.success(),
            "{lane} launch {tag}: rank {r} ended with {st}"
        );
    }
}

fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    l.local_addr().expect("addr").port()
}

fn lane_rank() {
    let lane = env_var(LANE).expect("lane");
    let tag = env_var(LANE_TAG).expect("tag");
    let place = detect(&ProcessEnv)
        .expect("valid contract")
        .expect("a launcher");
    let want = match lane.as_str() {
        "torchrun" => Launcher::Torchrun,
        "slurm" => Launcher::Slurm,
        "ompi" => Launcher::OpenMpi,
        other => panic!("unknown lane {other}"),
    };
    assert_eq!(place.launcher, want);
    assert_eq!(
        place.launch_id, None,
        "external launchers give no launch nonce"
    );
    let rdv = rendezvous::open(&place, Duration::from_secs(10)).expect("rendezvous");
    // A per-launch value: a stale one from an earlier launch must not be read.
    let mut value = [0u8; 16];
    value[..tag.len()].copy_from_slice(tag.as_bytes());
    if place.rank == 0 {
        thread::sleep(Duration::from_millis(200));
        rdv.publish("lane-value", &value).expect("publish");
    }
    assert_eq!(
        rdv.fetch("lane-value", 16, Duration::from_secs(10))
            .expect("fetch"),
        value,
        "stale value read"
    );
    let mut t = HostTransport::connect(&*rdv, HostOptions::with_timeout(Duration::from_secs(10)))
        .expect("connect");
    let mut v = vec![1.0f32; 64];
    t.all_reduce_sum_f32(&mut v, 0..64).expect("sum");
    assert!(v.iter().all(|&x| x == place.world as f32));
    t.barrier().expect("barrier");
    t.shutdown().expect("shutdown");
}

#[test]
fn launcher_lanes_meet_and_all_reduce() {
    if env_var(LANE).is_some() {
        lane_rank();
        return;
    }
    let world = 3;
    let s = |k: &str, v: String| (k.to_string(), v);

    let port = free_port();
    launch_lane(
        "torchrun",
        world,
        |r| {
            vec![
                s(vars::RANK, r.to_string()),
                s(vars::WORLD_SIZE, world.to_string()),
                s(vars::LOCAL_RANK, r.to_string()),
                s(vars::MASTER_ADDR, "127.0.0.1".into()),
                s(vars::MASTER_PORT, port.to_string()),
                s(vars::TORCHELASTIC_RUN_ID, "lane".into()),
            ]
        },
        "torch",
    );

    let rdv = tempfile::tempdir().expect("tmp");
    let slurm = |r: usize| {
        vec![
            s(vars::SLURM_PROCID, r.to_string()),
            s(vars::SLURM_NTASKS, world.to_string()),
            s(vars::SLURM_LOCALID, r.to_string()),
            s(vars::SLURM_JOB_ID, format!("{}", std::process::id())),
            s(vars::SLURM_STEP_ID, "0".into()),
            s(vars::MAMBA_RENDEZVOUS_DIR, rdv.path().display().to_string()),
        ]
    };
    // The same job and step twice (a requeued job): the second launch must
    // read its own value, not the first one's still on disk.
    launch_lane("slurm", world, slurm, "slurm-first");
    launch_lane("slurm", world, slurm, "slurm-second");

    launch_lane(
        "ompi",
        world,
        |r| {
            vec![
                s(vars::OMPI_COMM_WORLD_RANK, r.to_string()),
                s(vars::OMPI_COMM_WORLD_SIZE, world.to_string()),
                s(vars::OMPI_COMM_WORLD_LOCAL_RANK, r.to_string()),
                s(
                    vars::PMIX_NAMESPACE,
                    format!("prterun-test-{}@1", std::process::id()),
                ),
                s(vars::MAMBA_RENDEZVOUS_DIR, rdv.path().display().to_string()),
            ]
        },
        "ompi",
    );
}
