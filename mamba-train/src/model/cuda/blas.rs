//! cuBLAS with one fixed, deterministic configuration, and a row-major GEMM
//! in one of three precisions ([`Precision`]).
//!
//! cuBLAS gives the same bits run to run on the same GPU model and library
//! version when the handle's configuration does not change between runs. So
//! the handle is pinned once, at creation:
//! - math mode `CUBLAS_DEFAULT_MATH`: no tensor-core opt-in on the handle
//!   (`CUBLAS_TF32_TENSOR_OP_MATH` is never set), and the mode is read back
//!   to prove it took. The precision is chosen per call instead, and is the
//!   handle owner's for its whole life:
//!   - `f32`: `cublasSgemm`, plain f32 FMA arithmetic (the reference);
//!   - `tf32`: cuBLASLt (below) on f32 data with compute type
//!     `CUBLAS_COMPUTE_32F_FAST_TF32` (tensor cores, inputs rounded to TF32,
//!     f32 accumulation and output);
//!   - `bf16`: cuBLASLt with bf16 A and B (`CUDA_R_16BF`), f32 C (or
//!     bf16 C where the caller keeps the product in bf16 alone,
//!     [`GemmOut::Bf16`]) and compute type `CUBLAS_COMPUTE_32F` (f32
//!     accumulation). An
//!     operand is cast to bf16 (round to nearest even, the `mamba_cast_bf16`
//!     kernel) before the call unless the caller passes its bf16 copy
//!     ([`Elems::F32AndBf16`]: the weights, cast once per pass, and the
//!     activations the model casts once for every GEMM that reads them) or
//!     holds the operand in bf16 only ([`Elems::Bf16`]).
//!
//!   The tf32 and bf16 GEMMs run through cuBLASLt (`blas_lt.rs`):
//!   one algorithm per problem (shape, transposes, leading dimensions,
//!   types, the operands' alignment class), cuBLASLt's heuristic's first
//!   candidate for it with the fixed workspace, chosen at the problem's
//!   first call, recorded ([`Blas::algorithms`]) and never chosen again, so
//!   the same call runs the same kernel every run. A problem cuBLASLt has no
//!   algorithm for runs `cublasGemmEx` with `CUBLAS_GEMM_DEFAULT` (cuBLAS's
//!   own heuristic, again a function of the problem only);
//! - atomics `CUBLAS_ATOMICS_NOT_ALLOWED` on the cuBLAS handle: no routine
//!   may pick an atomics-based (order-varying) reduction, so no split-K
//!   with atomics (cuBLASLt's split-K algorithms reduce in a workspace, in
//!   a fixed order, their reduction scheme part of the recorded algorithm);
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
//!
//! Over 450 lines: the handle's fixed configuration and the GEMM in its
//! three precisions (Sgemm, GemmEx TF32, GemmEx bf16 with the operand
//! casts) are one unsafe boundary; keeping it in one file keeps every
//! cuBLAS call and its SAFETY argument side by side.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::cublas::{sys, CudaBlas, Gemm, GemmConfig};
use cudarc::driver::{CudaSlice, CudaStream, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};
use kernels::mamba::MambaKernels;

use super::blas_lt::{LtGemms, Problem};
use crate::config::Precision;
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
    precision: Precision,
    stream: Arc<CudaStream>,
    /// The cast kernel of [`Precision::Bf16`] (absent in the others).
    kernels: Option<MambaKernels>,
    /// bf16 copies of the A and B operands a bf16 GEMM casts itself
    /// (grow-only; one stream orders every use, so one pair serves all).
    scratch: Mutex<[Option<CudaSlice<u16>>; 2]>,
    /// The tf32 and bf16 GEMMs' cuBLASLt plans (absent in f32), which
    /// share the workspace with the handle (one stream orders every use).
    lt: Option<LtGemms>,
    workspace: CudaSlice<u8>,
}

impl std::fmt::Debug for Blas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blas")
            .field("precision", &self.precision)
            .field("workspace_bytes", &WORKSPACE_BYTES)
            .finish()
    }
}

