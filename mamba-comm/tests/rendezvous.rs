//! File, TCP and in-memory rendezvous: exchange, deadlines, privacy, and
//! the guarantee that a launch never reads an earlier launch's values.

use std::fs;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant};

use mamba_comm::bootstrap::{Launcher, WorldPlace};
use mamba_comm::rendezvous::{self, FileRendezvous, LaunchSecret, MemoryRendezvous, TcpRendezvous};
use mamba_comm::{CommError, Rendezvous};

/// The launch secret of these tests' TCP stores.
fn secret() -> LaunchSecret {
    LaunchSecret::of_job("rendezvous-tests")
}

const ID_LEN: usize = 128;
const SHORT: Duration = Duration::from_millis(300);
const LONG: Duration = Duration::from_secs(10);

fn mode(p: &Path) -> u32 {
    fs::metadata(p).expect("metadata").permissions().mode() & 0o777
}

/// Run one closure per rank on threads; results in rank order.
fn per_rank<R: Send + 'static>(
    world: usize,
    f: impl Fn(usize) -> R + Send + Sync + Clone + 'static,
) -> Vec<R> {
    let hs: Vec<_> = (0..world)
        .map(|r| {
            let f = f.clone();
            thread::spawn(move || f(r))
        })
        .collect();
    hs.into_iter()
        .map(|h| h.join().expect("rank thread"))
        .collect()
}

