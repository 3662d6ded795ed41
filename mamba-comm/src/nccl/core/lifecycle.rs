//! The two ends of a communicator's life: init under a deadline, and the
//! orderly, single-shot teardown.

use std::ffi::c_int;
use std::sync::Arc;
use std::time::{Duration, Instant};

use nccl_sys_min::ncclConfig_t;

use super::{CommCore, Place};
use crate::nccl::api::NcclApi;
use crate::nccl::handle::HandleSlot;
use crate::nccl::result::nonblocking;
use crate::nccl::watchdog::{nonempty, Until};
use crate::{CommError, Result};

impl CommCore {
    /// Create this rank's communicator with NCCL's nonblocking pattern:
    /// `ncclCommInitRankConfig` with `blocking = 0`, then poll
    /// `ncclCommGetAsyncError` until it leaves `ncclInProgress`. A peer that
    /// never arrives makes the poll reach `deadline`; the half-made
    /// communicator is then aborted and the error says so. Errors carry
    /// NCCL's last-error text.
    pub(crate) fn init(
        api: Arc<dyn NcclApi>,
        id: &[u8; 128],
        place: Place,
        init_timeout: Duration,
        deadline: Instant,
        collective_timeout: Duration,
    ) -> Result<Self> {
        let Place { rank, world } = place;
        let to_c = |v: usize, what: &str| {
            c_int::try_from(v)
                .map_err(|_| CommError::config(format!("{what} {v} does not fit NCCL's int")))
        };
        let (c_world, c_rank) = (to_c(world, "world size")?, to_c(rank, "rank")?);
        if world == 0 || rank >= world {
            return Err(CommError::config(format!(
                "NCCL init: rank {rank} is outside a world of {world}; expected 0 <= rank < world"
            )));
        }
        let mut config = ncclConfig_t::initializer();
        config.blocking = 0;
        let (rc, raw) = api.init_rank_config(c_world, id, c_rank, &mut config);
        let started = nonblocking(rc);
        if started.is_err() || raw.is_null() {
            // SAFETY: `raw` is null or the handle NCCL just returned.
            let text = unsafe { api.last_error(raw) };
            if !raw.is_null() {
                // SAFETY: a non-null handle from a failed init still owns
                // resources; it is aborted once and never used again.
                unsafe { api.abort(raw) };
            }
            let what = match started {
                Ok(_) => "returned no communicator".to_string(),
                Err(e) => format!("returned {}", api.describe(e)),
            };
            return Err(CommError::transport(
                "init",
                format!(
                    "rank {rank} of {world}: ncclCommInitRankConfig {what}; NCCL says: {}",
                    nonempty(&text)
                ),
            ));
        }
        // SAFETY: `raw` is the non-null handle init just returned; nothing
        // else holds it.
        let slot = unsafe { HandleSlot::new(raw) };
        let mut core = CommCore {
            api,
            slot,
            place,
            device: -1,
            collective_timeout,
            group: None,
            window: None,
            abort_watch: None,
        };
        let hint = format!(
            "a rank never arrived: all {world} ranks must call init within {init_timeout:?}; a crashed \
             rank, a wrong unique id or an unreachable network are the usual causes (NCCL_DEBUG=WARN \
             shows NCCL's view)"
        );
        core.wait("init", Until::Ready, deadline, init_timeout, &hint)?;
        // SAFETY: the handle is live (Some) and initialised (the poll above
        // returned ncclSuccess).
        let identity = unsafe { core.api.identity(raw) };
        match identity {
            Ok((count, user_rank, device)) if count == c_world && user_rank == c_rank => {
                core.device = device;
                Ok(core)
            }
            Ok((count, user_rank, _)) => Err(core.fail(
                "init",
                format!(
                    "NCCL made a communicator of {count} ranks with this process as rank \
                     {user_rank}; expected {world} ranks and rank {rank}"
                ),
            )),
            Err(e) => {
                let d = core.api.describe(e);
                Err(core.fail("init", format!("querying the new communicator failed: {d}")))
            }
        }
    }

    /// Orderly teardown: `ncclCommFinalize`, polled to completion under the
    /// collective timeout, then `ncclCommDestroy`.
    /// - A failed or timed-out finalize aborts instead, and the error says so.
    /// - The handle is released before `ncclCommDestroy`; a failed destroy is
    ///   reported and never followed by an abort (the handle is gone).
    /// - On a communicator already aborted (or already shut down) there is
    ///   nothing left to release: `Ok(())`, and no NCCL call is made.
    pub(crate) fn shutdown(&mut self) -> Result<()> {
        if self.group.is_some() {
            return Err(CommError::config(
                "shutdown inside an open group (a bug in mamba-comm)",
            ));
        }
        if !self.slot.exists() {
            return Ok(());
        }
        if self.is_aborted() {
            self.abort_now();
            return Ok(());
        }
        let h = self.slot.live_handle("shutdown")?;
        let timeout = self.collective_timeout;
        let deadline = Instant::now() + timeout;
        // SAFETY: `h` is live (present, not aborted).
        if let Err(e) = nonblocking(unsafe { self.api.finalize(h) }) {
            // SAFETY: still live; text read before the abort.
            let text = unsafe { self.api.last_error(h) };
            let d = self.api.describe(e);
            return Err(self.fail(
                "shutdown",
                format!(
                    "ncclCommFinalize returned {d}: {}; aborting instead of destroying",
                    nonempty(&text)
                ),
            ));
        }
        self.wait(
            "shutdown",
            Until::Ready,
            deadline,
            timeout,
            "ncclCommFinalize never reached quiescence: a peer is gone or stuck",
        )?;
        match self.slot.destroy(&*self.api) {
            Ok(_) => Ok(()),
            Err(e) => {
                let Place { rank, world } = self.place;
                Err(CommError::transport(
                    "shutdown",
                    format!(
                        "rank {rank} of {world}: ncclCommDestroy returned {}; the handle is \
                         released and is not aborted (it no longer exists to abort)",
                        self.api.describe(e)
                    ),
                ))
            }
        }
    }
}