/// Where the elements of a GEMM operand are held (views: cheap handles on
/// device memory borrowed for `'b`).
pub enum Elems<'b> {
    /// f32 only: a [`Precision::Bf16`] GEMM casts them itself (into its
    /// scratch, every call).
    F32(CudaView<'b, f32>),
    /// f32 with their bf16 copy (the same extents and leading dimension,
    /// rounded by `mamba_cast_bf16`): a bf16 GEMM reads the copy, the
    /// other precisions the f32 values.
    F32AndBf16(CudaView<'b, f32>, CudaView<'b, u16>),
    /// bf16 only (an activation stored in bf16): usable by a bf16 GEMM
    /// only; any other precision refuses it, as it has no f32 values.
    Bf16(CudaView<'b, u16>),
}

impl<'b> From<&CudaView<'b, f32>> for Elems<'b> {
    fn from(v: &CudaView<'b, f32>) -> Self {
        Elems::F32(v.slice(..))
    }
}

impl<'b> From<&CudaView<'b, u16>> for Elems<'b> {
    fn from(v: &CudaView<'b, u16>) -> Self {
        Elems::Bf16(v.slice(..))
    }
}

/// Where [`Blas::gemm_into`] writes `C` (a view: a cheap handle on device
/// memory borrowed mutably for `'b`).
pub enum GemmOut<'b> {
    /// f32 (every precision).
    F32(CudaViewMut<'b, f32>),
    /// bf16 only, cuBLAS rounding its f32 result once (a bf16 handle with
    /// `beta = 0`; the same kernel and so the same bits every run, as for
    /// any output type).
    Bf16(CudaViewMut<'b, u16>),
}

/// One operand of [`Blas::gemm`]: a row-major matrix, its leading
/// dimension, and whether it enters transposed.
pub struct Operand<'b> {
    pub elems: Elems<'b>,
    pub ld: usize,
    pub trans: bool,
}

impl<'b> Operand<'b> {
    /// This operand with `bf16`, the bf16 copy of its f32 elements, when
    /// there is one (see [`Elems::F32AndBf16`]); an operand already holding
    /// bf16 elements is returned as it is.
    pub fn with_bf16(self, bf16: Option<CudaView<'b, u16>>) -> Self {
        let elems = match (self.elems, bf16) {
            (Elems::F32(f), Some(h)) => Elems::F32AndBf16(f, h),
            (e, _) => e,
        };
        Operand { elems, ..self }
    }

    /// Elements held, for the extent check of a GEMM of `precision`: those
    /// of the copy that GEMM reads.
    fn len_for(&self, what: &str, name: &str, precision: Precision) -> Result<usize> {
        match (&self.elems, precision) {
            (Elems::F32(f), _) => Ok(f.len()),
            (Elems::F32AndBf16(_, h), Precision::Bf16) | (Elems::Bf16(h), Precision::Bf16) => {
                Ok(h.len())
            }
            (Elems::F32AndBf16(f, _), _) => Ok(f.len()),
            (Elems::Bf16(_), p) => Err(TrainError::Config(format!(
                "GEMM {what}: operand {name} is held in bf16 only; a {p} GEMM needs its f32 values"
            ))),
        }
    }

    /// The f32 elements (the f32 and tf32 GEMMs; `len_for` has already
    /// refused a bf16-only operand there).
    fn f32(&self, what: &str) -> Result<&CudaView<'b, f32>> {
        match &self.elems {
            Elems::F32(f) | Elems::F32AndBf16(f, _) => Ok(f),
            Elems::Bf16(_) => Err(cuda_err(format!("GEMM {what}"), "a bf16-only operand")),
        }
    }
}

