//! The stop-request handlers (process-wide, so their own test binary: a
//! raised SIGTERM would otherwise reach the supervisor tests of the crate).

use mamba_comm::stop_signal::StopSignal;

#[test]
fn the_first_signal_raises_the_flag_and_a_quick_repeat_is_the_same_event() {
    let stop = StopSignal::install().unwrap();
    assert_eq!(stop.requested(), None);
    // SAFETY: raise has no preconditions; the handler is installed.
    unsafe { libc::raise(libc::SIGTERM) };
    assert_eq!(stop.requested(), Some(libc::SIGTERM));
    // A repeat within the debounce: still running, still SIGTERM.
    unsafe { libc::raise(libc::SIGINT) };
    assert_eq!(stop.requested(), Some(libc::SIGTERM));
    assert!(std::ptr::eq(stop, StopSignal::install().unwrap()));
}
