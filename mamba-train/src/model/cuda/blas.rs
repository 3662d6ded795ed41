//! cuBLAS with one fixed, deterministic configuration, and a row-major GEMM.
//!
//! cuBLAS gives the same bits run to run on the same GPU model and library
//! version when the handle's configuration does not change between runs. So
//! the handle is pinned once, at creation:
//! - math mode `CUBLAS_DEFAULT_MATH`: plain f32 FMA arithmetic. TF32 tensor
//!   cores are opt-in (`CUBLAS_TF32_TENSOR_OP_MATH`) and never requested, and
//!   the mode is read back to prove it took;
//! - atomics `CUBLAS_ATOMICS_NOT_ALLOWED`: no routine may pick an
//!   atomics-based (order-varying) reduction;
//! - a workspace of fixed size ([`WORKSPACE_BYTES`]) owned by the handle's
//!   owner, so the algorithm heuristics see the same workspace every run (and
//!   cuBLAS never allocates its own per stream);
//! - one stream: the model's, set once and never changed.
//!
//! The library is opened at run time. When it is not on the loader's path
//! (the GPU machines keep it in `/usr/local/cuda/lib64`, outside the loader
//! cache) [`ensure_cublas`] opens it from `$CUDA_HOME/lib64`,
//! `$CUDA_PATH/lib64` or `/usr/local/cuda/lib64` first, so that cudarc's
//! later lookup by soname finds the loaded copy instead of panicking.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtrMut};

use crate::error::{Result, TrainError};

/// Bytes of the cuBLAS workspace (fixed: part of the configuration).
pub const WORKSPACE_BYTES: usize = 32 << 20;

fn cuda_err(what: impl Into<String>, detail: impl std::fmt::Display) -> TrainError {
    TrainError::Cuda {
        what: what.into(),
        detail: detail.to_string(),
    }
}

/// Libraries opened by absolute path, kept loaded for the life of the
/// process (cudarc resolves its symbols from them by soname).
static PRELOADED: Mutex<Vec<libloading::Library>> = Mutex::new(Vec::new());
static CUBLAS_STATE: OnceLock<std::result::Result<(), String>> = OnceLock::new();