impl Blas {
    /// An f32 handle on `stream` with the fixed configuration of the module
    /// docs.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Blas> {
        Self::with_precision(stream, Precision::F32, None)
    }

    /// A handle on `stream` whose GEMMs run in `precision`; `kernels` (of
    /// the stream's context) must be given for [`Precision::Bf16`], which
    /// casts operands with them.
    pub fn with_precision(
        stream: &Arc<CudaStream>,
        precision: Precision,
        kernels: Option<MambaKernels>,
    ) -> Result<Blas> {
        if precision == Precision::Bf16 && kernels.is_none() {
            return Err(cuda_err(
                "creating a bf16 cuBLAS handle",
                "the bf16 GEMMs need the cast kernel (MambaKernels) of the stream's context",
            ));
        }
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
            precision,
            stream: stream.clone(),
            kernels: kernels.filter(|_| precision == Precision::Bf16),
            scratch: Mutex::new([None, None]),
            lt: match precision {
                Precision::F32 => None,
                _ => Some(LtGemms::new().map_err(|e| cuda_err("creating a cuBLASLt handle", e))?),
            },
            workspace,
        })
    }

    /// Every tf32 / bf16 GEMM problem this handle has run and the cuBLASLt
    /// algorithm it was given at its first call (one line each, first-call
    /// order; empty in f32, which runs `cublasSgemm`).
    pub fn algorithms(&self) -> Vec<String> {
        self.lt.as_ref().map(LtGemms::chosen).unwrap_or_default()
    }

    /// The precision of every GEMM of this handle.
    pub fn precision(&self) -> Precision {
        self.precision
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
        a: Operand<'_>,
        b: Operand<'_>,
        beta: f32,
        c: &mut CudaViewMut<'_, f32>,
        ldc: usize,
    ) -> Result<()> {
        self.gemm_into(
            what,
            m,
            n,
            k,
            a,
            b,
            beta,
            GemmOut::F32(c.slice_mut(..)),
            ldc,
        )
    }

    /// [`Self::gemm`] with `C` f32 or, on a [`Precision::Bf16`] handle with
    /// `beta = 0`, bf16 ([`GemmOut::Bf16`]: an activation kept in bf16 made
    /// by a GEMM, without an f32 pass over memory in between).
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_into(
        &self,
        what: &str,
        m: usize,
        n: usize,
        k: usize,
        a: Operand<'_>,
        b: Operand<'_>,
        beta: f32,
        c: GemmOut<'_>,
        ldc: usize,
    ) -> Result<()> {
        let (a_rows, a_cols) = if a.trans { (k, m) } else { (m, k) };
        let (b_rows, b_cols) = if b.trans { (n, k) } else { (k, n) };
        let p = self.precision;
        check(what, "A", a.len_for(what, "A", p)?, a_rows, a_cols, a.ld)?;
        check(what, "B", b.len_for(what, "B", p)?, b_rows, b_cols, b.ld)?;
        let c_len = match &c {
            GemmOut::F32(c) => c.len(),
            GemmOut::Bf16(c) => {
                if p != Precision::Bf16 || beta != 0.0 {
                    return Err(TrainError::Config(format!(
                        "GEMM {what}: a bf16 output needs a bf16 GEMM with beta = 0 (this is \
                         a {p} GEMM with beta = {beta})"
                    )));
                }
                c.len()
            }
        };
        check(what, "C", c_len, m, n, ldc)?;
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
        let ran = match (self.precision, c) {
            // SAFETY (every arm): the three extents were checked against the
            // views each precision reads (len_for), so cuBLAS reads and
            // writes inside them; C is borrowed mutably and so does not
            // alias A or B.
            (Precision::F32 | Precision::Tf32, GemmOut::Bf16(_)) => {
                return Err(cuda_err(
                    format!("GEMM {what}"),
                    "a bf16 output (refused above)",
                ))
            }
            (Precision::F32, GemmOut::F32(mut c)) => {
                let (fa, fb) = (a.f32(what)?, b.f32(what)?);
                // SAFETY: as above.
                unsafe { self.handle.gemm(cfg, fb, fa, &mut c) }.map_err(|e| format!("{e:?}"))
            }
            (Precision::Tf32, GemmOut::F32(mut c)) => {
                let s = &self.stream;
                let (pa, _ra) = b.f32(what)?.device_ptr(s);
                let (pb, _rb) = a.f32(what)?.device_ptr(s);
                let (pc, _rc) = c.device_ptr_mut(s);
                // SAFETY: as for f32: f32 A, B and C with the checked extents.
                unsafe { self.lt_or_ex(&cfg, (pa, pb, pc), false, false) }
            }
            (Precision::Bf16, c) => {
                let mut scratch = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
                let [sa, sb] = &mut *scratch;
                let need_a = span(a_rows, a_cols, a.ld);
                let need_b = span(b_rows, b_cols, b.ld);
                let ha = self.bf16_of(what, "A", &a, need_a, sa)?;
                let hb = self.bf16_of(what, "B", &b, need_b, sb)?;
                let s = &self.stream;
                let (pa, _ra) = match hb {
                    Half::Given(v) => v.device_ptr(s),
                    Half::Scratch => sb_ptr(sb, s)?,
                };
                let (pb, _rb) = match ha {
                    Half::Given(v) => v.device_ptr(s),
                    Half::Scratch => sb_ptr(sa, s)?,
                };
                let (mut c32, mut c16);
                let ((pc, _rc), c_bf16) = match c {
                    GemmOut::F32(c) => {
                        c32 = c;
                        (c32.device_ptr_mut(s), false)
                    }
                    GemmOut::Bf16(c) => {
                        c16 = c;
                        (c16.device_ptr_mut(s), true)
                    }
                };
                // SAFETY: a given bf16 copy's extent was checked above, a
                // scratch copy holds the operand's whole span; C is bf16
                // when `c_bf16`, else f32, with its checked extent.
                unsafe { self.lt_or_ex(&cfg, (pa, pb, pc), true, c_bf16) }
            }
        };
        ran.map_err(|e| {
            cuda_err(
                format!("running the {} GEMM {what} ({m}x{n}x{k})", self.precision),
                e,
            )
        })
    }

    /// The column-major tf32 (`ab_bf16` false) or bf16 GEMM `cfg` through
    /// its recorded cuBLASLt algorithm (`blas_lt.rs`), or through
    /// `cublasGemmEx` where cuBLASLt has none for the problem.
    ///
    /// # Safety
    /// As [`gemm_ex`]: the pointers hold the extents `cfg` implies in their
    /// types (A and B bf16 when `ab_bf16`, else f32; C bf16 when `c_bf16`,
    /// else f32), on the handle's stream.
    unsafe fn lt_or_ex(
        &self,
        cfg: &GemmConfig<f32>,
        ptrs: (
            cudarc::driver::sys::CUdeviceptr,
            cudarc::driver::sys::CUdeviceptr,
            cudarc::driver::sys::CUdeviceptr,
        ),
        ab_bf16: bool,
        c_bf16: bool,
    ) -> std::result::Result<(), String> {
        if let Some(lt) = &self.lt {
            let problem = Problem {
                m: cfg.m,
                n: cfg.n,
                k: cfg.k,
                trans_a: cfg.transa == sys::cublasOperation_t::CUBLAS_OP_T,
                trans_b: cfg.transb == sys::cublasOperation_t::CUBLAS_OP_T,
                lda: cfg.lda,
                ldb: cfg.ldb,
                ldc: cfg.ldc,
                ab_bf16,
                c_bf16,
            };
            let s = &self.stream;
            let (ws, _rw) = self.workspace.device_ptr(s);
            // SAFETY: the caller's contract for the operands; the workspace
            // is this handle's, used only by its calls on this one stream.
            let ran = unsafe {
                lt.matmul(
                    &problem,
                    ptrs,
                    cfg.beta,
                    (ws, WORKSPACE_BYTES),
                    s.cu_stream(),
                )
            }?;
            if ran {
                return Ok(());
            }
        }
        let (ab, c_type, compute) = if ab_bf16 {
            let c = if c_bf16 {
                sys::cudaDataType_t::CUDA_R_16BF
            } else {
                sys::cudaDataType_t::CUDA_R_32F
            };
            (
                sys::cudaDataType_t::CUDA_R_16BF,
                c,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            )
        } else {
            (
                sys::cudaDataType_t::CUDA_R_32F,
                sys::cudaDataType_t::CUDA_R_32F,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            )
        };
        // SAFETY: the caller's contract.
        unsafe { gemm_ex(*self.handle.handle(), cfg, ptrs, ab, c_type, compute) }
            .map_err(|e| format!("{e:?}"))
    }

    /// The bf16 form of operand `op` (`name` of GEMM `what`, `need`
    /// elements from its start): its bf16 copy (whose extent the caller has
    /// checked), or its f32 elements cast into `slot` (grown as needed).
    fn bf16_of<'v, 'b>(
        &self,
        what: &str,
        name: &str,
        op: &'v Operand<'b>,
        need: usize,
        slot: &mut Option<CudaSlice<u16>>,
    ) -> Result<Half<'v, 'b>> {
        let f = match &op.elems {
            Elems::F32AndBf16(_, h) | Elems::Bf16(h) => return Ok(Half::Given(h)),
            Elems::F32(f) => f,
        };
        let kernels = self
            .kernels
            .as_ref()
            .ok_or_else(|| cuda_err(format!("casting {name} of GEMM {what}"), "no cast kernel"))?;
        if slot.as_ref().is_none_or(|b| b.len() < need) {
            *slot = None;
            *slot = Some(
                self.stream
                    .alloc_zeros::<u16>(need.max(1))
                    .map_err(|e| cuda_err("allocating a bf16 GEMM operand", e))?,
            );
        }
        let buf = slot
            .as_mut()
            .ok_or_else(|| cuda_err("casting a GEMM operand", "no scratch"))?;
        let src = f.slice(0..need);
        kernels.cast_bf16(&self.stream, &src, &mut buf.slice_mut(0..need), need)?;
        Ok(Half::Scratch)
    }

    /// `dst[..src.len()]` = `src` cast to bf16 (`mamba_cast_bf16`): the
    /// copy a caller keeps to give several bf16 GEMMs one operand
    /// ([`Elems::F32AndBf16`]) instead of each casting it again. Only for a
    /// [`Precision::Bf16`] handle (the others have no cast kernel).
    pub fn cast_into(&self, src: &CudaView<'_, f32>, dst: &mut CudaSlice<u16>) -> Result<()> {
        let n = src.len();
        let kernels = self
            .kernels
            .as_ref()
            .ok_or_else(|| cuda_err("casting to bf16", "a handle of precision bf16 only"))?;
        if dst.len() < n {
            return Err(TrainError::Config(format!(
                "bf16 copy: {n} elements into a buffer of {}",
                dst.len()
            )));
        }
        kernels.cast_bf16(&self.stream, src, &mut dst.slice_mut(0..n), n)?;
        Ok(())
    }
}

