//! The world abort in the communicator's waits: another rank's posted
//! failure ends a wait that would otherwise last until the collective
//! timeout, naming that rank; nothing else changes (the abort itself, the
//! later calls) and a rank's own post, or none, leaves the watchdog alone.

use std::time::Instant;

use super::*;
use crate::rendezvous::MemoryRendezvous;
use crate::world_abort::{post_abort, AbortWatch};
use crate::{CommError, Rendezvous};

/// How often the tests' watches peek.
const PERIOD: Duration = Duration::from_millis(10);
/// When the other rank posts, after the wait began.
const POST_AFTER: Duration = Duration::from_millis(300);

fn rendezvous_world() -> Vec<Arc<dyn Rendezvous>> {
    MemoryRendezvous::world(2)
        .into_iter()
        .map(|r| Arc::new(r) as Arc<dyn Rendezvous>)
        .collect()
}

/// Post `detail` as `rdv`'s rank after [`POST_AFTER`], on a thread.
fn post_later(rdv: Arc<dyn Rendezvous>, detail: &'static str) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        std::thread::sleep(POST_AFTER);
        post_abort(&*rdv, detail).expect("post");
    })
}

#[test]
fn a_peers_posted_failure_ends_a_withheld_collective_at_once_naming_it() {
    let fake = FakeNccl::new(Script::default());
    // The collective timeout is LONG: only the posted abort can end the
    // wait within the test's bound.
    let ((_peer, _peer_stream), (mut core, stream)) = rank1_and_rank0(&fake, LONG);
    let me = handle_id(&core);
    let rdv = rendezvous_world();
    core.set_abort_watch(AbortWatch::with_period(rdv[0].clone(), PERIOD).unwrap());

    // Rank 1 never joins the all-reduce: it failed in its optimizer step.
    let poster = post_later(
        rdv[1].clone(),
        "CUDA error while stepping AdamW: out of memory",
    );
    let start = Instant::now();
    let err = all_reduce(&mut core, &stream).unwrap_err();
    let took = start.elapsed();
    poster.join().unwrap();
    assert!(took >= POST_AFTER, "ended before the post: {took:?}");
    assert!(took < SLACK, "waited {took:?} for a posted abort");
    match &err {
        CommError::PeerFailed { rank, detail } => {
            assert_eq!(*rank, 1, "{err}");
            assert!(detail.contains("out of memory"), "{detail}");
            assert!(detail.contains("world abort"), "{detail}");
            assert!(detail.contains("all_reduce_sum_f32"), "{detail}");
        }
        other => panic!("expected PeerFailed naming rank 1, got {other:?}"),
    }
    assert!(err.to_string().starts_with("rank 1 failed: "), "{err}");
    // The same abort as any failure: once, flag first; later calls fail
    // at once without touching NCCL.
    assert!(core.is_aborted());
    assert_eq!(aborts(&fake), vec![flagged_abort(me)]);
    let before = fake.log().len();
    let again = all_reduce(&mut core, &stream).unwrap_err().to_string();
    assert!(again.contains("aborted after an earlier error"), "{again}");
    assert_eq!(fake.log().len(), before);
    no_violations(&fake);
}

#[test]
fn a_posted_failure_ends_a_group_waiting_for_its_peer() {
    let fake = FakeNccl::new(Script::default());
    let ((_peer, _peer_stream), (mut core, stream)) = rank1_and_rank0(&fake, LONG);
    let rdv = rendezvous_world();
    core.set_abort_watch(AbortWatch::with_period(rdv[0].clone(), PERIOD).unwrap());
    let poster = post_later(rdv[1].clone(), "checkpoint: disk full");
    let start = Instant::now();
    core.group_begin().unwrap();
    let body = send(&mut core, &stream, 1).and_then(|_| recv(&mut core, &stream, 1));
    let err = core.group_finish(&stream, body).unwrap_err();
    poster.join().unwrap();
    assert!(start.elapsed() < SLACK, "waited {:?}", start.elapsed());
    assert!(
        matches!(&err, CommError::PeerFailed { rank: 1, detail } if detail.contains("disk full")),
        "{err:?}"
    );
    assert!(core.is_aborted());
    assert_eq!(
        fake.open_groups(),
        0,
        "the group was closed before the abort"
    );
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

#[test]
fn without_another_ranks_post_the_wait_is_the_watchdogs() {
    // Negative control: this rank's own post is not news to it, so the
    // withheld collective still runs to the deadline and reads as a
    // timeout of this rank's communicator.
    let fake = FakeNccl::new(Script::default());
    let ((_peer, _peer_stream), (mut core, stream)) = rank1_and_rank0(&fake, SHORT);
    let rdv = rendezvous_world();
    post_abort(&*rdv[0], "rank 0's own failure").unwrap();
    core.set_abort_watch(AbortWatch::with_period(rdv[0].clone(), PERIOD).unwrap());
    let start = Instant::now();
    let err = all_reduce(&mut core, &stream).unwrap_err();
    assert_took_the_deadline(start);
    assert!(matches!(err, CommError::Transport { .. }), "{err:?}");
    assert!(err.to_string().contains("did not complete within"), "{err}");
    no_violations(&fake);
}

#[test]
fn a_watch_changes_nothing_while_every_rank_takes_part() {
    let fake = FakeNccl::new(Script::default());
    let ranks = world(&fake, 2, LONG);
    let rdv = rendezvous_world();
    std::thread::scope(|s| {
        for (r, (mut core, stream)) in ranks.into_iter().enumerate() {
            let watch = AbortWatch::with_period(rdv[r].clone(), PERIOD).unwrap();
            s.spawn(move || {
                core.set_abort_watch(watch);
                for _ in 0..5 {
                    all_reduce(&mut core, &stream).expect("all-reduce");
                }
                assert!(!core.is_aborted());
            });
        }
    });
    no_violations(&fake);
}
