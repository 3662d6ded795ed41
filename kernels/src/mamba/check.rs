//! Host-side argument checks shared by the Mamba launchers: every index a
//! kernel touches is proven in bounds here, before the launch, so a shape
//! mistake is a [`KernelError::InvalidArgument`] naming the buffer instead of
//! a device fault (or silent corruption) later.

use cudarc::driver::LaunchConfig;

use crate::error::KernelError;

/// Largest grid y/z dimension CUDA allows.
pub(crate) const MAX_GRID_YZ: usize = 65_535;
/// Largest grid x dimension CUDA allows.
pub(crate) const MAX_GRID_X: usize = i32::MAX as usize;

/// Elements a row-major block of `rows` rows of `width` columns spans when
/// rows are `ld` apart: `(rows - 1) * ld + width` (0 for no rows).
pub(crate) fn span(rows: usize, ld: usize, width: usize) -> Option<usize> {
    if rows == 0 || width == 0 {
        return Some(0);
    }
    (rows - 1).checked_mul(ld)?.checked_add(width)
}

/// `buf` (with `have` elements) must hold a `[rows, width]` block with
/// leading dimension `ld >= width`.
pub(crate) fn matrix(
    kernel: &'static str,
    what: &str,
    have: usize,
    rows: usize,
    width: usize,
    ld: usize,
) -> Result<(), KernelError> {
    if ld < width {
        return Err(KernelError::invalid(
            kernel,
            format!(
                "{what}: leading dimension {ld} is below its width {width}; rows would overlap"
            ),
        ));
    }
    let need = span(rows, ld, width).ok_or_else(|| {
        KernelError::invalid(
            kernel,
            format!("{what}: {rows} rows x ld {ld} overflows usize"),
        )
    })?;
    if have < need {
        return Err(KernelError::invalid(
            kernel,
            format!(
                "{what} has {have} elements; a [{rows}, {width}] block with leading dimension \
                 {ld} needs {need}"
            ),
        ));
    }
    Ok(())
}

/// `buf` (with `have` elements) must hold at least `need` elements.
pub(crate) fn len(
    kernel: &'static str,
    what: &str,
    have: usize,
    need: usize,
) -> Result<(), KernelError> {
    if have < need {
        return Err(KernelError::invalid(
            kernel,
            format!("{what} has {have} elements, needs {need}"),
        ));
    }
    Ok(())
}

/// `a * b` or an error naming the product.
pub(crate) fn mul(
    kernel: &'static str,
    what: &str,
    a: usize,
    b: usize,
) -> Result<usize, KernelError> {
    a.checked_mul(b)
        .ok_or_else(|| KernelError::invalid(kernel, format!("{what}: {a} x {b} overflows usize")))
}

/// `v` as a C `int`.
pub(crate) fn int(kernel: &'static str, what: &str, v: usize) -> Result<i32, KernelError> {
    i32::try_from(v).map_err(|_| {
        KernelError::invalid(
            kernel,
            format!("{what} = {v} does not fit the kernel's 32-bit int"),
        )
    })
}

/// `v` as a C `long long`.
pub(crate) fn long(kernel: &'static str, what: &str, v: usize) -> Result<i64, KernelError> {
    i64::try_from(v).map_err(|_| {
        KernelError::invalid(
            kernel,
            format!("{what} = {v} does not fit the kernel's 64-bit index"),
        )
    })
}

/// A launch configuration with `block` threads and the given grid, checked
/// against CUDA's grid limits (x below 2^31, y and z at most 65535, none 0).
pub(crate) fn grid(
    kernel: &'static str,
    (x, y, z): (usize, usize, usize),
    block: u32,
) -> Result<LaunchConfig, KernelError> {
    if x == 0 || y == 0 || z == 0 {
        return Err(KernelError::invalid(
            kernel,
            format!("empty grid ({x}, {y}, {z})"),
        ));
    }
    if x > MAX_GRID_X || y > MAX_GRID_YZ || z > MAX_GRID_YZ {
        return Err(KernelError::invalid(
            kernel,
            format!(
                "grid ({x}, {y}, {z}) exceeds CUDA's limits ({MAX_GRID_X}, {MAX_GRID_YZ}, \
                 {MAX_GRID_YZ}); the problem is too large for one launch"
            ),
        ));
    }
    Ok(LaunchConfig {
        grid_dim: (x as u32, y as u32, z as u32),
        block_dim: (block, 1, 1),
        shared_mem_bytes: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn span_counts_the_last_row_only_to_its_width() {
        assert_eq!(span(0, 10, 3), Some(0));
        assert_eq!(span(1, 10, 3), Some(3));
        assert_eq!(span(4, 10, 3), Some(33));
        assert_eq!(span(usize::MAX, 2, 1), None);
    }

    #[test]
    fn matrix_checks_name_the_buffer_and_the_need() {
        assert!(matrix("k", "x", 33, 4, 3, 10).is_ok());
        let e = matrix("k", "x", 32, 4, 3, 10).unwrap_err().to_string();
        assert!(
            e.contains("x has 32 elements") && e.contains("needs 33"),
            "{e}"
        );
        let e = matrix("k", "z", 100, 4, 5, 4).unwrap_err().to_string();
        assert!(
            e.contains("leading dimension 4 is below its width 5"),
            "{e}"
        );
    }

    #[test]
    fn grid_limits_are_enforced() {
        assert!(grid("k", (1, 1, 1), 128).is_ok());
        assert!(grid("k", (MAX_GRID_X, MAX_GRID_YZ, MAX_GRID_YZ), 128).is_ok());
        assert!(grid("k", (0, 1, 1), 128).is_err());
        assert!(grid("k", (1, MAX_GRID_YZ + 1, 1), 128).is_err());
        assert!(grid("k", (1, 1, MAX_GRID_YZ + 1), 128).is_err());
        assert!(int("k", "n", 1 << 31).is_err());
        assert_eq!(int("k", "n", 7).unwrap(), 7);
    }
}
