//! NCCL version codes.

use std::fmt;

/// An NCCL release, as reported by `ncclGetVersion`.
///
/// Ordering is by (major, minor, patch). [`NcclVersion::code`] is the
/// encoding `major*10000 + minor*100 + patch` that the project states floors
/// in (2.26.0 is 22600); NCCL itself used `major*1000 + minor*100 + patch`
/// before 2.9, which [`NcclVersion::from_code`] also decodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct NcclVersion {
    /// Major release.
    pub major: u32,
    /// Minor release (0..=99).
    pub minor: u32,
    /// Patch level (0..=99).
    pub patch: u32,
}

impl NcclVersion {
    /// The version `major.minor.patch`.
    pub const fn new(major: u32, minor: u32, patch: u32) -> Self {
        NcclVersion {
            major,
            minor,
            patch,
        }
    }

    /// Decode a code from `ncclGetVersion`; `None` for a negative code.
    pub fn from_code(code: i32) -> Option<Self> {
        let code = u32::try_from(code).ok()?;
        if code >= 10000 {
            Some(Self::new(code / 10000, (code % 10000) / 100, code % 100))
        } else {
            // Before 2.9: X*1000 + Y*100 + Z.
            Some(Self::new(code / 1000, (code % 1000) / 100, code % 100))
        }
    }

    /// `major*10000 + minor*100 + patch`.
    pub const fn code(self) -> u32 {
        self.major * 10000 + self.minor * 100 + self.patch
    }
}

impl fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_both_encodings() {
        assert_eq!(
            NcclVersion::from_code(22803),
            Some(NcclVersion::new(2, 28, 3))
        );
        assert_eq!(
            NcclVersion::from_code(22600),
            Some(NcclVersion::new(2, 26, 0))
        );
        assert_eq!(
            NcclVersion::from_code(2804),
            Some(NcclVersion::new(2, 8, 4))
        );
        assert_eq!(NcclVersion::from_code(-1), None);
        assert_eq!(NcclVersion::new(2, 26, 0).code(), 22600);
    }

    #[test]
    fn orders_by_release() {
        assert!(NcclVersion::new(2, 8, 4) < NcclVersion::new(2, 26, 0));
        assert!(NcclVersion::new(2, 25, 99) < NcclVersion::new(2, 26, 0));
        assert!(NcclVersion::new(3, 0, 0) > NcclVersion::new(2, 99, 99));
    }

    #[test]
    fn header_version_matches_its_code() {
        let v = NcclVersion::new(crate::NCCL_MAJOR, crate::NCCL_MINOR, crate::NCCL_PATCH);
        assert_eq!(v.code(), crate::NCCL_VERSION_CODE);
        let code = i32::try_from(crate::NCCL_VERSION_CODE).unwrap();
        assert_eq!(NcclVersion::from_code(code), Some(v));
    }
}
