//! The one error type of `nccl-sys-min`.

use std::fmt;

use crate::NcclVersion;

/// One place the loader looked for the library, and why it was not used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attempt {
    /// The name or path handed to the dynamic loader.
    pub candidate: String,
    /// The loader's reason (usually `dlerror()` text).
    pub reason: String,
}

impl fmt::Display for Attempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.candidate, self.reason)
    }
}

/// Everything that can go wrong while opening NCCL.
#[derive(Debug, thiserror::Error)]
pub enum NcclSysError {
    /// No candidate could be opened.
    #[error(
        "NCCL library not found; tried {}. Install NCCL (libnccl.so.2, version 2.26 or newer) \
         or set {env} to the full path of libnccl.so.2",
        list(.tried),
        env = crate::LIBRARY_ENV
    )]
    NotFound {
        /// Every candidate, in the order tried, with its reason.
        tried: Vec<Attempt>,
    },

    /// A library was opened but it lacks an entry point this crate binds.
    #[error(
        "{path} (NCCL {}) lacks an entry point these bindings need: {detail}; \
         use NCCL 2.26 or newer",
        version.map(|v| v.to_string()).unwrap_or_else(|| "version unknown".into())
    )]
    MissingSymbol {
        /// The library that was opened.
        path: String,
        /// Its version when `ncclGetVersion` could be called.
        version: Option<NcclVersion>,
        /// The loader's message, naming the symbol.
        detail: String,
    },

    /// `ncclGetVersion` failed or returned a code that decodes to no version.
    #[error("{path}: ncclGetVersion {detail}; expected a version code such as 22803 for 2.28.3")]
    BadVersion {
        /// The library that was opened.
        path: String,
        /// What the call returned.
        detail: String,
    },
}

fn list(tried: &[Attempt]) -> String {
    if tried.is_empty() {
        return "nothing".into();
    }
    tried
        .iter()
        .map(|a| format!("[{a}]"))
        .collect::<Vec<_>>()
        .join(", ")
}
