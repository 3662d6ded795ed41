//! The one launcher every Mamba op goes through. An op describes its launch
//! as data (a [`Launch`]: kernel name, function, grid rule, block size, and
//! the argument list as [`Arg`]s in the kernel's parameter order); the
//! launcher checks the grid, converts the size arguments to the kernel's C
//! integer types (refusing ones that do not fit), pushes the arguments and
//! enqueues the kernel, mapping a driver failure to an error naming it.

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, CudaView, CudaViewMut, LaunchArgs, LaunchConfig,
    PushKernelArg,
};

use super::check::{self, grid};
use super::MambaKernels;
use crate::error::KernelError;

/// Threads per block of the row/element kernels.
pub(crate) const THREADS: u32 = 128;

/// Rows one thread of the row-group kernels takes (`kRowsPerThread` in
/// `mamba_ops.cu`; the two must agree): their per-row work is a few flops,
/// so with one row a thread the time went to block scheduling and index
/// arithmetic (the conv forward at ~3x its bytes' time, ncu 2026-12-02).
pub(crate) const ROWS_PER_THREAD: usize = 8;

/// How a launch's grid is derived from the problem (every block has
/// `block` threads; `grid_dim` is checked against CUDA's limits).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Grid {
    /// Grid `(rows, ceil(cols / block), 1)`: one block row per row, the
    /// columns across blocks of `block` threads.
    RowsByCols { rows: usize, cols: usize },
    /// Grid `(ceil(rows / ROWS_PER_THREAD), ceil(cols / block), 1)`: each
    /// thread takes one column of [`ROWS_PER_THREAD`] consecutive rows.
    RowGroupsByCols { rows: usize, cols: usize },
    /// Grid `(ceil(n / block), 1, 1)`: one thread per item.
    Flat { n: usize },
    /// The grid as given.
    Dims(usize, usize, usize),
    /// A configuration already checked (the scan computes its grids once
    /// for several launches).
    Checked(LaunchConfig),
}

/// One kernel launch, described as data.
pub(crate) struct Launch<'f> {
    /// The kernel's symbol (named in every error).
    pub kernel: &'static str,
    pub func: &'f CudaFunction,
    pub grid: Grid,
    /// Threads per block (ignored for [`Grid::Checked`]).
    pub block: u32,
}

/// A device buffer the kernel only reads.
pub(crate) trait ReadArg {
    fn push_read<'s>(&'s self, b: &mut LaunchArgs<'s>);
}

/// A device buffer the kernel writes.
pub(crate) trait WriteArg {
    fn push_write<'s>(&'s mut self, b: &mut LaunchArgs<'s>);
}

impl<T> ReadArg for CudaView<'_, T> {
    fn push_read<'s>(&'s self, b: &mut LaunchArgs<'s>) {
        b.arg(self);
    }
}

impl<T> ReadArg for CudaSlice<T> {
    fn push_read<'s>(&'s self, b: &mut LaunchArgs<'s>) {
        b.arg(self);
    }
}

impl<T> WriteArg for CudaViewMut<'_, T> {
    fn push_write<'s>(&'s mut self, b: &mut LaunchArgs<'s>) {
        b.arg(self);
    }
}

/// The value pushed for [`Arg::Null`]: a device pointer of 0.
static NULL_POINTER: u64 = 0;

/// One kernel argument, in the kernel's parameter order.
pub(crate) enum Arg<'a> {
    /// `const T*`: pushed as a shared borrow (cudarc records a read).
    In(&'a dyn ReadArg),
    /// `T*`: pushed as a mutable borrow (cudarc records a write).
    Out(&'a mut dyn WriteArg),
    /// A null `T*`: an optional output the kernel skips (it checks for null).
    Null,
    /// A size passed as C `int`, named in the error if it does not fit.
    Int(&'static str, usize),
    /// A size passed as C `long long`, named in the error if it does not fit.
    Long(&'static str, usize),
    I32(i32),
    I64(i64),
    U64(u64),
    F32(f32),
}

impl MambaKernels {
    /// Check `launch`'s grid, convert its size arguments (in order) and
    /// enqueue it on `stream`.
    ///
    /// # Safety
    /// `args` must match the kernel's parameter list in order and type, and
    /// every index the kernel touches for this grid must lie inside the
    /// buffers (the caller's checks prove it; each call site says how).
    pub(crate) unsafe fn launch(
        &self,
        stream: &CudaStream,
        launch: Launch<'_>,
        args: &mut [Arg<'_>],
    ) -> Result<(), KernelError> {
        let Launch {
            kernel,
            func,
            grid: rule,
            block,
        } = launch;
        let cfg = match rule {
            Grid::RowsByCols { rows, cols } => {
                grid(kernel, (rows, cols.div_ceil(block as usize), 1), block)?
            }
            Grid::RowGroupsByCols { rows, cols } => grid(
                kernel,
                (
                    rows.div_ceil(ROWS_PER_THREAD),
                    cols.div_ceil(block as usize),
                    1,
                ),
                block,
            )?,
            Grid::Flat { n } => grid(kernel, (n.div_ceil(block as usize), 1, 1), block)?,
            Grid::Dims(x, y, z) => grid(kernel, (x, y, z), block)?,
            Grid::Checked(cfg) => cfg,
        };
        // Sizes to C integers first, in argument order, so a size that does
        // not fit is refused before anything is pushed.
        for a in args.iter_mut() {
            match *a {
                Arg::Int(what, v) => *a = Arg::I32(check::int(kernel, what, v)?),
                Arg::Long(what, v) => *a = Arg::I64(check::long(kernel, what, v)?),
                _ => {}
            }
        }
        let mut b = stream.launch_builder(func);
        for a in args.iter_mut() {
            match a {
                Arg::In(r) => r.push_read(&mut b),
                Arg::Out(w) => w.push_write(&mut b),
                Arg::I32(v) => {
                    b.arg(&*v);
                }
                Arg::I64(v) => {
                    b.arg(&*v);
                }
                Arg::U64(v) => {
                    b.arg(&*v);
                }
                Arg::Null => {
                    b.arg(&NULL_POINTER);
                }
                Arg::F32(v) => {
                    b.arg(&*v);
                }
                Arg::Int(..) | Arg::Long(..) => unreachable!("sizes were converted above"),
            }
        }
        // SAFETY: the caller's contract (see above).
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| KernelError::driver(format!("launching {kernel}"), e))
    }
}
