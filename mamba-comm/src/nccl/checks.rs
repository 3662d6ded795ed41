//! Argument checks made before any NCCL call, so a caller's mistake is a
//! [`CommError::Config`] that names it and leaves the communicator usable.

use std::ops::Range;

use crate::{CommError, Result};

/// `range` lies inside a buffer of `len` elements.
pub(crate) fn range(op: &str, range: &Range<usize>, len: usize) -> Result<()> {
    if range.start > range.end || range.end > len {
        return Err(CommError::config(format!(
            "{op}: element range {}..{} is not inside the buffer of {len} elements; expected \
             start <= end <= {len}",
            range.start, range.end
        )));
    }
    Ok(())
}

/// `offset..offset + n` as a range inside `len`, without overflow.
pub(crate) fn span(op: &str, offset: usize, n: usize, len: usize) -> Result<Range<usize>> {
    let end = offset.checked_add(n).ok_or_else(|| {
        CommError::config(format!("{op}: offset {offset} + {n} elements overflows"))
    })?;
    let r = offset..end;
    range(op, &r, len)?;
    Ok(r)
}

/// `peer` is another rank of the world.
pub(crate) fn peer(op: &str, peer: usize, rank: usize, world: usize) -> Result<()> {
    if peer >= world {
        return Err(CommError::config(format!(
            "{op}: peer {peer} is not a rank of this world of {world}; expected 0..{world}"
        )));
    }
    if peer == rank {
        return Err(CommError::config(format!(
            "{op}: peer {peer} is this rank; point-to-point needs another rank (copy locally instead)"
        )));
    }
    Ok(())
}

/// `root` is a rank of the world.
pub(crate) fn root(op: &str, root: usize, world: usize) -> Result<()> {
    if root >= world {
        return Err(CommError::config(format!(
            "{op}: root {root} is not a rank of this world of {world}; expected 0..{world}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn peers() {
        assert!(peer("send", 1, 0, 2).is_ok());
        let e = peer("send", 0, 0, 2).unwrap_err().to_string();
        assert!(e.contains("is this rank"), "{e}");
        let e = peer("recv", 2, 0, 2).unwrap_err().to_string();
        assert!(e.contains("not a rank") && e.contains("0..2"), "{e}");
        assert!(root("broadcast", 1, 2).is_ok());
        assert!(root("broadcast", 2, 2).is_err());
    }

    #[test]
    fn span_overflow_is_an_error() {
        let e = span("upload", usize::MAX, 2, 10).unwrap_err().to_string();
        assert!(e.contains("overflows"), "{e}");
    }

    proptest! {
        #[test]
        fn range_accepts_exactly_the_ranges_inside(start in 0usize..40, end in 0usize..40, len in 0usize..32) {
            let ok = range("op", &(start..end), len).is_ok();
            prop_assert_eq!(ok, start <= end && end <= len);
        }
    }
}
