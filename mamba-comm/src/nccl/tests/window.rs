//! Windows: a sequence of groups enqueued without waiting, one watchdog
//! wait at the end (what the fixed-order reducer uses to queue its whole
//! dataflow with no host round-trip between groups).

use std::cell::Cell;
use std::time::Instant;

use proptest::prelude::*;

use super::*;
use crate::nccl::completion::Completion;
use crate::{CommError, Result};

/// A stream seam that counts how often it was asked.
struct Counting<'a> {
    inner: &'a FakeStream,
    polls: Cell<usize>,
}

impl Completion for Counting<'_> {
    fn poll(&self) -> std::result::Result<bool, String> {
        self.polls.set(self.polls.get() + 1);
        self.inner.poll()
    }
}

fn group<R>(
    core: &mut CommCore,
    stream: &dyn Completion,
    body: impl FnOnce(&mut CommCore) -> Result<R>,
) -> Result<R> {
    core.group_begin()?;
    let r = body(core);
    core.group_finish(stream, r)
}

fn window<R>(
    core: &mut CommCore,
    stream: &dyn Completion,
    body: impl FnOnce(&mut CommCore) -> Result<R>,
) -> Result<R> {
    core.window_begin()?;
    let r = body(core);
    let text = r.as_ref().err().map(|e| e.to_string());
    match (r, core.window_finish(stream, text.as_deref())) {
        (Ok(v), Ok(())) => Ok(v),
        (Err(e), Ok(())) => Err(e),
        (_, Err(e)) => Err(e),
    }
}

/// One exchange with `peer` as a group (both ranks send first).
fn exchange(core: &mut CommCore, stream: &FakeStream, peer: i32) -> Result<()> {
    group(core, stream, |c| {
        send(c, stream, peer)?;
        recv(c, stream, peer)
    })
}

#[test]
fn a_window_queues_its_groups_and_waits_once_at_the_end() {
    let fake = FakeNccl::new(Script::default());
    let ranks = world(&fake, 2, LONG);
    std::thread::scope(|s| {
        for (r, (mut core, stream)) in ranks.into_iter().enumerate() {
            s.spawn(move || {
                let peer = 1 - r as i32;
                let counting = Counting {
                    inner: &stream,
                    polls: Cell::new(0),
                };
                window(&mut core, &counting, |c| {
                    for _ in 0..5 {
                        group(c, &counting, |c| {
                            send(c, &stream, peer)?;
                            recv(c, &stream, peer)
                        })?;
                    }
                    // Nothing waited for the stream while the groups queued.
                    assert_eq!(counting.polls.get(), 0, "a group inside a window waited");
                    assert!(c.in_window());
                    Ok(())
                })
                .expect("window");
                assert!(counting.polls.get() >= 1, "the window's end did not wait");
                assert!(!core.in_window() && !core.is_aborted());
                // Outside a window a group waits again.
                let before = counting.polls.get();
                group(&mut core, &counting, |c| {
                    send(c, &stream, peer)?;
                    recv(c, &stream, peer)
                })
                .expect("group after the window");
                assert!(counting.polls.get() > before);
            });
        }
    });
    assert_eq!(fake.count(|c| *c == Call::GroupStart), 12);
    assert_eq!(fake.count(|c| *c == Call::GroupEnd), 12);
    no_violations(&fake);
}

#[test]
fn a_window_whose_peer_never_takes_part_times_out_from_its_start_and_aborts() {
    let fake = FakeNccl::new(Script::default());
    let ((peer, _peer_stream), (mut core, stream)) = rank1_and_rank0(&fake, SHORT);
    let me = handle_id(&core);
    let start = Instant::now();
    let err = window(&mut core, &stream, |c| {
        // Queue two groups, then dawdle past half the deadline: the
        // deadline counts from the window's start, not from the last group.
        exchange(c, &stream, 1)?;
        exchange(c, &stream, 1)?;
        std::thread::sleep(SHORT / 2);
        Ok(())
    })
    .unwrap_err();
    assert_took_the_deadline(start);
    let text = err.to_string();
    assert!(text.contains("window did not complete within"), "{text}");
    assert!(text.contains("aborted"), "{text}");
    assert_eq!(aborts(&fake), vec![flagged_abort(me)]);
    drop(core);
    drop(peer);
    no_violations(&fake);
}

/// A host copy inside a window would wait on the stream for the window's
/// groups, outside the watchdog: with a missing peer, forever. The core
/// refuses it at once (a config error naming the window), and the window
/// still ends at its deadline.
#[test]
fn a_host_wait_inside_a_window_or_group_is_refused_at_once() {
    let fake = FakeNccl::new(Script::default());
    let ((peer, _peer_stream), (mut core, stream)) = rank1_and_rank0(&fake, SHORT);
    let start = Instant::now();
    let err = window(&mut core, &stream, |c| {
        exchange(c, &stream, 1)?;
        for op in ["download", "upload", "all_reduce_max_i32"] {
            let e = c.refuse_host_wait(op).unwrap_err();
            assert!(matches!(e, CommError::Config(_)), "{e:?}");
            let text = e.to_string();
            assert!(
                text.contains(op) && text.contains("inside a window"),
                "{text}"
            );
        }
        let e = group(c, &stream, |c| c.refuse_host_wait("download")).unwrap_err();
        assert!(e.to_string().contains("inside a group"), "{e}");
        assert!(
            start.elapsed() < SHORT / 2,
            "refusing took {:?}",
            start.elapsed()
        );
        Ok(())
    })
    .unwrap_err();
    assert_took_the_deadline(start);
    assert!(
        err.to_string().contains("window did not complete within"),
        "{err}"
    );
    drop(core);
    drop(peer);
    no_violations(&fake);
}

