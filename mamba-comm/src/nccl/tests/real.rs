//! The real library on a machine without a GPU: when an NCCL library can be
//! opened (e.g. `MAMBA_NCCL_LIBRARY` pointing at the `nvidia-nccl-cu13`
//! wheel's `libnccl.so.2`) but no CUDA driver is present, NCCL still makes
//! unique ids and fails init cleanly. That exercises the real FFI path of
//! the library table (config struct, id by value, last-error text) on the
//! CPU. Skips when NCCL is absent, and on GPU machines (where the GPU tests
//! cover init for real).

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::super::api::{NcclApi, RealNccl};
use super::super::core::{CommCore, Place};
use super::super::{library, visible_devices};

fn real_without_gpu() -> Option<Arc<dyn NcclApi>> {
    let lib = match library() {
        Ok(lib) => lib,
        Err(e) => {
            eprintln!("skipping: no NCCL library ({e})");
            return None;
        }
    };
    if let Ok(n) = visible_devices() {
        eprintln!("skipping: {n} CUDA device(s) here; the GPU tests cover the real init");
        return None;
    }
    Some(Arc::new(RealNccl { lib }))
}

#[test]
fn real_unique_ids_are_fresh_128_byte_values() {
    let Some(api) = real_without_gpu() else {
        return;
    };
    let a = api.unique_id().expect("ncclGetUniqueId");
    let b = api.unique_id().expect("ncclGetUniqueId");
    assert_eq!(a.len(), 128);
    assert!(a.iter().any(|&x| x != 0));
    assert_ne!(a, b, "two ids must differ");
}

#[test]
fn real_init_failure_carries_nccls_own_text() {
    let Some(api) = real_without_gpu() else {
        return;
    };
    let id = api.unique_id().expect("ncclGetUniqueId");
    let t = Duration::from_secs(20);
    let err = CommCore::init(
        api,
        &id,
        Place { rank: 0, world: 1 },
        t,
        Instant::now() + t,
        t,
    )
    .expect_err("no CUDA driver: init must fail");
    let text = err.to_string();
    assert!(text.contains("rank 0 of 1"), "{text}");
    // NCCL's last-error text (e.g. "Cuda failure 'CUDA driver version is
    // insufficient ...'") follows "NCCL says:".
    let says = text.split("NCCL says:").nth(1).unwrap_or("").trim();
    assert!(
        !says.is_empty() && says != "(no message)",
        "no NCCL text in: {text}"
    );
    eprintln!("{text}");
}
