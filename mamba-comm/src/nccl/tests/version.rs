use crate::nccl::{check_version, NcclOptions, NcclVersion, MIN_VERSION};
use crate::CommError;

#[test]
fn floor_is_2_26_0() {
    assert_eq!(MIN_VERSION.code(), 22600);
    assert_eq!(
        check_version(NcclVersion::new(2, 26, 0), "x").unwrap(),
        MIN_VERSION
    );
    assert!(check_version(NcclVersion::new(2, 28, 3), "x").is_ok());
    assert!(check_version(NcclVersion::new(3, 0, 0), "x").is_ok());
}

#[test]
fn below_floor_names_both_versions_and_the_override() {
    let err = check_version(NcclVersion::new(2, 25, 9), "/usr/lib/libnccl.so.2").unwrap_err();
    assert!(matches!(err, CommError::Config(_)));
    let text = err.to_string();
    for needle in [
        "2.25.9",
        "2.26.0",
        "/usr/lib/libnccl.so.2",
        "MAMBA_NCCL_LIBRARY",
    ] {
        assert!(text.contains(needle), "missing {needle:?} in {text}");
    }
    // The pre-2.9 encoding decodes to an old release and is refused.
    let old = NcclVersion::from_code(2804).unwrap();
    assert!(check_version(old, "x").is_err());
}

#[test]
fn default_deadlines() {
    let o = NcclOptions::default();
    assert_eq!(o.init_timeout.as_secs(), 120);
    assert_eq!(o.collective_timeout.as_secs(), 300);
}
