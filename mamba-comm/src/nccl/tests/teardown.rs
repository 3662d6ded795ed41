use std::time::Instant;

use nccl_sys_min::ncclResult_t;

use super::*;
use crate::nccl::fake::FinalizeMode;

fn teardown_calls(fake: &FakeNccl) -> Vec<Call> {
    fake.log()
        .into_iter()
        .filter(|c| matches!(c, Call::Finalize(_) | Call::Destroy(_) | Call::Abort { .. }))
        .collect()
}

#[test]
fn shutdown_is_finalize_then_destroy_and_drop_then_does_nothing() {
    let fake = FakeNccl::new(Script::default());
    let (mut core, stream, me) = solo(&fake, LONG);
    all_reduce(&mut core, &stream).expect("all-reduce");
    core.shutdown().expect("shutdown");
    // Finalize was polled to completion before the destroy.
    let log = fake.log();
    let fin = log
        .iter()
        .position(|c| *c == Call::Finalize(me))
        .expect("finalize");
    let des = log
        .iter()
        .position(|c| *c == Call::Destroy(me))
        .expect("destroy");
    assert!(fin < des);
    assert!(log[fin..des].contains(&Call::AsyncError(me)), "{log:?}");
    // A second shutdown and the Drop touch nothing.
    let n = fake.log().len();
    assert!(core.shutdown().is_ok());
    drop(core);
    assert_eq!(fake.log().len(), n);
    assert_eq!(
        teardown_calls(&fake),
        vec![Call::Finalize(me), Call::Destroy(me)]
    );
    no_violations(&fake);
}

#[test]
fn a_failed_finalize_aborts_instead_of_destroying() {
    let fake = script(|s| {
        s.finalize = FinalizeMode::Immediate(ncclResult_t::ncclInternalError);
        s.last_error = "proxy thread died".into();
    });
    let (mut core, _stream, me) = solo(&fake, LONG);
    let text = core.shutdown().unwrap_err().to_string();
    assert!(
        text.contains("ncclCommFinalize returned ncclInternalError"),
        "{text}"
    );
    assert!(
        text.contains("proxy thread died") && text.contains("aborted"),
        "{text}"
    );
    drop(core);
    assert_eq!(
        teardown_calls(&fake),
        vec![Call::Finalize(me), flagged_abort(me)]
    );
    no_violations(&fake);
}

#[test]
fn an_async_finalize_failure_aborts() {
    let fake = script(|s| s.finalize = FinalizeMode::Async(ncclResult_t::ncclRemoteError));
    let (mut core, _stream, me) = solo(&fake, LONG);
    let text = core.shutdown().unwrap_err().to_string();
    assert!(
        text.contains("ncclRemoteError") && text.contains("aborted"),
        "{text}"
    );
    drop(core);
    assert_eq!(
        teardown_calls(&fake),
        vec![Call::Finalize(me), flagged_abort(me)]
    );
    no_violations(&fake);
}

#[test]
fn a_finalize_that_never_completes_times_out_and_aborts() {
    let fake = script(|s| s.finalize = FinalizeMode::Hang);
    let (mut core, _stream, me) = solo(&fake, SHORT);
    let start = Instant::now();
    let text = core.shutdown().unwrap_err().to_string();
    assert_took_the_deadline(start);
    assert!(
        text.contains("did not complete within") && text.contains("aborted"),
        "{text}"
    );
    assert_eq!(
        teardown_calls(&fake),
        vec![Call::Finalize(me), flagged_abort(me)]
    );
    no_violations(&fake);
}

#[test]
fn a_failed_destroy_is_never_followed_by_an_abort() {
    let fake = script(|s| s.destroy = ncclResult_t::ncclInternalError);
    let (mut core, _stream, me) = solo(&fake, LONG);
    let text = core.shutdown().unwrap_err().to_string();
    assert!(
        text.contains("ncclCommDestroy returned ncclInternalError"),
        "{text}"
    );
    assert!(text.contains("not aborted"), "{text}");
    assert!(!core.is_aborted());
    drop(core);
    assert_eq!(
        teardown_calls(&fake),
        vec![Call::Finalize(me), Call::Destroy(me)]
    );
    no_violations(&fake);
}

#[test]
fn drop_aborts_a_live_communicator_once_with_the_flag_already_set() {
    let fake = FakeNccl::new(Script::default());
    let (core, _stream, me) = solo(&fake, LONG);
    let flag = core.aborted_flag();
    drop(core);
    assert_eq!(teardown_calls(&fake), vec![flagged_abort(me)]);
    assert!(flag.load(std::sync::atomic::Ordering::SeqCst));
    no_violations(&fake);
}

#[test]
fn drop_survives_an_abort_that_fails() {
    let fake = script(|s| s.abort = ncclResult_t::ncclInternalError);
    let (core, _stream, _) = solo(&fake, LONG);
    drop(core); // must not panic
    assert_eq!(aborts(&fake).len(), 1);
    no_violations(&fake);
}

/// Negative control: the fake really does flag a teardown that touches a
/// freed handle, so the `no_violations` checks above can fail.
#[test]
fn the_fake_detects_use_after_free() {
    let fake = FakeNccl::new(Script::default());
    let (core, _stream, _) = solo(&fake, LONG);
    let h = core.raw_handle().expect("live");
    let api: &dyn NcclApi = &*fake;
    // SAFETY: the fake never dereferences handles.
    unsafe {
        api.destroy(h);
        api.abort(h);
    }
    std::mem::forget(core); // its Drop would abort a third time
    let v = fake.violations();
    assert_eq!(v.len(), 1, "{v:?}");
    assert!(
        v[0].contains("ncclCommAbort") && v[0].contains("Destroyed"),
        "{v:?}"
    );
}
