//! Numbering of named barriers, shared by the rendezvous that keep barrier
//! keys in their store.

use std::collections::HashMap;
use std::sync::Mutex;

/// How many times this rank has entered each named barrier. The `n`-th
/// barrier of a name uses keys of its own, so arrivals at an earlier
/// barrier of the same name are never counted for a later one (every rank
/// enters a name's barriers in the same order, so their numbers agree).
#[derive(Debug, Default)]
pub(crate) struct BarrierCounts(Mutex<HashMap<String, u64>>);

impl BarrierCounts {
    /// The number (from 1) of this entry into barrier `name`.
    pub(crate) fn next(&self, name: &str) -> u64 {
        let mut counts = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let n = counts.entry(name.to_string()).or_insert(0);
        *n += 1;
        *n
    }
}
