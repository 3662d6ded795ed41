//! An in-process rendezvous: ranks are threads of one process (thread
//! worlds, tests) or a world of one. Nothing outlives the `Vec` of handles,
//! so no stale value can exist.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::{CommError, Rendezvous, Result};

#[derive(Default)]
struct Shared {
    values: HashMap<String, Vec<u8>>,
    barriers: HashMap<(String, u64), usize>,
}

/// One rank's handle on an in-process rendezvous.
pub struct MemoryRendezvous {
    rank: usize,
    world: usize,
    shared: Arc<(Mutex<Shared>, Condvar)>,
    gens: Mutex<HashMap<String, u64>>,
}

impl std::fmt::Debug for MemoryRendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryRendezvous")
            .field("rank", &self.rank)
            .field("world", &self.world)
            .finish()
    }
}

impl MemoryRendezvous {
    /// Handles for ranks `0..world` (element `r` is rank `r`).
    pub fn world(world: usize) -> Vec<MemoryRendezvous> {
        let shared = Arc::new((Mutex::new(Shared::default()), Condvar::new()));
        (0..world)
            .map(|rank| MemoryRendezvous {
                rank,
                world,
                shared: shared.clone(),
                gens: Mutex::new(HashMap::new()),
            })
            .collect()
    }

    /// The rendezvous of a world of one.
    pub fn solo() -> MemoryRendezvous {
        let mut v = MemoryRendezvous::world(1);
        v.remove(0)
    }

    fn lock(&self) -> MutexGuard<'_, Shared> {
        self.shared.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn timeout_error(&self, what: String, timeout: Duration, detail: String) -> CommError {
        CommError::Rendezvous {
            rank: self.rank,
            location: format!("memory:{what}"),
            timeout,
            detail,
        }
    }
}

impl Rendezvous for MemoryRendezvous {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn publish(&self, key: &str, value: &[u8]) -> Result<()> {
        self.lock().values.insert(key.to_string(), value.to_vec());
        self.shared.1.notify_all();
        Ok(())
    }

    fn fetch(&self, key: &str, len: usize, timeout: Duration) -> Result<Vec<u8>> {
        let deadline = Instant::now() + timeout;
        let mut g = self.lock();
        loop {
            match g.values.get(key) {
                Some(v) if v.len() == len => return Ok(v.clone()),
                _ => {}
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let detail = match g.values.get(key) {
                    Some(v) => format!("expected exactly {len} bytes; the value holds {}", v.len()),
                    None => {
                        format!("expected a value of exactly {len} bytes; it was never published")
                    }
                };
                return Err(self.timeout_error(key.to_string(), timeout, detail));
            }
            g = self
                .shared
                .1
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn peek(&self, key: &str) -> Result<Option<Vec<u8>>> {
        Ok(self.lock().values.get(key).cloned())
    }

    fn barrier(&self, name: &str, timeout: Duration) -> Result<()> {
        let gen = {
            let mut gens = self.gens.lock().unwrap_or_else(|p| p.into_inner());
            let g = gens.entry(name.to_string()).or_insert(0);
            *g += 1;
            *g
        };
        let key = (name.to_string(), gen);
        let deadline = Instant::now() + timeout;
        let mut g = self.lock();
        *g.barriers.entry(key.clone()).or_insert(0) += 1;
        self.shared.1.notify_all();
        loop {
            let n = g.barriers.get(&key).copied().unwrap_or(0);
            if n >= self.world {
                return Ok(());
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.timeout_error(
                    format!("barrier/{name}"),
                    timeout,
                    format!(
                        "barrier {name:?} (#{gen}): {n} of {} ranks arrived",
                        self.world
                    ),
                ));
            }
            g = self
                .shared
                .1
                .wait_timeout(g, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }
}
