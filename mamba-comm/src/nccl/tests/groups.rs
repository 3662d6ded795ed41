use proptest::prelude::*;

use super::*;
use crate::{CommError, Result};

fn group<R>(
    core: &mut CommCore,
    stream: &FakeStream,
    body: impl FnOnce(&mut CommCore) -> Result<R>,
) -> Result<R> {
    core.group_begin()?;
    let r = body(core);
    core.group_finish(stream, r)
}

#[test]
fn a_group_of_sends_and_receives_is_one_window_on_both_ranks() {
    let fake = FakeNccl::new(Script::default());
    let ranks = world(&fake, 2, LONG);
    std::thread::scope(|s| {
        for (r, (mut core, stream)) in ranks.into_iter().enumerate() {
            s.spawn(move || {
                let peer = 1 - r as i32;
                group(&mut core, &stream, |c| {
                    // Both ranks send first: fine inside a group.
                    send(c, &stream, peer)?;
                    recv(c, &stream, peer)
                })
                .expect("exchange");
                assert!(!core.is_aborted());
            });
        }
    });
    assert_eq!(fake.count(|c| *c == Call::GroupStart), 2);
    assert_eq!(fake.count(|c| *c == Call::GroupEnd), 2);
    no_violations(&fake);
}

#[test]
fn a_body_failing_before_any_enqueue_closes_the_group_and_keeps_the_communicator() {
    let fake = FakeNccl::new(Script::default());
    let (mut core, stream, _) = solo(&fake, LONG);
    let err = group(&mut core, &stream, |_| -> Result<()> {
        Err(CommError::config("bad range"))
    })
    .unwrap_err();
    assert!(matches!(err, CommError::Config(_)), "{err:?}");
    assert_eq!(fake.open_groups(), 0);
    assert_eq!(fake.count(|c| *c == Call::GroupEnd), 1);
    assert!(!core.is_aborted());
    all_reduce(&mut core, &stream).expect("still usable");
    no_violations(&fake);
}

#[test]
fn a_body_failing_after_enqueuing_closes_the_group_then_aborts() {
    let fake = FakeNccl::new(Script::default());
    let ranks = world(&fake, 2, LONG);
    let mut it = ranks.into_iter();
    let (mut core, stream) = it.next().expect("rank 0");
    let me = handle_id(&core);
    let err = group(&mut core, &stream, |c| {
        send(c, &stream, 1)?;
        Err::<(), _>(CommError::config("range 9..3 is not inside the buffer"))
    })
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("after enqueuing 1 operation") && text.contains("range 9..3"),
        "{text}"
    );
    assert!(text.contains("aborted"), "{text}");
    assert_eq!(fake.open_groups(), 0);
    let log = fake.log();
    let end = log
        .iter()
        .rposition(|c| *c == Call::GroupEnd)
        .expect("group end");
    let abort = log
        .iter()
        .position(|c| matches!(c, Call::Abort { comm, .. } if *comm == me))
        .expect("abort");
    assert!(
        end < abort,
        "the group must be closed before the abort: {log:?}"
    );
    no_violations(&fake);
}

#[test]
fn a_failure_inside_a_group_defers_the_abort_until_the_group_is_closed() {
    let fake = script(|s| s.enqueue = nccl_sys_min::ncclResult_t::ncclInvalidArgument);
    let (mut core, stream, me) = solo(&fake, LONG);
    let err = group(&mut core, &stream, |c| {
        let first = send(c, &stream, 0);
        assert!(c.is_aborted(), "poisoned at once");
        let second = send(c, &stream, 0).unwrap_err().to_string();
        assert!(
            second.contains("aborted after an earlier error"),
            "{second}"
        );
        first
    })
    .unwrap_err();
    let text = err.to_string();
    assert!(text.contains("ncclInvalidArgument"), "{text}");
    let log = fake.log();
    let end = log
        .iter()
        .position(|c| *c == Call::GroupEnd)
        .expect("group end");
    let abort = log
        .iter()
        .position(|c| matches!(c, Call::Abort { .. }))
        .expect("abort");
    assert!(end < abort, "{log:?}");
    assert_eq!(log[abort], flagged_abort(me));
    assert_eq!(
        fake.count(|c| matches!(c, Call::Send { .. })),
        1,
        "no call after the poison"
    );
    assert_eq!(fake.open_groups(), 0);
    no_violations(&fake);
}

#[test]
fn a_failing_group_end_aborts() {
    let fake = script(|s| s.group_end = nccl_sys_min::ncclResult_t::ncclSystemError);
    let (mut core, stream, _) = solo(&fake, LONG);
    let text = group(&mut core, &stream, |c| send(c, &stream, 0))
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("ncclGroupEnd returned ncclSystemError") && text.contains("aborted"),
        "{text}"
    );
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

/// What a group body does at one step.
#[derive(Clone, Debug)]
enum Step {
    Op,
    Fail,
    Nested(Vec<Step>),
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let leaf = prop_oneof![4 => Just(Step::Op), 1 => Just(Step::Fail)];
    let step = leaf.prop_recursive(3, 12, 4, |inner| {
        prop_oneof![
            4 => Just(Step::Op),
            1 => Just(Step::Fail),
            2 => prop::collection::vec(inner, 0..4).prop_map(Step::Nested),
        ]
    });
    prop::collection::vec(step, 0..6)
}

fn run_steps(core: &mut CommCore, stream: &FakeStream, steps: &[Step]) -> Result<()> {
    for s in steps {
        match s {
            Step::Op => all_reduce(core, stream)?,
            Step::Fail => return Err(CommError::config("scripted body failure")),
            Step::Nested(inner) => group(core, stream, |c| run_steps(c, stream, inner))?,
        }
    }
    Ok(())
}

fn count_ops(steps: &[Step]) -> (usize, bool) {
    // Operations before the first failure, and whether one happened.
    let mut n = 0;
    for s in steps {
        match s {
            Step::Op => n += 1,
            Step::Fail => return (n, true),
            Step::Nested(inner) => {
                let (k, failed) = count_ops(inner);
                n += k;
                if failed {
                    return (n, true);
                }
            }
        }
    }
    (n, false)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Whatever the body does (nested groups, failures at any depth), every
    /// ncclGroupStart is matched by an ncclGroupEnd, NCCL's group depth
    /// returns to zero, the communicator is aborted exactly when a failure
    /// came after an enqueue, and nothing touches a freed handle.
    #[test]
    fn groups_always_close(body in steps()) {
        let fake = FakeNccl::new(Script::default());
        let (mut core, stream, _) = solo(&fake, LONG);
        let result = group(&mut core, &stream, |c| run_steps(c, &stream, &body));
        let (ops, failed) = count_ops(&body);
        prop_assert_eq!(result.is_err(), failed);
        prop_assert_eq!(fake.open_groups(), 0);
        prop_assert_eq!(fake.count(|c| *c == Call::GroupStart), fake.count(|c| *c == Call::GroupEnd));
        prop_assert_eq!(core.is_aborted(), failed && ops > 0);
        if !core.is_aborted() {
            all_reduce(&mut core, &stream).expect("usable after the group");
        }
        drop(core);
        prop_assert!(fake.violations().is_empty(), "{:?}", fake.violations());
    }
}
