use std::time::Instant;

use nccl_sys_min::ncclResult_t;

use super::*;
use crate::nccl::fake::InitMode;
use crate::CommError;

#[test]
fn init_is_nonblocking_and_completes_when_every_rank_joins() {
    let fake = FakeNccl::new(Script::default());
    let ranks = world(&fake, 3, LONG);
    assert_eq!(ranks.len(), 3);
    for (r, (core, _)) in ranks.iter().enumerate() {
        assert_eq!(core.rank(), r);
        assert_eq!(core.world(), 3);
        assert!(!core.is_aborted());
    }
    // Every init asked for a nonblocking communicator (blocking = 0).
    let inits: Vec<_> = fake
        .log()
        .into_iter()
        .filter(|c| matches!(c, Call::Init { .. }))
        .collect();
    assert_eq!(inits.len(), 3);
    assert!(
        inits.iter().all(|c| matches!(
            c,
            Call::Init {
                blocking: 0,
                world: 3,
                ..
            }
        )),
        "{inits:?}"
    );
    // Completion was observed by polling the async state.
    assert!(fake.count(|c| matches!(c, Call::AsyncError(_))) >= 3);
    drop(ranks);
    no_violations(&fake);
}

#[test]
fn a_peer_that_never_arrives_is_an_error_after_the_deadline() {
    let fake = FakeNccl::new(Script::default());
    let id = fake.new_id();
    let start = Instant::now();
    // Rank 1 of 2 never calls init.
    let err = init_rank(&fake, &id, 0, 2, SHORT, LONG).unwrap_err();
    let took = start.elapsed();
    assert!(took >= SHORT, "returned before the deadline: {took:?}");
    assert!(took < SHORT + SLACK, "overran the deadline: {took:?}");
    let text = err.to_string();
    assert!(
        matches!(err, CommError::Transport { ref op, .. } if op == "init"),
        "{err:?}"
    );
    assert!(text.contains("did not complete within"), "{text}");
    assert!(text.contains("a rank never arrived"), "{text}");
    assert!(text.contains("aborted"), "{text}");
    // The half-made communicator was aborted exactly once.
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

#[test]
fn init_error_carries_nccls_last_error_text() {
    let fake = script(|s| {
        s.init = InitMode::Async(ncclResult_t::ncclSystemError);
        s.last_error = "socket connect to 10.1.2.3<41717> failed: Connection refused".into();
    });
    let id = fake.new_id();
    let err = init_rank(&fake, &id, 0, 2, LONG, LONG).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("Connection refused"), "{text}");
    assert!(text.contains("ncclSystemError"), "{text}");
    assert!(text.contains("rank 0 of 2"), "{text}");
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

#[test]
fn init_call_failure_without_a_handle_reports_and_aborts_nothing() {
    let fake = script(|s| {
        s.init = InitMode::Immediate(ncclResult_t::ncclInvalidArgument);
        s.last_error = "invalid rank 0 / nranks 2".into();
    });
    let id = fake.new_id();
    let err = init_rank(&fake, &id, 0, 2, LONG, LONG).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("ncclInvalidArgument") && text.contains("invalid rank 0 / nranks 2"),
        "{text}"
    );
    assert!(
        aborts(&fake).is_empty(),
        "nothing to abort without a handle"
    );
    no_violations(&fake);
}

#[test]
fn a_communicator_of_the_wrong_shape_is_refused_and_aborted() {
    let fake = script(|s| s.identity_world = Some(5));
    let id = fake.new_id();
    let err = init_rank(&fake, &id, 0, 1, LONG, LONG).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("5 ranks") && text.contains("expected 1 ranks"),
        "{text}"
    );
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

#[test]
fn rank_outside_world_is_a_config_error_before_any_call() {
    let fake = FakeNccl::new(Script::default());
    let id = fake.new_id();
    let err = init_rank(&fake, &id, 2, 2, LONG, LONG).unwrap_err();
    assert!(matches!(err, CommError::Config(_)), "{err:?}");
    assert!(fake.log().is_empty());
}
