//! The ABI facts the rest of the project relies on, pinned against the
//! committed bindings. If a regenerated header changes one of these, the
//! change is deliberate and every caller must be reviewed.

use std::mem::{align_of, offset_of, size_of};

use nccl_sys_min::*;

#[test]
fn unique_id_is_128_opaque_bytes() {
    assert_eq!(NCCL_UNIQUE_ID_BYTES, 128);
    assert_eq!(size_of::<ncclUniqueId>(), 128);
    assert_eq!(align_of::<ncclUniqueId>(), 1);
}

#[test]
fn result_codes() {
    let codes = [
        (ncclResult_t::ncclSuccess, 0),
        (ncclResult_t::ncclUnhandledCudaError, 1),
        (ncclResult_t::ncclSystemError, 2),
        (ncclResult_t::ncclInternalError, 3),
        (ncclResult_t::ncclInvalidArgument, 4),
        (ncclResult_t::ncclInvalidUsage, 5),
        (ncclResult_t::ncclRemoteError, 6),
        (ncclResult_t::ncclInProgress, 7),
    ];
    for (code, value) in codes {
        assert_eq!(code.0, value, "{code:?}");
        assert!(result_name(code).is_some());
    }
    assert_eq!(result_name(ncclResult_t(8)), None);
    assert_eq!(result_name(ncclResult_t(99)), None);
    // A C enum: 4 bytes, returned in a register.
    assert_eq!(size_of::<ncclResult_t>(), 4);
}

#[test]
fn datatype_and_op_codes() {
    assert_eq!(ncclDataType_t::ncclInt8.0, 0);
    assert_eq!(ncclDataType_t::ncclUint8.0, 1);
    assert_eq!(ncclDataType_t::ncclInt32.0, 2);
    assert_eq!(ncclDataType_t::ncclInt.0, 2);
    assert_eq!(ncclDataType_t::ncclFloat16.0, 6);
    assert_eq!(ncclDataType_t::ncclFloat32.0, 7);
    assert_eq!(ncclDataType_t::ncclFloat.0, 7);
    assert_eq!(ncclDataType_t::ncclFloat64.0, 8);
    assert_eq!(ncclDataType_t::ncclBfloat16.0, 9);
    assert_eq!(size_of::<ncclDataType_t>(), 4);
    assert_eq!(ncclRedOp_t::ncclSum.0, 0);
    assert_eq!(ncclRedOp_t::ncclProd.0, 1);
    assert_eq!(ncclRedOp_t::ncclMax.0, 2);
    assert_eq!(ncclRedOp_t::ncclMin.0, 3);
    assert_eq!(size_of::<ncclRedOp_t>(), 4);
}

#[test]
fn config_layout() {
    assert_eq!(size_of::<ncclConfig_t>(), 80);
    assert_eq!(align_of::<ncclConfig_t>(), 8);
    assert_eq!(offset_of!(ncclConfig_t, size), 0);
    assert_eq!(offset_of!(ncclConfig_t, magic), 8);
    assert_eq!(offset_of!(ncclConfig_t, version), 12);
    assert_eq!(offset_of!(ncclConfig_t, blocking), 16);
    assert_eq!(offset_of!(ncclConfig_t, netName), 32);
    assert_eq!(offset_of!(ncclConfig_t, commName), 48);
    assert_eq!(offset_of!(ncclConfig_t, nvlinkCentricSched), 76);
}

#[test]
fn config_initializer_matches_the_header_macro() {
    let c = ncclConfig_t::initializer();
    assert_eq!(c.size, size_of::<ncclConfig_t>());
    assert_eq!(c.magic, 0xcafe_beef);
    assert_eq!(NCCL_CONFIG_MAGIC, 0xcafe_beef);
    // NCCL_VERSION(2, 28, 3) of the header the bindings came from.
    assert_eq!(c.version, 22803);
    assert_eq!(c.version, NCCL_VERSION_CODE);
    assert_eq!(NCCL_CONFIG_UNDEF_INT, i32::MIN);
    for (name, v) in [
        ("blocking", c.blocking),
        ("cgaClusterSize", c.cgaClusterSize),
        ("minCTAs", c.minCTAs),
        ("maxCTAs", c.maxCTAs),
        ("splitShare", c.splitShare),
        ("trafficClass", c.trafficClass),
        ("collnetEnable", c.collnetEnable),
        ("CTAPolicy", c.CTAPolicy),
        ("shrinkShare", c.shrinkShare),
        ("nvlsCTAs", c.nvlsCTAs),
        ("nChannelsPerNetPeer", c.nChannelsPerNetPeer),
        ("nvlinkCentricSched", c.nvlinkCentricSched),
    ] {
        assert_eq!(v, NCCL_CONFIG_UNDEF_INT, "{name}");
    }
    assert!(c.netName.is_null());
    assert!(c.commName.is_null());
}

#[test]
fn version_macro_encodings() {
    assert_eq!(nccl_version_code(2, 28, 3), 22803);
    assert_eq!(nccl_version_code(2, 26, 0), 22600);
    // The pre-2.9 encoding NCCL_VERSION keeps for old releases.
    assert_eq!(nccl_version_code(2, 8, 4), 2804);
}

#[test]
fn stream_and_comm_are_pointers() {
    assert_eq!(size_of::<cudaStream_t>(), size_of::<usize>());
    assert_eq!(size_of::<ncclComm_t>(), size_of::<usize>());
}
