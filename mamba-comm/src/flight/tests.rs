use super::*;

fn recorder_in(dir: &Path, rank: usize) -> FlightRecorder {
    FlightRecorder::from_env(rank, 4, Some(dir)).expect("recorder")
}

#[test]
fn the_ring_file_holds_every_call_as_it_happens() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut r = recorder_in(dir.path(), 2);
    assert!(r.is_on());
    let a = r.begin(CallKind::AllReduceSum, 400, None);
    r.finish(a, true);
    let g = r.begin(CallKind::Group, 0, None);
    r.add(g, 16, Some(3));
    r.add(g, 16, Some(1));
    // Read by another party while the group is still open (as the
    // supervisor reads a stopped rank's file).
    let snap = read_ring(dir.path(), 2).expect("ring file");
    assert_eq!(
        (snap.rank, snap.world, snap.begun, snap.completed),
        (2, 4, 2, 1)
    );
    assert_eq!(snap.pid, std::process::id());
    assert_eq!(snap.calls.len(), 2);
    assert_eq!(snap.calls[0].kind, CallKind::AllReduceSum);
    assert_eq!(snap.calls[0].state, CallState::Completed);
    let grp = &snap.calls[1];
    assert_eq!(
        (grp.kind, grp.bytes, grp.peer, grp.ops),
        (CallKind::Group, 32, Some(3), 2)
    );
    assert_eq!(grp.state, CallState::Pending);
    assert!(grp.completed_ns.is_none());
    r.finish(g, false);
    let snap = read_ring(dir.path(), 2).expect("ring file");
    assert_eq!(snap.calls[1].state, CallState::Failed);
    assert_eq!(snap.completed, 1, "a failed call is not completed");
}

#[test]
fn the_ring_keeps_the_last_calls_only() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut r = recorder_in(dir.path(), 0);
    for _ in 0..RING_LEN + 10 {
        let s = r.begin(CallKind::Barrier, 0, None);
        r.finish(s, true);
    }
    let snap = read_ring(dir.path(), 0).expect("ring");
    assert_eq!(snap.calls.len(), RING_LEN);
    assert_eq!(snap.calls[0].seq, 11);
    assert_eq!(
        snap.calls.last().map(|c| c.seq),
        Some((RING_LEN + 10) as u64)
    );
    assert_eq!(snap.completed, (RING_LEN + 10) as u64);
}

#[test]
fn a_torn_entry_is_skipped_not_misread() {
    let mut buf = vec![0u8; RING_BYTES];
    ring::init(&mut buf, 1, 2, 7);
    let rec = CallRecord {
        seq: 5,
        kind: CallKind::Send,
        bytes: 8,
        peer: Some(0),
        ops: 1,
        enqueued_ns: 1,
        completed_ns: None,
        state: CallState::Pending,
    };
    ring::store(&mut buf, &rec, 5, 4);
    assert_eq!(ring::parse(&buf).expect("ring").calls, vec![rec]);
    // A writer interrupted after clearing the check word.
    let base = (ring::HEADER_WORDS + 4 * ring::ENTRY_WORDS) * 8;
    buf[base + 56..base + 64].fill(0);
    assert!(ring::parse(&buf).expect("ring").calls.is_empty());
    // Not a ring at all.
    assert!(ring::parse(&buf[..100]).is_none());
    assert!(ring::parse(&vec![0u8; RING_BYTES]).is_none());
}

#[test]
fn a_dump_writes_the_whole_ring_atomically_once() {
    let dir = tempfile::tempdir().expect("tmp");
    let mut r = recorder_in(dir.path(), 3);
    for i in 0..20 {
        let s = r.begin(CallKind::Send, 4 * i, Some(1));
        r.finish(s, true);
    }
    let s = r.begin(CallKind::Recv, 40, Some(2));
    r.dump("rank 2 stopped answering");
    let text = std::fs::read_to_string(dump_file(dir.path(), 3)).expect("dump file");
    assert!(
        text.contains("rank 3 of 4") && text.contains("rank 2 stopped answering"),
        "{text}"
    );
    assert!(text.contains("#1 send (0 bytes, peer 1)"), "{text}");
    assert!(
        text.contains("#21 recv (40 bytes, peer 2), enqueued") && text.contains("NOT COMPLETED"),
        "{text}"
    );
    // Once: a second dump does not overwrite the first.
    r.finish(s, false);
    r.dump("another reason");
    let again = std::fs::read_to_string(dump_file(dir.path(), 3)).expect("dump file");
    assert_eq!(again, text);
    let leftovers: Vec<_> = std::fs::read_dir(dir.path())
        .expect("list")
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[test]
fn an_off_recorder_records_nothing() {
    let mut r = FlightRecorder::off(0, 1);
    assert_eq!(r.begin(CallKind::Barrier, 0, None), 0);
    r.finish(0, true);
    assert!(r.snapshot().is_none());
    r.dump("nothing to say");
}

#[test]
fn the_switch_accepts_on_and_off_and_refuses_anything_else() {
    let var = vars::MAMBA_FLIGHT_RECORDER;
    assert!(enabled(&[("X", "1")]).expect("unset"));
    assert!(enabled(&[(var, "")]).expect("empty is unset"));
    for on in ["1", "on", "true", "yes"] {
        assert!(enabled(&[(var, on)]).expect("on"));
    }
    for off in ["0", "off", "false", "no"] {
        assert!(!enabled(&[(var, off)]).expect("off"));
    }
    let e = enabled(&[(var, "maybe")]).unwrap_err().to_string();
    assert!(e.contains(var) && e.contains("maybe"), "{e}");
}

#[test]
fn rank_lists_stay_short() {
    assert_eq!(summarise_ranks(&[]), "");
    assert_eq!(summarise_ranks(&[0, 2, 3]), "0, 2, 3");
    let all: Vec<usize> = (0..100_000).collect();
    let s = summarise_ranks(&all);
    assert_eq!(s, "0, 1, 2, 3, 4, 5, 6, 7 and 99992 more");
}
