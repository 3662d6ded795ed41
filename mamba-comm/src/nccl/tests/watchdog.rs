use std::time::Instant;

use nccl_sys_min::ncclResult_t;

use super::*;
use crate::nccl::fake::StreamMode;
use crate::CommError;

#[test]
fn matched_collectives_complete_on_every_rank() {
    let fake = FakeNccl::new(Script::default());
    let ranks = world(&fake, 2, LONG);
    std::thread::scope(|s| {
        for (mut core, stream) in ranks {
            s.spawn(move || {
                for _ in 0..5 {
                    all_reduce(&mut core, &stream).expect("all-reduce");
                }
                assert!(!core.is_aborted());
            });
        }
    });
    assert!(
        aborts(&fake).len() == 2,
        "each rank's Drop aborts its still-live communicator"
    );
    no_violations(&fake);
}

#[test]
fn a_withheld_half_times_out_aborts_once_and_fails_later_calls() {
    let fake = FakeNccl::new(Script::default());
    let ((peer, _peer_stream), (mut core, stream)) = rank1_and_rank0(&fake, SHORT);
    let me = handle_id(&core);

    // Rank 1 withholds its half: rank 0's window can never complete.
    let start = Instant::now();
    let err = all_reduce(&mut core, &stream).unwrap_err();
    assert_took_the_deadline(start);
    let text = err.to_string();
    assert!(matches!(err, CommError::Transport { .. }));
    assert!(text.contains("did not complete within"), "{text}");
    assert!(text.contains("communicator was aborted"), "{text}");
    assert!(core.is_aborted());

    // The flag was already set when NCCL's abort ran.
    assert_eq!(aborts(&fake), vec![flagged_abort(me)]);

    // A later call fails at once, without touching NCCL.
    let before = fake.log().len();
    let again = all_reduce(&mut core, &stream).unwrap_err().to_string();
    assert!(again.contains("aborted after an earlier error"), "{again}");
    assert_eq!(fake.log().len(), before);

    // Teardown of the aborted communicator touches nothing either.
    assert!(core.shutdown().is_ok());
    drop(core);
    assert_eq!(fake.log().len(), before);
    drop(peer);
    // Rank 0 aborted once; rank 1 (still live) once, by its Drop.
    assert_eq!(aborts(&fake).len(), 2);
    no_violations(&fake);
}

#[test]
fn an_async_error_in_a_window_aborts_and_names_the_error() {
    let fake = script(|s| {
        s.async_after_launch = Some(ncclResult_t::ncclRemoteError);
        s.last_error = "peer 1 closed the connection".into();
    });
    let (mut core, stream, me) = solo(&fake, LONG);
    let start = Instant::now();
    let text = all_reduce(&mut core, &stream).unwrap_err().to_string();
    assert!(
        start.elapsed() < SLACK,
        "an async error must not wait for the deadline"
    );
    assert!(
        text.contains("ncclRemoteError") && text.contains("peer 1 closed the connection"),
        "{text}"
    );
    assert!(text.contains("aborted"), "{text}");
    assert_eq!(aborts(&fake), vec![flagged_abort(me)]);
    drop(core);
    assert_eq!(aborts(&fake).len(), 1, "Drop must not abort again");
    no_violations(&fake);
}

#[test]
fn an_enqueue_error_aborts() {
    let fake = script(|s| s.enqueue = ncclResult_t::ncclInvalidUsage);
    let (mut core, stream, _) = solo(&fake, LONG);
    let text = all_reduce(&mut core, &stream).unwrap_err().to_string();
    assert!(text.contains("enqueue returned ncclInvalidUsage"), "{text}");
    assert!(core.is_aborted());
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

#[test]
fn a_hang_while_enqueuing_is_covered_by_the_window_deadline() {
    let fake = script(|s| {
        s.enqueue = ncclResult_t::ncclInProgress;
        s.enqueue_hangs = true;
    });
    let (mut core, stream, _) = solo(&fake, SHORT);
    let start = Instant::now();
    let text = all_reduce(&mut core, &stream).unwrap_err().to_string();
    assert_took_the_deadline(start);
    assert!(
        text.contains("still enqueuing") && text.contains("aborted"),
        "{text}"
    );
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

#[test]
fn a_stream_that_never_finishes_times_out() {
    let fake = script(|s| s.stream = StreamMode::Never);
    let (mut core, stream, me) = solo(&fake, SHORT);
    let start = Instant::now();
    let text = all_reduce(&mut core, &stream).unwrap_err().to_string();
    assert!(start.elapsed() < SHORT + SLACK);
    assert!(text.contains("did not complete within"), "{text}");
    assert_eq!(aborts(&fake), vec![flagged_abort(me)]);
    no_violations(&fake);
}

#[test]
fn a_device_error_on_the_stream_aborts() {
    let fake = script(|s| s.stream = StreamMode::Error("CUDA_ERROR_ILLEGAL_ADDRESS".into()));
    let (mut core, stream, _) = solo(&fake, LONG);
    let text = all_reduce(&mut core, &stream).unwrap_err().to_string();
    assert!(
        text.contains("CUDA_ERROR_ILLEGAL_ADDRESS") && text.contains("aborted"),
        "{text}"
    );
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

#[test]
fn the_abort_itself_failing_is_reported_not_panicked() {
    let fake = script(|s| {
        s.stream = StreamMode::Never;
        s.abort = ncclResult_t::ncclInternalError;
    });
    let (mut core, stream, _) = solo(&fake, SHORT);
    let text = all_reduce(&mut core, &stream).unwrap_err().to_string();
    assert!(
        text.contains("ncclCommAbort itself returned ncclInternalError"),
        "{text}"
    );
    drop(core);
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}
