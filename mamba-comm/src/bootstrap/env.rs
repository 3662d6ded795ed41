//! Where the bootstrap reads variables from.
//!
//! Everything that parses the environment takes an [`EnvSource`], so the
//! parsing is a pure function of a map: property tests generate
//! environments without touching the process's own (which would race with
//! other test threads).

use std::collections::{BTreeMap, HashMap};

/// A read-only view of environment variables.
pub trait EnvSource {
    /// The raw value of `name`, or `None` when it is not set at all.
    fn raw(&self, name: &str) -> Option<String>;

    /// The value of `name`, with the contract's rule that an empty value
    /// counts as unset.
    fn var(&self, name: &str) -> Option<String> {
        self.raw(name).filter(|v| !v.is_empty())
    }
}

/// The environment of this process. A value that is not valid UTF-8 is
/// read lossily (so it fails validation with a message instead of being
/// silently skipped).
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn raw(&self, name: &str) -> Option<String> {
        std::env::var_os(name).map(|v| v.to_string_lossy().into_owned())
    }
}

impl EnvSource for BTreeMap<String, String> {
    fn raw(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

impl EnvSource for HashMap<String, String> {
    fn raw(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

impl EnvSource for [(&str, &str)] {
    fn raw(&self, name: &str) -> Option<String> {
        self.iter()
            .rev()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.to_string())
    }
}

impl<const N: usize> EnvSource for [(&str, &str); N] {
    fn raw(&self, name: &str) -> Option<String> {
        self.as_slice().raw(name)
    }
}
