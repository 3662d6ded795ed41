//! A rank's (or a supervisor's) view of SIGTERM and SIGINT: the request to
//! stop that SLURM and other schedulers send before they kill a job.
//!
//! The first signal only raises a flag ([`StopSignal::requested`]): the
//! process keeps running, so that a data-parallel world can agree on a
//! step boundary (every rank asks [`StopSignal::requested`] there and the
//! world takes the collective OR), write a checkpoint and exit. A *second*
//! signal, at least [`DEBOUNCE`] after the first, exits at once with the
//! conventional status `128 + signal`, writing nothing.
//!
//! The debounce exists because one event often arrives twice: Ctrl-C in a
//! terminal reaches every process of the foreground group, and the
//! supervisor forwards the signal it got to its ranks as well.
//!
//! Handlers are process-wide and stay for the rest of the process:
//! [`StopSignal::install`] registers them once and returns the same
//! `&'static` view on every call (signal-hook cannot restore the default
//! action once its handler is in place, so nothing unregisters them).

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use signal_hook::consts::{SIGINT, SIGTERM};

use crate::{CommError, Result};

/// A repeat of the stop signal within this time of the first counts as the
/// same event (see the module docs).
pub const DEBOUNCE: Duration = Duration::from_secs(1);

/// The signals that request a stop.
pub const STOP_SIGNALS: [i32; 2] = [SIGTERM, SIGINT];

/// The exit status of a process ended by a stop request for `signal`
/// (the shell's convention, `128 + signal`: 143 for SIGTERM, 130 for
/// SIGINT).
pub fn stop_status(signal: i32) -> i32 {
    128 + signal
}

/// The name of a stop signal (`SIGTERM`, `SIGINT`), or its number.
pub fn signal_name(signal: i32) -> String {
    match signal {
        SIGTERM => "SIGTERM".into(),
        SIGINT => "SIGINT".into(),
        other => format!("signal {other}"),
    }
}

/// State shared with the handlers: only atomics, so the handlers stay
/// async-signal-safe.
#[derive(Default)]
struct Shared {
    /// The first stop signal received (0: none yet).
    first: AtomicI32,
    /// `CLOCK_MONOTONIC` nanoseconds of the first signal, plus one (0: none).
    at_ns: AtomicU64,
}

/// The installed SIGTERM/SIGINT handlers of this process (see the module
/// docs).
pub struct StopSignal {
    shared: Arc<Shared>,
}

static INSTALLED: OnceLock<StopSignal> = OnceLock::new();
/// Serialises installs, so the handlers are registered once.
static INSTALLING: Mutex<()> = Mutex::new(());

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime is async-signal-safe; `ts` is a valid
    // out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(ts.tv_nsec as u64)
}

impl StopSignal {
    /// Register the handlers for SIGTERM and SIGINT (once per process;
    /// later calls return the same handlers).
    pub fn install() -> Result<&'static StopSignal> {
        let _one_at_a_time = INSTALLING.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = INSTALLED.get() {
            return Ok(s);
        }
        let shared = Arc::new(Shared::default());
        let mut ids = Vec::new();
        for sig in STOP_SIGNALS {
            let s = Arc::clone(&shared);
            let action = move || {
                let now = monotonic_ns();
                match s
                    .first
                    .compare_exchange(0, sig, Ordering::SeqCst, Ordering::SeqCst)
                {
                    Ok(_) => s.at_ns.store(now.saturating_add(1), Ordering::SeqCst),
                    Err(_) => {
                        let first = s.at_ns.load(Ordering::SeqCst).saturating_sub(1);
                        if now.saturating_sub(first) >= DEBOUNCE.as_nanos() as u64 {
                            signal_hook::low_level::exit(stop_status(sig));
                        }
                    }
                }
            };
            // SAFETY: the action only reads a clock, touches atomics and
            // may call `_exit` (signal_hook::low_level::exit): all
            // async-signal-safe; it allocates nothing and takes no lock.
            match unsafe { signal_hook::low_level::register(sig, action) } {
                Ok(id) => ids.push(id),
                Err(e) => {
                    for id in ids {
                        signal_hook::low_level::unregister(id);
                    }
                    return Err(CommError::Config(format!(
                        "cannot install the {} handler: {e}",
                        signal_name(sig)
                    )));
                }
            }
        }
        Ok(INSTALLED.get_or_init(|| StopSignal { shared }))
    }

    /// The first stop signal received so far, if any.
    pub fn requested(&self) -> Option<i32> {
        match self.shared.first.load(Ordering::SeqCst) {
            0 => None,
            sig => Some(sig),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_statuses() {
        assert_eq!(stop_status(SIGTERM), 143);
        assert_eq!(stop_status(SIGINT), 130);
        assert_eq!(signal_name(SIGTERM), "SIGTERM");
        assert_eq!(signal_name(SIGINT), "SIGINT");
    }
}