/// Where a bf16 GEMM reads an operand from.
enum Half<'v, 'b> {
    /// The caller's copy.
    Given(&'v CudaView<'b, u16>),
    /// The operand's scratch slot, just cast.
    Scratch,
}

fn sb_ptr<'s>(
    slot: &'s Option<CudaSlice<u16>>,
    s: &'s Arc<CudaStream>,
) -> Result<(
    cudarc::driver::sys::CUdeviceptr,
    cudarc::driver::SyncOnDrop<'s>,
)> {
    slot.as_ref()
        .map(|b| b.device_ptr(s))
        .ok_or_else(|| cuda_err("reading a bf16 GEMM operand", "no scratch"))
}

/// Elements from the start of a `[rows, cols]` matrix with leading
/// dimension `ld` to the end of its last row.
fn span(rows: usize, cols: usize, ld: usize) -> usize {
    if rows == 0 || cols == 0 {
        0
    } else {
        (rows - 1) * ld + cols
    }
}

/// `cublasGemmEx` of `cfg` (column-major, alpha and beta f32) over device
/// pointers `(A, B, C)`: A and B of type `ab`, C of type `c_type`.
///
/// # Safety
/// The pointers must hold the extents `cfg` implies in their types, on the
/// handle's stream.
unsafe fn gemm_ex(
    h: sys::cublasHandle_t,
    cfg: &GemmConfig<f32>,
    (a, b, c): (
        cudarc::driver::sys::CUdeviceptr,
        cudarc::driver::sys::CUdeviceptr,
        cudarc::driver::sys::CUdeviceptr,
    ),
    ab: sys::cudaDataType,
    c_type: sys::cudaDataType,
    compute: sys::cublasComputeType_t,
) -> std::result::Result<(), cudarc::cublas::result::CublasError> {
    // SAFETY: the caller's contract.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            h,
            cfg.transa,
            cfg.transb,
            cfg.m,
            cfg.n,
            cfg.k,
            (&cfg.alpha) as *const f32 as *const _,
            a as *const _,
            ab,
            cfg.lda,
            b as *const _,
            ab,
            cfg.ldb,
            (&cfg.beta) as *const f32 as *const _,
            c as *mut _,
            c_type,
            cfg.ldc,
            compute,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
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
