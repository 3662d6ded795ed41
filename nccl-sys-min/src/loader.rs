//! Finding and opening `libnccl` at run time.
//!
//! Invariant: a [`Nccl`] holds an open library whose every bound entry point
//! resolved, and the library is never unloaded, not even when the value is
//! dropped. NCCL starts threads of its own (bootstrap, proxy) from calls such
//! as `ncclGetUniqueId` that outlive the call; closing the library would unmap
//! the code those threads run. On the GPU hosts that was a segfault right
//! after a test dropped its `Nccl`. So the `libloading::Library` inside
//! [`NcclLib`] is held in a `ManuallyDrop` and deliberately leaked: the cost
//! is one loader reference per successful open.

use std::ffi::{CStr, OsStr, OsString};

use crate::{ncclComm_t, ncclResult_t, ncclUniqueId, Attempt, NcclLib, NcclSysError, NcclVersion};

/// Environment variable naming the library to open (a path, or a name for
/// the dynamic loader). When set and non-empty it is the only candidate: an
/// override that cannot be opened is an error, never silently bypassed.
pub const LIBRARY_ENV: &str = "MAMBA_NCCL_LIBRARY";

/// Directories searched after the dynamic loader's own search, in order.
const USUAL_DIRS: &[&str] = &[
    #[cfg(target_arch = "x86_64")]
    "/usr/lib/x86_64-linux-gnu",
    #[cfg(target_arch = "aarch64")]
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/cuda/lib64",
    "/usr/local/nccl/lib",
    "/opt/nccl/lib",
];

/// The candidates [`Nccl::open`] tries, in order, given an environment
/// lookup (pass `|k| std::env::var_os(k)` for the process environment):
///
/// 1. `$MAMBA_NCCL_LIBRARY` alone, when set and non-empty;
/// 2. otherwise `libnccl.so.2` and `libnccl.so` through the dynamic loader
///    (`LD_LIBRARY_PATH`, the loader cache, the default directories), then
///    `libnccl.so.2` under `$NCCL_HOME/lib`, `$CUDA_HOME/lib64`,
///    `$CUDA_PATH/lib64` and the usual system directories.
pub fn search_list(env: impl Fn(&str) -> Option<OsString>) -> Vec<OsString> {
    if let Some(path) = env(LIBRARY_ENV).filter(|v| !v.is_empty()) {
        return vec![path];
    }
    let mut list: Vec<OsString> = vec!["libnccl.so.2".into(), "libnccl.so".into()];
    for (var, sub) in [
        ("NCCL_HOME", "lib"),
        ("CUDA_HOME", "lib64"),
        ("CUDA_PATH", "lib64"),
    ] {
        if let Some(root) = env(var).filter(|v| !v.is_empty()) {
            let mut p = std::path::PathBuf::from(root);
            p.push(sub);
            p.push("libnccl.so.2");
            list.push(p.into_os_string());
        }
    }
    for dir in USUAL_DIRS {
        list.push(format!("{dir}/libnccl.so.2").into());
    }
    let mut seen = std::collections::HashSet::new();
    list.retain(|c| seen.insert(c.clone()));
    list
}

/// An opened NCCL library with every bound entry point resolved.
pub struct Nccl {
    /// Never dropped: see the module docs.
    lib: std::mem::ManuallyDrop<NcclLib>,
    path: String,
    version: NcclVersion,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("path", &self.path)
            .field("version", &self.version)
            .finish()
    }
}

impl Nccl {
    /// Open the first candidate of [`search_list`] over the process
    /// environment.
    pub fn open() -> Result<Self, NcclSysError> {
        Self::open_first(&search_list(|k| std::env::var_os(k)))
    }

    /// Open the first candidate that the dynamic loader can open. A library
    /// that opens but is unusable (missing entry points, no version) ends the
    /// search with its own error: silently taking a different NCCL than the
    /// one found first would hide a broken installation.
    pub fn open_first(candidates: &[OsString]) -> Result<Self, NcclSysError> {
        let mut tried = Vec::new();
        for c in candidates {
            match Self::open_path(c) {
                Ok(nccl) => return Ok(nccl),
                Err(NcclSysError::NotFound { tried: mut t }) => tried.append(&mut t),
                Err(other) => return Err(other),
            }
        }
        Err(NcclSysError::NotFound { tried })
    }

    /// Open exactly `path` (a file path or a name for the dynamic loader).
    pub fn open_path(path: &OsStr) -> Result<Self, NcclSysError> {
        let shown = path.to_string_lossy().into_owned();
        // SAFETY: opening a shared library runs its initialisers; NCCL's are
        // plain C initialisers with no preconditions on the caller.
        let library = unsafe { libloading::Library::new(path) }.map_err(|e| {
            // dlerror() text usually repeats the candidate: keep it once.
            let text = e.to_string();
            let reason = text
                .strip_prefix(&format!("{shown}: "))
                .unwrap_or(&text)
                .to_string();
            NcclSysError::NotFound {
                tried: vec![Attempt {
                    candidate: shown.clone(),
                    reason,
                }],
            }
        })?;
        // Read the version first, through its own symbol, so that a library
        // too old to have some later entry point is reported with its version.
        // SAFETY: `ncclGetVersion` has had this signature since NCCL 2.0; the
        // symbol pointer is used only while `library` is alive.
        let (version, resolved) = unsafe {
            let sym = library
                .get::<unsafe extern "C" fn(*mut core::ffi::c_int) -> ncclResult_t>(
                    b"ncclGetVersion\0",
                )
                .map_err(|e| NcclSysError::MissingSymbol {
                    path: shown.clone(),
                    version: None,
                    detail: e.to_string(),
                })?;
            let mut code: core::ffi::c_int = 0;
            let rc = sym(&mut code);
            let resolved = resolved_path(*sym as *const core::ffi::c_void);
            if rc != ncclResult_t::ncclSuccess {
                return Err(NcclSysError::BadVersion {
                    path: shown,
                    detail: format!("returned {rc:?}"),
                });
            }
            let version = NcclVersion::from_code(code).ok_or_else(|| NcclSysError::BadVersion {
                path: shown.clone(),
                detail: format!("reported code {code}"),
            })?;
            (version, resolved)
        };
        let path = resolved.unwrap_or(shown);
        // SAFETY: as above; `from_library` only resolves symbols.
        let lib =
            unsafe { NcclLib::from_library(library) }.map_err(|e| NcclSysError::MissingSymbol {
                path: path.clone(),
                version: Some(version),
                detail: e.to_string(),
            })?;
        Ok(Nccl {
            lib: std::mem::ManuallyDrop::new(lib),
            path,
            version,
        })
    }

