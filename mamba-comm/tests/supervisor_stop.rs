//! A stop request (SIGTERM) to the supervisor is forwarded to every rank,
//! and ranks that exit with `128 + signal` are a stopped world, not a
//! failed one. Its own test binary: the handlers are process-wide.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use mamba_comm::supervisor::{RankStatus, SpawnOptions, Supervisor};
use mamba_comm::CommError;

/// A rank that exits 143 on SIGTERM (as `mamba-train` does after its
/// checkpoint) and otherwise runs for a minute.
const STOPPABLE: &str =
    "trap 'exit 143' TERM; i=0; while [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done";

#[test]
fn sigterm_to_the_supervisor_stops_every_rank_and_is_reported_as_a_stop() {
    let root = tempfile::tempdir().unwrap();
    let opts = SpawnOptions {
        program: Some(PathBuf::from("/bin/sh")),
        args: Some(vec!["-c".into(), STOPPABLE.into()]),
        rendezvous_root: Some(root.path().to_path_buf()),
        job_id: Some("stop-test".into()),
        deadline: Some(Duration::from_secs(50)),
        ..SpawnOptions::default()
    };
    let started = Instant::now();
    let sup = Supervisor::spawn(3, opts).unwrap();
    let signaller = std::thread::spawn(|| {
        std::thread::sleep(Duration::from_millis(400));
        // SAFETY: kill has no memory preconditions; this process is alive.
        unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
    });
    let report = sup.wait().unwrap();
    signaller.join().unwrap();
    assert!(started.elapsed() < Duration::from_secs(20), "{report}");
    assert_eq!(report.forwarded_stop, Some(libc::SIGTERM));
    assert_eq!(report.first_failure, None, "{report}");
    for r in &report.ranks {
        assert_eq!(r.status, RankStatus::Exited(143), "{report}");
        assert!(!r.killed_by_supervisor, "{report}");
    }
    assert_eq!(report.stopped_by(), Some(libc::SIGTERM));
    match report.check() {
        Err(CommError::Stopped { signal }) => assert_eq!(signal, libc::SIGTERM),
        other => panic!("expected a stopped world, got {other:?}"),
    }
    // Negative control: a rank that exits 143 by itself beside one that
    // fails is a failure, not a stop.
    assert!(RankStatus::Exited(143).stop_signal().is_some());
    assert!(!RankStatus::Exited(143).failed());
    assert!(RankStatus::Exited(1).failed());
    assert!(
        RankStatus::Signaled(libc::SIGTERM).failed(),
        "killed is not a handled stop"
    );
}