#[test]
fn file_publish_fetch_with_a_supervisor_launch_id() {
    let root = tempfile::tempdir().expect("tmp");
    let rootp = root.path().to_path_buf();
    let got = per_rank(3, move |r| {
        let rdv =
            FileRendezvous::with_launch_id(&rootp, "job", "0123456789abcdef0123456789abcdef", r, 3)
                .expect("open");
        if r == 0 {
            thread::sleep(Duration::from_millis(50));
            rdv.publish("nccl-unique-id", &[9u8; ID_LEN])
                .expect("publish");
        }
        let v = rdv.fetch("nccl-unique-id", ID_LEN, LONG).expect("fetch");
        rdv.barrier("after-id", LONG).expect("barrier");
        rdv.barrier("after-id", LONG)
            .expect("second barrier of the same name");
        v
    });
    assert!(got.iter().all(|v| v == &vec![9u8; ID_LEN]));
    let job = root.path().join("job");
    assert_eq!(mode(&job), 0o700, "job directory must be private");
    assert_eq!(mode(&job.join("0123456789abcdef0123456789abcdef")), 0o700);
    let f = job
        .join("0123456789abcdef0123456789abcdef")
        .join("nccl-unique-id");
    assert_eq!(mode(&f), 0o600);
    // No temporary files remain after atomic renames.
    let leftovers: Vec<_> = fs::read_dir(f.parent().expect("dir"))
        .expect("ls")
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn file_fetch_deadline_names_rank_path_and_timeout() {
    let root = tempfile::tempdir().expect("tmp");
    let rdv = FileRendezvous::with_launch_id(
        root.path(),
        "job",
        "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
        1,
        2,
    )
    .expect("open");
    let start = Instant::now();
    match rdv.fetch("nccl-unique-id", ID_LEN, SHORT) {
        Err(CommError::Rendezvous {
            rank,
            location,
            timeout,
            detail,
        }) => {
            assert_eq!(rank, 1);
            assert!(
                location.ends_with("job/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa/nccl-unique-id"),
                "{location}"
            );
            assert_eq!(timeout, SHORT);
            assert!(
                detail.contains("128 bytes") && detail.contains("never appeared"),
                "{detail}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(start.elapsed() >= SHORT && start.elapsed() < SHORT + Duration::from_millis(500));
    // A value of the wrong length is waited past, then reported.
    rdv.publish("short", &[1u8; 5]).expect("publish");
    match rdv.fetch("short", ID_LEN, SHORT) {
        Err(CommError::Rendezvous { detail, .. }) => {
            assert!(detail.contains("holds 5"), "{detail}")
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        rdv.publish("../evil", b"x"),
        Err(CommError::Config(_))
    ));
    assert!(
        matches!(rdv.barrier("lonely", SHORT), Err(CommError::Rendezvous { detail, .. }) if detail.contains("[0]"))
    );
}

#[test]
fn directories_that_are_not_private_are_refused() {
    let root = tempfile::tempdir().expect("tmp");
    let job = root.path().join("open-job");
    fs::create_dir(&job).expect("mkdir");
    fs::set_permissions(&job, fs::Permissions::from_mode(0o755)).expect("chmod");
    let e = FileRendezvous::with_launch_id(
        root.path(),
        "open-job",
        "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
        0,
        1,
    )
    .expect_err("0755");
    assert!(
        e.to_string().contains("0700") || e.to_string().contains("755"),
        "{e}"
    );

    let elsewhere = tempfile::tempdir().expect("tmp");
    symlink(elsewhere.path(), root.path().join("linked-job")).expect("symlink");
    let e = FileRendezvous::with_launch_id(
        root.path(),
        "linked-job",
        "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
        0,
        1,
    )
    .expect_err("symlink");
    assert!(e.to_string().contains("not a directory"), "{e}");

    let open_root = root.path().join("open-root");
    fs::create_dir(&open_root).expect("mkdir");
    fs::set_permissions(&open_root, fs::Permissions::from_mode(0o777)).expect("chmod");
    let e =
        FileRendezvous::with_launch_id(&open_root, "job", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", 0, 1)
            .expect_err("o+w root");
    assert!(e.to_string().contains("writable by"), "{e}");
    assert!(e.to_string().contains("MAMBA_RENDEZVOUS_DIR"), "{e}");
    assert!(e.to_string().contains("chmod 700"), "{e}");
    // Another user could pre-create (or squat) job directories in a root
    // open to them, sticky bit (like /tmp) or not, and the group too: all
    // refused.
    for mode in [0o1777, 0o770, 0o730, 0o702] {
        fs::set_permissions(&open_root, fs::Permissions::from_mode(mode)).expect("chmod");
        let e = FileRendezvous::with_launch_id(
            &open_root,
            "job",
            "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
            0,
            1,
        )
        .expect_err("a root open to others");
        assert!(e.to_string().contains("writable by"), "{mode:o}: {e}");
    }
    // Private again: accepted.
    fs::set_permissions(&open_root, fs::Permissions::from_mode(0o750)).expect("chmod");
    FileRendezvous::with_launch_id(&open_root, "job", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", 0, 1)
        .expect("a root only this user can write");

    // A root that is a file: "not a directory", naming the variable.
    let file_root = root.path().join("file-root");
    fs::write(&file_root, b"x").expect("file");
    let e =
        FileRendezvous::with_launch_id(&file_root, "job", "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb", 0, 1)
            .expect_err("file root");
    assert!(e.to_string().contains("not a directory"), "{e}");
    assert!(e.to_string().contains("MAMBA_RENDEZVOUS_DIR"), "{e}");

    for bad in ["..", "a/b", ""] {
        assert!(
            FileRendezvous::with_launch_id(
                root.path(),
                bad,
                "bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb",
                0,
                1
            )
            .is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn handshake_join_agrees_on_one_launch_and_exchanges() {
    let root = tempfile::tempdir().expect("tmp");
    let rootp = root.path().to_path_buf();
    let got = per_rank(4, move |r| {
        // Ranks start in a scrambled order.
        thread::sleep(Duration::from_millis([30, 0, 60, 10][r]));
        let rdv = FileRendezvous::join(&rootp, "slurm-7.0", r, 4, LONG).expect("join");
        if r == 0 {
            rdv.publish("nccl-unique-id", &[r as u8 + 42; ID_LEN])
                .expect("publish");
        }
        let v = rdv.fetch("nccl-unique-id", ID_LEN, LONG).expect("fetch");
        rdv.barrier("done", LONG).expect("barrier");
        (rdv.launch_dir().to_path_buf(), v)
    });
    assert!(
        got.iter().all(|(d, _)| d == &got[0].0),
        "all ranks in one launch directory"
    );
    assert!(got.iter().all(|(_, v)| v == &vec![42u8; ID_LEN]));
    // The spent handshake files are gone.
    let names: Vec<String> = fs::read_dir(root.path().join("slurm-7.0"))
        .expect("ls")
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("hello") || n.starts_with("ack"))
        .collect();
    assert!(names.is_empty(), "{names:?}");
}

/// Lay down what a crashed earlier launch of `job` would leave: a launch
/// directory holding an id, and hello/ack files pointing rank 1 at it.
fn plant_stale_launch(root: &Path, job: &str) -> String {
    let stale_k = "5555555555555555aaaaaaaaaaaaaaaa".to_string();
    let old_n = "1111111111111111ffffffffffffffff";
    let jobd = root.join(job);
    let old = jobd.join(&stale_k);
    fs::create_dir_all(&old).expect("stale dirs");
    for d in [&jobd, &old] {
        fs::set_permissions(d, fs::Permissions::from_mode(0o700)).expect("chmod");
    }
    fs::write(old.join("nccl-unique-id"), [0xEEu8; ID_LEN]).expect("stale id");
    fs::write(old.join("joined.1"), b"").expect("stale joined");
    fs::write(jobd.join("hello.1"), old_n).expect("stale hello");
    fs::write(jobd.join("ack.1"), format!("{old_n}{stale_k}")).expect("stale ack");
    stale_k
}

#[test]
fn a_reused_job_id_never_hands_out_a_stale_value() {
    let root = tempfile::tempdir().expect("tmp");
    let stale_k = plant_stale_launch(root.path(), "reused");
    let stale_dir_name = stale_k.clone();

    // Control: the planted value is real and readable by anyone who takes
    // the stale launch for the current one.
    let naive =
        FileRendezvous::with_launch_id(root.path(), "reused", &stale_k, 1, 2).expect("open stale");
    assert_eq!(
        naive
            .fetch("nccl-unique-id", ID_LEN, SHORT)
            .expect("stale is there"),
        vec![0xEE; ID_LEN]
    );

    // A new launch whose rank 0 has not published yet: rank 1 must wait and
    // time out, not read the stale id.
    let rootp = root.path().to_path_buf();
    let got = per_rank(2, move |r| {
        let rdv = FileRendezvous::join(&rootp, "reused", r, 2, LONG).expect("join");
        assert_ne!(
            rdv.launch_dir()
                .file_name()
                .expect("name")
                .to_string_lossy(),
            stale_k
        );
        if r == 1 {
            let early = rdv.fetch("nccl-unique-id", ID_LEN, SHORT);
            assert!(
                matches!(early, Err(CommError::Rendezvous { .. })),
                "read a stale value: {early:?}"
            );
        }
        rdv.barrier("checked", LONG).expect("barrier");
        if r == 0 {
            rdv.publish("nccl-unique-id", &[0x11; ID_LEN])
                .expect("publish");
        }
        rdv.fetch("nccl-unique-id", ID_LEN, LONG).expect("fresh")
    });
    assert!(
        got.iter().all(|v| v == &vec![0x11; ID_LEN]),
        "every rank got the fresh id"
    );
    assert!(
        !root.path().join("reused").join(&stale_dir_name).exists(),
        "the stale launch was pruned"
    );

    // Same guarantee for a supervisor-chosen launch id: a new nonce never
    // sees the old one's files.
    let fresh = FileRendezvous::with_launch_id(
        root.path(),
        "reused",
        "0000000000000000bbbbbbbbbbbbbbbb",
        1,
        2,
    )
    .expect("open");
    assert!(fresh.fetch("nccl-unique-id", ID_LEN, SHORT).is_err());
}

#[test]
fn handshake_without_rank_zero_times_out_naming_the_directory() {
    let root = tempfile::tempdir().expect("tmp");
    match FileRendezvous::join(root.path(), "lonely", 1, 2, SHORT) {
        Err(CommError::Rendezvous {
            rank: 1,
            location,
            detail,
            ..
        }) => {
            assert!(location.ends_with("lonely"), "{location}");
            assert!(detail.contains("rank 0"), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    match FileRendezvous::join(root.path(), "lonely0", 0, 3, SHORT) {
        Err(CommError::Rendezvous {
            rank: 0, detail, ..
        }) => assert!(detail.contains("[1, 2]"), "{detail}"),
        other => panic!("{other:?}"),
    }
}

fn tcp_world(world: usize) -> (TcpRendezvous, u16) {
    let r0 = TcpRendezvous::new("127.0.0.1", 0, 0, world, secret(), LONG).expect("rank 0 serves");
    let port = r0.store_port().expect("rank 0 knows its port");
    (r0, port)
}

#[test]
fn tcp_world_exchanges_and_meets() {
    let (r0, port) = tcp_world(4);
    let h = thread::spawn(move || {
        thread::sleep(Duration::from_millis(30));
        r0.publish("nccl-unique-id", &[7u8; ID_LEN])
            .expect("publish");
        r0.barrier("b", LONG).expect("barrier");
        r0.barrier("b", LONG).expect("barrier again");
        r0 // keep the store alive until the others are done
    });
    let got = per_rank(3, move |i| {
        let rdv = TcpRendezvous::new("127.0.0.1", port, i + 1, 4, secret(), LONG).expect("join");
        let v = rdv.fetch("nccl-unique-id", ID_LEN, LONG).expect("fetch");
        rdv.barrier("b", LONG).expect("barrier");
        rdv.barrier("b", LONG).expect("barrier again");
        v
    });
    drop(h.join().expect("rank 0"));
    assert!(got.iter().all(|v| v == &vec![7u8; ID_LEN]));
}

#[test]
fn tcp_store_lives_only_as_long_as_its_launch() {
    // Launch A publishes an id, then ends (rank 0's store goes with it).
    let (a0, port) = tcp_world(2);
    let a1 = TcpRendezvous::new("127.0.0.1", port, 1, 2, secret(), LONG).expect("A rank 1");
    a0.publish("nccl-unique-id", &[0xAA; ID_LEN])
        .expect("publish");
    assert_eq!(
        a1.fetch("nccl-unique-id", ID_LEN, LONG)
            .expect("A sees its id"),
        vec![0xAA; ID_LEN]
    );

    // While A runs, a process of a newer launch claiming rank 1 is refused.
    match TcpRendezvous::new("127.0.0.1", port, 1, 2, secret(), LONG) {
        Err(CommError::Rendezvous { detail, .. }) => {
            assert!(detail.contains("already joined"), "{detail}")
        }
        other => panic!("a second rank 1 was admitted: {other:?}"),
    }
    drop(a1);
    drop(a0);

    // Launch B reuses the address: its store starts empty.
    let b0 = TcpRendezvous::new("127.0.0.1", port, 0, 2, secret(), LONG)
        .expect("B rank 0 rebinds the port");
    let b1 = TcpRendezvous::new("127.0.0.1", port, 1, 2, secret(), LONG).expect("B rank 1");
    assert!(matches!(
        b1.fetch("nccl-unique-id", ID_LEN, SHORT),
        Err(CommError::Rendezvous { .. })
    ));
    b0.publish("nccl-unique-id", &[0xBB; ID_LEN])
        .expect("publish");
    assert_eq!(
        b1.fetch("nccl-unique-id", ID_LEN, LONG).expect("fresh"),
        vec![0xBB; ID_LEN]
    );
}

#[test]
fn tcp_store_refuses_a_peer_of_another_job_without_taking_its_rank() {
    let (_r0, port) = tcp_world(2);
    let other = LaunchSecret::of_job("another-job");
    match TcpRendezvous::new("127.0.0.1", port, 1, 2, other, LONG) {
        Err(CommError::Rendezvous { detail, .. }) => {
            assert!(detail.contains("launch secret does not match"), "{detail}")
        }
        other => panic!("a peer of another job must be refused: {other:?}"),
    }
    // The refused peer did not take rank 1: this job's rank 1 still joins.
    let r1 = TcpRendezvous::new("127.0.0.1", port, 1, 2, secret(), LONG).expect("join");
    r1.publish("k", b"v").unwrap();
}

#[test]
fn tcp_errors_name_the_rank_and_the_store() {
    let (r0, port) = tcp_world(2);
    let r1 = TcpRendezvous::new("127.0.0.1", port, 1, 2, secret(), LONG).expect("join");
    match r1.fetch("never", 4, SHORT) {
        Err(CommError::Rendezvous {
            rank: 1,
            location,
            timeout,
            ..
        }) => {
            assert_eq!(location, format!("tcp://127.0.0.1:{port}/never"));
            assert_eq!(timeout, SHORT);
        }
        other => panic!("{other:?}"),
    }
    // Wrong world size is refused by the store.
    assert!(TcpRendezvous::new("127.0.0.1", port, 1, 3, secret(), LONG).is_err());
    // Rank 0 gone: requests fail promptly instead of hanging.
    drop(r0);
    let start = Instant::now();
    assert!(r1.fetch("never", 4, LONG).is_err());
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    // Nobody serving: connecting gives up at the deadline.
    let start = Instant::now();
    assert!(matches!(
        TcpRendezvous::new("127.0.0.1", port, 1, 2, secret(), SHORT),
        Err(CommError::Rendezvous { .. })
    ));
    assert!(start.elapsed() < Duration::from_secs(2));
}

#[test]
fn memory_rendezvous_and_open() {
    let rs = MemoryRendezvous::world(3);
    let got: Vec<Vec<u8>> = thread::scope(|s| {
        let hs: Vec<_> = rs
            .iter()
            .map(|r| {
                s.spawn(move || {
                    if r.rank() == 2 {
                        r.publish("k", b"abc").expect("publish");
                    }
                    r.barrier("x", LONG).expect("barrier");
                    r.fetch("k", 3, LONG).expect("fetch")
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    assert!(got.iter().all(|v| v == b"abc"));
    assert!(rs[0].fetch("missing", 1, SHORT).is_err());

    let solo = rendezvous::open(&WorldPlace::single(), SHORT).expect("solo");
    assert_eq!((solo.rank(), solo.world()), (0, 1));
    solo.barrier("alone", SHORT).expect("barrier of one");

    let mut nowhere = WorldPlace::single();
    nowhere.world = 2;
    nowhere.launcher = Launcher::Torchrun;
    assert!(matches!(
        rendezvous::open(&nowhere, SHORT),
        Err(CommError::Config(_))
    ));
}

/// `peek` on every kind: nothing before a publish, the whole value (any
/// length) after; then a world abort posted by one rank and read by
/// another through it.
fn peek_and_abort_through(a: &dyn Rendezvous, b: &dyn Rendezvous) {
    use mamba_comm::world_abort::{post_abort, posted_abort};
    assert_eq!(a.peek("some-key").expect("peek"), None);
    b.publish("some-key", b"three").expect("publish");
    assert_eq!(a.peek("some-key").expect("peek"), Some(b"three".to_vec()));
    b.publish("some-key", b"").expect("publish empty");
    assert_eq!(a.peek("some-key").expect("peek"), Some(Vec::new()));
    assert_eq!(posted_abort(a).expect("read"), None);
    post_abort(b, "cannot write checkpoint step-000040").expect("post");
    let got = posted_abort(a).expect("read").expect("the post is visible");
    assert_eq!(
        (got.rank, got.detail.as_str()),
        (b.rank(), "cannot write checkpoint step-000040")
    );
    assert_eq!(
        posted_abort(b).expect("read"),
        None,
        "a rank's own post is not news to it"
    );
}

#[test]
fn peek_and_the_world_abort_on_file_tcp_and_memory() {
    let root = tempfile::tempdir().expect("tmp");
    let id = "00112233445566778899aabbccddeeff";
    let f0 = FileRendezvous::with_launch_id(root.path(), "job", id, 0, 2).expect("open 0");
    let f1 = FileRendezvous::with_launch_id(root.path(), "job", id, 1, 2).expect("open 1");
    peek_and_abort_through(&f0, &f1);

    let (t0, port) = tcp_world(2);
    let t1 = TcpRendezvous::new("127.0.0.1", port, 1, 2, secret(), LONG).expect("join");
    peek_and_abort_through(&t1, &t0);

    let m = MemoryRendezvous::world(2);
    peek_and_abort_through(&m[0], &m[1]);
}

#[test]
fn a_lost_store_is_an_error_to_peek_not_an_abort() {
    // The watch stops on it and leaves the wait to the watchdog: rank 0's
    // store ends with rank 0, which at a run's end is no failure.
    let (t0, port) = tcp_world(2);
    let t1 = TcpRendezvous::new("127.0.0.1", port, 1, 2, secret(), LONG).expect("join");
    drop(t0);
    let until = Instant::now() + LONG;
    loop {
        match mamba_comm::world_abort::posted_abort(&t1) {
            Err(CommError::Rendezvous { detail, .. }) => {
                assert!(detail.contains("lost the store"), "{detail}");
                break;
            }
            Ok(None) if Instant::now() < until => thread::sleep(Duration::from_millis(10)),
            other => panic!("expected the lost store, got {other:?}"),
        }
    }
}
