//! The flight recorder end to end: a world of four real processes (the
//! host transport over loopback sockets, under the self-spawn
//! supervisor), one rank SIGSTOPped mid-run. The supervisor reads the
//! stopped rank's memory-mapped ring and names it, and its last completed
//! collective, in the report's headline, instead of the healthy rank that
//! noticed the hang first.
//!
//! Own test binary: the test sends signals to its children and must
//! SIGCONT them on every way out.

use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::{Duration, Instant};

use mamba_comm::bootstrap::{detect, is_rank_process, ProcessEnv};
use mamba_comm::host::{HostOptions, HostTransport};
use mamba_comm::rendezvous;
use mamba_comm::supervisor::{test_spawn, SpawnOptions};
use mamba_comm::{CommError, Transport};

const PROGRESS_DIR: &str = "MAMBA_TEST_PROGRESS_DIR";
const VICTIM: usize = 2;
const NAME: &str = "a_stopped_rank_is_named_with_its_last_collective";

/// Continues a stopped child on every way out of the test (the
/// supervisor, dropped after this, then kills and reaps it).
struct Continue(Option<u32>);

impl Drop for Continue {
    fn drop(&mut self) {
        if let Some(pid) = self.0.take() {
            // SAFETY: kill has no memory preconditions; the pid is a child
            // of this process not yet reaped (the supervisor still owns it).
            unsafe { libc::kill(pid as libc::pid_t, libc::SIGCONT) };
        }
    }
}

fn wait_for(path: &Path, limit: Duration) {
    let start = Instant::now();
    while !path.exists() {
        assert!(start.elapsed() < limit, "{} never appeared", path.display());
        thread::sleep(Duration::from_millis(10));
    }
}

/// Rank side: collectives forever, with a one-second deadline; the victim
/// says when the world is well under way.
fn rank_loop() -> ! {
    let place = detect(&ProcessEnv)
        .expect("valid contract")
        .expect("a rank has a place");
    let rdv = rendezvous::open(&place, Duration::from_secs(10)).expect("rendezvous");
    let mut t = HostTransport::connect(&*rdv, HostOptions::with_timeout(Duration::from_secs(1)))
        .expect("connect");
    let progress = PathBuf::from(std::env::var(PROGRESS_DIR).expect("progress dir"));
    let mut v = vec![0.0f32; 1000];
    let mut flag = [0i32];
    for round in 0..1_000_000u64 {
        if round == 20 && place.rank == VICTIM {
            fs::write(progress.join("ready"), b"").expect("progress file");
        }
        let r: std::result::Result<(), CommError> = t
            .all_reduce_sum_f32(&mut v, 0..1000)
            .and_then(|()| t.all_reduce_max_i32(&mut flag));
        if let Err(e) = r {
            eprintln!("rank {}: {e}", place.rank);
            std::process::exit(3);
        }
    }
    std::process::exit(0);
}

#[test]
fn a_stopped_rank_is_named_with_its_last_collective() {
    if is_rank_process() {
        rank_loop();
    }
    let progress = tempfile::tempdir().expect("tmp");
    let root = tempfile::tempdir().expect("tmp");
    let opts = SpawnOptions {
        rendezvous_root: Some(root.path().to_path_buf()),
        ..SpawnOptions::default()
    }
    .env(PROGRESS_DIR, progress.path());
    let start = Instant::now();
    let sup = test_spawn(NAME, 4, opts).expect("spawn");
    let victim = sup.pids()[VICTIM];
    let mut cont = Continue(Some(victim));
    wait_for(&progress.path().join("ready"), Duration::from_secs(20));
    // SAFETY: as in `Continue::drop`.
    unsafe { libc::kill(victim as libc::pid_t, libc::SIGSTOP) };
    let report = sup.wait().expect("reaped");
    // Reaped: nothing left to continue (the pid may be reused now).
    cont.0 = None;
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );

    let headline = report.headline();
    let seen = &report.flight[VICTIM];
    assert_eq!(seen.state, Some('T'), "the victim was stopped:\n{report}");
    let ring = seen.ring.as_ref().expect("the victim's ring was read");
    assert!(
        ring.completed >= 40,
        "20 rounds of two collectives: {ring:?}"
    );
    let last = ring
        .call(ring.completed)
        .expect("last completed call in the ring");
    assert!(
        headline.starts_with(&format!(
            "rank {VICTIM} (pid {victim}, stopped: process state T) was behind"
        )) && headline.contains(&format!(
            "its last completed collective was #{} {}",
            ring.completed,
            last.kind.name()
        )),
        "{headline}\n{report}"
    );
    assert!(
        headline.contains(&format!("never reached call #{}", ring.completed + 1))
            || headline.contains(&format!("stuck in #{}", ring.completed + 1)),
        "{headline}"
    );
    // The first failure is a healthy rank that noticed; the error blames
    // the stopped one.
    assert_ne!(report.first_failure, Some(VICTIM), "{report}");
    match report.check() {
        Err(CommError::PeerFailed { rank, .. }) => assert_eq!(rank, VICTIM),
        other => panic!("{other:?}"),
    }
    // Every rank's ring survives the launch directory.
    let kept = report.flight_file.as_ref().expect("rings kept");
    let text = fs::read_to_string(kept).expect("kept rings");
    let sentence = headline.split("; every rank's flight recorder").next();
    assert!(sentence.is_some_and(|h| text.starts_with(h)), "{text}");
    for r in 0..4 {
        assert!(text.contains(&format!("rank {r} (pid ")), "{text}");
    }
}