    /// The file that was opened (resolved through the loader when it can
    /// say, otherwise the candidate as given).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The library's own version (`ncclGetVersion`).
    pub fn version(&self) -> NcclVersion {
        self.version
    }

    /// The raw entry points. Every one is `unsafe` with NCCL's C contract.
    pub fn api(&self) -> &NcclLib {
        &self.lib
    }

    /// NCCL's text for a result code (`ncclGetErrorString`); any code value
    /// is accepted, unknown ones get NCCL's "unknown result code" text.
    pub fn error_string(&self, code: ncclResult_t) -> String {
        // SAFETY: takes a plain integer and returns a pointer to a static
        // string (or null, handled by `c_text`).
        unsafe { c_text(self.lib.ncclGetErrorString(code)) }
    }

    /// NCCL's last error message (`ncclGetLastError`), which names the
    /// failed step in words (e.g. which socket connect failed).
    ///
    /// # Safety
    /// `comm` is null or a live communicator of this library (not destroyed
    /// or aborted).
    pub unsafe fn last_error(&self, comm: ncclComm_t) -> String {
        c_text(self.lib.ncclGetLastError(comm))
    }

    /// A fresh unique id (`ncclGetUniqueId`).
    pub fn unique_id(&self) -> Result<ncclUniqueId, ncclResult_t> {
        let mut id = ncclUniqueId { internal: [0; 128] };
        // SAFETY: writes 128 bytes into `id`, which we own.
        let rc = unsafe { self.lib.ncclGetUniqueId(&mut id) };
        if rc == ncclResult_t::ncclSuccess {
            Ok(id)
        } else {
            Err(rc)
        }
    }
}

/// Copy a C string NCCL returned; null becomes an empty string.
///
/// # Safety
/// `p` is null or points to a NUL-terminated string that stays valid for the
/// duration of the call.
unsafe fn c_text(p: *const core::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    CStr::from_ptr(p).to_string_lossy().into_owned()
}

/// The file that contains `addr`, through `dladdr`.
fn resolved_path(addr: *const core::ffi::c_void) -> Option<String> {
    // SAFETY: dladdr only reads loader tables; `info` is ours and zeroed.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if libc::dladdr(addr, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(
            CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

impl ncclUniqueId {
    /// The id as the 128 bytes that travel through the rendezvous.
    pub fn to_bytes(&self) -> [u8; 128] {
        let mut out = [0u8; 128];
        for (o, c) in out.iter_mut().zip(self.internal.iter()) {
            *o = *c as u8;
        }
        out
    }

    /// The id from the 128 bytes another rank published.
    pub fn from_bytes(bytes: &[u8; 128]) -> Self {
        let mut id = ncclUniqueId { internal: [0; 128] };
        for (c, b) in id.internal.iter_mut().zip(bytes.iter()) {
            *c = *b as core::ffi::c_char;
        }
        id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(pairs: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<OsString> + 'a {
        move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| OsString::from(v))
        }
    }

    #[test]
    fn override_is_the_only_candidate() {
        let list = search_list(env(&[
            (LIBRARY_ENV, "/opt/x/libnccl.so.2"),
            ("CUDA_HOME", "/c"),
        ]));
        assert_eq!(list, vec![OsString::from("/opt/x/libnccl.so.2")]);
    }

    #[test]
    fn empty_override_counts_as_unset() {
        let list = search_list(env(&[(LIBRARY_ENV, "")]));
        assert_eq!(list[0], OsString::from("libnccl.so.2"));
        assert_eq!(list[1], OsString::from("libnccl.so"));
        assert!(list.len() > 2);
    }

    #[test]
    fn homes_come_before_system_dirs_and_nothing_repeats() {
        let list = search_list(env(&[
            ("CUDA_HOME", "/usr/local/cuda"),
            ("NCCL_HOME", "/n"),
        ]));
        assert_eq!(list[2], OsString::from("/n/lib/libnccl.so.2"));
        assert_eq!(
            list[3],
            OsString::from("/usr/local/cuda/lib64/libnccl.so.2")
        );
        let unique: std::collections::HashSet<_> = list.iter().collect();
        assert_eq!(unique.len(), list.len(), "{list:?}");
    }

    #[test]
    fn unique_id_bytes_round_trip() {
        let bytes: [u8; 128] = std::array::from_fn(|i| (i * 37 + 200) as u8);
        assert_eq!(ncclUniqueId::from_bytes(&bytes).to_bytes(), bytes);
    }
}