#[test]
fn a_host_wait_outside_windows_and_groups_is_allowed() {
    let fake = FakeNccl::new(Script::default());
    let (mut core, stream, _) = solo(&fake, LONG);
    core.refuse_host_wait("download").expect("no window open");
    window(&mut core, &stream, |c| all_reduce(c, &stream)).expect("window");
    core.refuse_host_wait("download")
        .expect("the window has ended");
    no_violations(&fake);
}

#[test]
fn a_body_failing_after_enqueuing_aborts_after_the_group_closed() {
    let fake = FakeNccl::new(Script::default());
    let ((_peer, _), (mut core, stream)) = rank1_and_rank0(&fake, LONG);
    let me = handle_id(&core);
    let err = window(&mut core, &stream, |c| {
        exchange(c, &stream, 1)?;
        Err::<(), _>(CommError::config("fold kernel launch failed"))
    })
    .unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains("after enqueuing 2 operation(s)") && text.contains("fold kernel launch"),
        "{text}"
    );
    assert!(core.is_aborted());
    let log = fake.log();
    let end = log.iter().rposition(|c| *c == Call::GroupEnd).expect("end");
    let abort = log
        .iter()
        .position(|c| matches!(c, Call::Abort { comm, .. } if *comm == me))
        .expect("abort");
    assert!(end < abort, "{log:?}");
    assert_eq!(fake.open_groups(), 0);
    no_violations(&fake);
}

#[test]
fn a_body_failing_before_enqueuing_keeps_the_communicator() {
    let fake = FakeNccl::new(Script::default());
    let (mut core, stream, _) = solo(&fake, LONG);
    let err = window(&mut core, &stream, |_| -> Result<()> {
        Err(CommError::config("bad plan"))
    })
    .unwrap_err();
    assert!(matches!(err, CommError::Config(_)), "{err:?}");
    assert!(!core.is_aborted() && !core.in_window());
    all_reduce(&mut core, &stream).expect("still usable");
    // And a new window opens.
    window(&mut core, &stream, |c| all_reduce(c, &stream)).expect("second window");
    no_violations(&fake);
}

#[test]
fn windows_do_not_nest_or_open_inside_groups() {
    let fake = FakeNccl::new(Script::default());
    let (mut core, stream, _) = solo(&fake, LONG);
    let nested = window(&mut core, &stream, |c| {
        let inner = c.window_begin().unwrap_err().to_string();
        assert!(inner.contains("do not nest"), "{inner}");
        Ok(())
    });
    assert!(nested.is_ok());
    let in_group = group(&mut core, &stream, |c| {
        let e = c.window_begin().unwrap_err().to_string();
        assert!(e.contains("inside a group"), "{e}");
        Ok(())
    });
    assert!(in_group.is_ok());
    assert!(!core.is_aborted());
    let e = core.window_finish(&stream, None).unwrap_err().to_string();
    assert!(e.contains("without window_begin"), "{e}");
    no_violations(&fake);
}

#[test]
fn an_error_in_a_queued_group_surfaces_at_the_windows_end() {
    let fake = script(|s| s.async_after_launch = Some(nccl_sys_min::ncclResult_t::ncclRemoteError));
    let (mut core, stream, _) = solo(&fake, LONG);
    let err = window(&mut core, &stream, |c| {
        group(c, &stream, |c| send(c, &stream, 0))?;
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("ncclRemoteError"), "{err}");
    assert!(core.is_aborted());
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

/// What a window body does at one step.
#[derive(Clone, Debug)]
enum Step {
    Group(usize),
    Op,
    Fail,
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Whatever the body does (groups of any size, standalone operations,
    /// a failure anywhere), every group closes, the window closes, and the
    /// communicator is aborted exactly when a failure followed an enqueued
    /// group.
    #[test]
    fn windows_always_close(body in prop::collection::vec(prop_oneof![
        3 => (0usize..3).prop_map(Step::Group),
        1 => Just(Step::Op),
        1 => Just(Step::Fail),
    ], 0..8)) {
        let fake = FakeNccl::new(Script::default());
        let (mut core, stream, _) = solo(&fake, LONG);
        let mut grouped_before_failure = 0;
        let mut failed = false;
        for s in &body {
            match s {
                Step::Group(n) => grouped_before_failure += n,
                Step::Op => {}
                Step::Fail => { failed = true; break; }
            }
        }
        let result = window(&mut core, &stream, |c| {
            for s in &body {
                match s {
                    Step::Group(n) => group(c, &stream, |c| {
                        for _ in 0..*n {
                            all_reduce(c, &stream)?;
                        }
                        Ok(())
                    })?,
                    Step::Op => all_reduce(c, &stream)?,
                    Step::Fail => return Err(CommError::config("scripted failure")),
                }
            }
            Ok(())
        });
        prop_assert_eq!(result.is_err(), failed);
        prop_assert!(!core.in_window());
        prop_assert_eq!(fake.open_groups(), 0);
        prop_assert_eq!(core.is_aborted(), failed && grouped_before_failure > 0);
        drop(core);
        prop_assert!(fake.violations().is_empty(), "{:?}", fake.violations());
    }
}
