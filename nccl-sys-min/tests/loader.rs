//! Opening the library: every failure is an error value that says what was
//! tried, never a crash. The last test uses a real NCCL when one is found
//! (set MAMBA_NCCL_LIBRARY to point at one) and skips otherwise.

use std::ffi::OsString;

use nccl_sys_min::{ncclResult_t, Nccl, NcclSysError, LIBRARY_ENV};

#[test]
fn missing_library_lists_every_candidate() {
    let candidates: Vec<OsString> = vec![
        "/nonexistent/a/libnccl.so.2".into(),
        "libnccl-does-not-exist.so.7".into(),
    ];
    let err = Nccl::open_first(&candidates).unwrap_err();
    match &err {
        NcclSysError::NotFound { tried } => {
            assert_eq!(tried.len(), 2);
            assert_eq!(tried[0].candidate, "/nonexistent/a/libnccl.so.2");
            assert_eq!(tried[1].candidate, "libnccl-does-not-exist.so.7");
            assert!(!tried[0].reason.is_empty());
        }
        other => panic!("expected NotFound, got {other:?}"),
    }
    let text = err.to_string();
    assert!(text.contains("/nonexistent/a/libnccl.so.2"), "{text}");
    assert!(text.contains(LIBRARY_ENV), "{text}");
}

#[test]
fn a_file_that_is_not_a_library_is_an_error() {
    let dir = std::env::temp_dir().join(format!("nccl-sys-min-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let fake = dir.join("libnccl.so.2");
    std::fs::write(&fake, b"not an ELF file").unwrap();
    let err = Nccl::open_path(fake.as_os_str()).unwrap_err();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(matches!(err, NcclSysError::NotFound { .. }), "{err:?}");
}

#[test]
fn a_library_without_nccl_symbols_is_refused_by_name() {
    // glibc is loaded in every test process on Linux and has no NCCL symbols.
    let err = Nccl::open_path("libc.so.6".as_ref()).unwrap_err();
    match &err {
        NcclSysError::MissingSymbol {
            detail, version, ..
        } => {
            assert!(detail.contains("ncclGetVersion"), "{detail}");
            assert!(version.is_none());
        }
        other => panic!("expected MissingSymbol, got {other:?}"),
    }
}

#[test]
fn real_library_when_present() {
    let nccl = match Nccl::open() {
        Ok(n) => n,
        Err(e) => {
            eprintln!("skipping: no NCCL library here ({e})");
            return;
        }
    };
    let v = nccl.version();
    assert!(v.major >= 2, "{v}");
    assert!(!nccl.path().is_empty());
    assert!(
        nccl.error_string(ncclResult_t::ncclInvalidArgument)
            .to_lowercase()
            .contains("invalid argument"),
        "{}",
        nccl.error_string(ncclResult_t::ncclInvalidArgument)
    );
    // A code this header does not know is still a valid value to pass.
    assert!(!nccl.error_string(ncclResult_t(4242)).is_empty());
    // The unique id comes back through the by-pointer ABI (no GPU needed).
    let id = nccl.unique_id().expect("ncclGetUniqueId").to_bytes();
    assert!(id.iter().any(|&b| b != 0), "an all-zero unique id");
    eprintln!("opened NCCL {v} at {}", nccl.path());
}