/// Make sure cudarc can open libcublas: on the default search path, or
/// preloaded from a CUDA toolkit directory. Errors name every place looked
/// at and the variable to set.
pub fn ensure_cublas() -> Result<()> {
    CUBLAS_STATE
        .get_or_init(|| {
            // SAFETY: only dlopens libcublas by its usual names and drops
            // the handles; no symbol is called.
            if unsafe { sys::is_culib_present() } {
                return Ok(());
            }
            let mut dirs: Vec<PathBuf> = Vec::new();
            for var in ["CUDA_HOME", "CUDA_PATH"] {
                if let Some(v) = std::env::var_os(var).filter(|v| !v.is_empty()) {
                    dirs.push(PathBuf::from(v).join("lib64"));
                }
            }
            dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
            for dir in &dirs {
                let lt = dir.join("libcublasLt.so.13");
                let blas = dir.join("libcublas.so.13");
                if !blas.is_file() {
                    continue;
                }
                // SAFETY: loading NVIDIA's cuBLAS runs only its initialisers.
                let opened = unsafe {
                    let lt = libloading::Library::new(&lt);
                    libloading::Library::new(&blas).map(|b| (lt.ok(), b))
                };
                if let Ok((lt, b)) = opened {
                    let mut keep = PRELOADED.lock().unwrap_or_else(|p| p.into_inner());
                    keep.extend(lt);
                    keep.push(b);
                    drop(keep);
                    // SAFETY: as above.
                    if unsafe { sys::is_culib_present() } {
                        return Ok(());
                    }
                }
            }
            Err(format!(
                "libcublas (CUDA 13) was not found on the loader path nor in {}; add the CUDA \
                 toolkit's lib64 directory to LD_LIBRARY_PATH or set CUDA_HOME",
                dirs.iter()
                    .map(|d| d.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })
        .clone()
        .map_err(|detail| cuda_err("opening cuBLAS", detail))
}

/// A cuBLAS handle pinned to one stream, one math mode and one workspace.
///
/// Owns the workspace; the handle is destroyed (by cudarc) before the
/// workspace is freed because fields drop in declaration order.
pub struct Blas {
    handle: CudaBlas,
    _workspace: CudaSlice<u8>,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas")
            .field("workspace_bytes", &WORKSPACE_BYTES)
            .finish()
    }
}

/// One operand of [`Blas::gemm`]: a row-major matrix view, its leading
/// dimension, and whether it enters transposed.
pub struct Operand<'a, 'b> {
    pub data: &'a CudaView<'b, f32>,
    pub ld: usize,
    pub trans: bool,
}

impl Blas {
    /// A handle on `stream` with the fixed configuration of the module docs.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Blas> {
        ensure_cublas()?;
        let handle =
            CudaBlas::new(stream.clone()).map_err(|e| cuda_err("creating a cuBLAS handle", e))?;
        let mut workspace = stream
            .alloc_zeros::<u8>(WORKSPACE_BYTES)
            .map_err(|e| cuda_err("allocating the cuBLAS workspace", e))?;
        let h = *handle.handle();
        {
            let (ptr, _sync) = workspace.device_ptr_mut(stream);
            // SAFETY: `h` is a live handle; the workspace outlives it (field
            // order in Blas) and is used by no one else.
            unsafe {
                sys::cublasSetWorkspace_v2(h, ptr as *mut std::ffi::c_void, WORKSPACE_BYTES)
                    .result()
                    .map_err(|e| cuda_err("setting the cuBLAS workspace", format!("{e:?}")))?;
                sys::cublasSetMathMode(h, sys::cublasMath_t::CUBLAS_DEFAULT_MATH)
                    .result()
                    .map_err(|e| cuda_err("setting the cuBLAS math mode", format!("{e:?}")))?;
                sys::cublasSetAtomicsMode(h, sys::cublasAtomicsMode_t::CUBLAS_ATOMICS_NOT_ALLOWED)
                    .result()
                    .map_err(|e| cuda_err("forbidding cuBLAS atomics", format!("{e:?}")))?;
                let mut mode = std::mem::MaybeUninit::<sys::cublasMath_t>::uninit();
                sys::cublasGetMathMode(h, mode.as_mut_ptr())
                    .result()
                    .map_err(|e| cuda_err("reading the cuBLAS math mode back", format!("{e:?}")))?;
                let mode = mode.assume_init();
                if mode != sys::cublasMath_t::CUBLAS_DEFAULT_MATH {
                    return Err(cuda_err(
                        "pinning the cuBLAS math mode",
                        format!("asked for CUBLAS_DEFAULT_MATH (plain f32), the handle reports {mode:?}"),
                    ));
                }
            }
        }
        Ok(Blas {
            handle,
            _workspace: workspace,
        })
    }

    /// Row-major `C[m, n] = op(A) op(B) + beta C`, with `op(A)` `[m, k]`
    /// and `op(B)` `[k, n]`; `A` is stored `[m, k]` (or `[k, m]` when
    /// transposed), `B` `[k, n]` (or `[n, k]`), each with its leading
    /// dimension. Bounds are checked before the call. Computed as the
    /// column-major product `C^T = op(B)^T op(A)^T`, which needs no copy.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm(
        &self,
        what: &str,
        m: usize,
        n: usize,
        k: usize,
        a: Operand<'_, '_>,
        b: Operand<'_, '_>,
        beta: f32,
        c: &mut CudaViewMut<'_, f32>,
        ldc: usize,
    ) -> Result<()> {
        let (a_rows, a_cols) = if a.trans { (k, m) } else { (m, k) };
        let (b_rows, b_cols) = if b.trans { (n, k) } else { (k, n) };
        check(what, "A", a.data.len(), a_rows, a_cols, a.ld)?;
        check(what, "B", b.data.len(), b_rows, b_cols, b.ld)?;
        check(what, "C", c.len(), m, n, ldc)?;
        if m == 0 || n == 0 {
            return Ok(());
        }
        let int = |v: usize, name: &str| {
            i32::try_from(v).map_err(|_| {
                TrainError::Config(format!(
                    "GEMM {what}: {name} = {v} exceeds cuBLAS's 32-bit int"
                ))
            })
        };
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let cfg = GemmConfig {
            transa: op(b.trans),
            transb: op(a.trans),
            m: int(n, "n")?,
            n: int(m, "m")?,
            k: int(k, "k")?,
            alpha: 1.0f32,
            lda: int(b.ld.max(1), "ldb")?,
            ldb: int(a.ld.max(1), "lda")?,
            beta,
            ldc: int(ldc.max(1), "ldc")?,
        };
        // SAFETY: the three extents were checked against the views above, so
        // cuBLAS reads and writes inside them; C is borrowed mutably and so
        // does not alias A or B.
        unsafe { self.handle.gemm(cfg, b.data, a.data, c) }.map_err(|e| {
            cuda_err(
                format!("running the GEMM {what} ({m}x{n}x{k})"),
                format!("{e:?}"),
            )
        })
    }
}

fn check(what: &str, name: &str, have: usize, rows: usize, cols: usize, ld: usize) -> Result<()> {
    if ld < cols {
        return Err(TrainError::Config(format!(
            "GEMM {what}: {name} is [{rows}, {cols}] but its leading dimension is {ld}"
        )));
    }
    let need = if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    };
    if have < need {
        return Err(TrainError::Config(format!(
            "GEMM {what}: {name} ([{rows}, {cols}], leading dimension {ld}) needs {need} elements, \
             the buffer has {have}"
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extents_are_checked_with_their_leading_dimension() {
        assert!(check("g", "A", 33, 4, 3, 10).is_ok());
        let e = check("g", "A", 32, 4, 3, 10).unwrap_err().to_string();
        assert!(e.contains("needs 33") && e.contains("has 32"), "{e}");
        assert!(check("g", "A", 100, 4, 5, 4)
            .unwrap_err()
            .to_string()
            .contains("leading dimension is 4"));
        assert!(check("g", "A", 0, 0, 5, 5).is_ok());
    }
}
