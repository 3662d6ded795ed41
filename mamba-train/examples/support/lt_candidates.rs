//! cuBLASLt's candidate algorithms for one GEMM, each timed (the
//! `--lt-candidates` part of `bench_cuda_step`'s `--gemm-detail`).
//!
//! The model's GEMMs run through `cublasGemmEx` with `CUBLAS_GEMM_DEFAULT`
//! (`mamba_train::model::cuda::blas`): cuBLAS's heuristic picks one kernel
//! per shape. This asks cuBLASLt's heuristic for its ranked candidates for
//! the same column-major problem (`C^T = op(B)^T op(A)^T`, as `Blas` calls
//! it), with the model's 32 MiB workspace, and times each, to show whether
//! a fixed choice per shape other than the first would be faster (issue
//! 12: "the algorithm chosen once per shape, recorded"). Only a benchmark:
//! nothing here is used by the model.

use std::ffi::c_void;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::CUdeviceptr;
use cudarc::driver::CudaStream;

/// One row-major problem `C[m, n] = op(A) op(B)` (beta 0), A and B bf16
/// (else f32, run as TF32), C f32.
pub struct Problem {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub ta: bool,
    pub tb: bool,
    pub lda: usize,
    pub ldb: usize,
    pub ldc: usize,
    pub bf16: bool,
}

/// One call of a candidate, as `candidates` hands it to the timer.
pub type Call<'a> = dyn FnMut() -> Result<(), String> + 'a;

/// Runs the call it is given (as often as it likes) and returns its
/// milliseconds per call.
pub type Timer<'a> = dyn FnMut(&mut Call<'_>) -> Result<f64, String> + 'a;

/// A candidate and its time.
pub struct Candidate {
    pub algo_id: i32,
    pub tile: u32,
    pub stages: u32,
    pub split_k: i32,
    pub reduction: u32,
    pub waves: f32,
    pub workspace: usize,
    pub ms: f64,
}

fn ok(what: &str, s: lt::cublasStatus_t) -> Result<(), String> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {s:?}"))
    }
}

/// Owns the cuBLASLt objects of one problem; destroyed in `Drop`.
struct Objects {
    handle: lt::cublasLtHandle_t,
    desc: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 3],
    pref: lt::cublasLtMatmulPreference_t,
}

impl Drop for Objects {
    fn drop(&mut self) {
        // SAFETY: each was created by this struct's constructor (or is null,
        // which the destroy calls are not given) and is destroyed once.
        unsafe {
            if !self.pref.is_null() {
                lt::cublasLtMatmulPreferenceDestroy(self.pref);
            }
            for l in self.layouts {
                if !l.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.desc.is_null() {
                lt::cublasLtMatmulDescDestroy(self.desc);
            }
            if !self.handle.is_null() {
                lt::cublasLtDestroy(self.handle);
            }
        }
    }
}

/// Up to `max` heuristic candidates of `p`, each timed by `time` (which
/// runs the closure it is given and returns its milliseconds).
///
/// # Safety
/// `a`, `b` and `c` must be device pointers on `stream`'s context holding
/// the extents `p` implies in their types (A and B bf16 when `p.bf16`,
/// else f32; C f32), and `ws` at least `ws_bytes` bytes.
#[allow(clippy::too_many_arguments)]
pub unsafe fn candidates(
    stream: &CudaStream,
    p: &Problem,
    (a, b, c): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
    (ws, ws_bytes): (CUdeviceptr, usize),
    max: usize,
    time: &mut Timer<'_>,
) -> Result<Vec<Candidate>, String> {
    let mut o = Objects {
        handle: std::ptr::null_mut(),
        desc: std::ptr::null_mut(),
        layouts: [std::ptr::null_mut(); 3],
        pref: std::ptr::null_mut(),
    };
    let (ab, compute) = if p.bf16 {
        (
            lt::cudaDataType_t::CUDA_R_16BF,
            lt::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        )
    } else {
        (
            lt::cudaDataType_t::CUDA_R_32F,
            lt::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        )
    };
    // Column-major: C^T[n, m] = op(B)^T[n, k] op(A)^T[k, m]; the first
    // operand is B (transposed when B is), the second A.
    let (mm, nn, kk) = (p.n as u64, p.m as u64, p.k as u64);
    let (ta, tb) = (p.tb as i32, p.ta as i32);
    let first = if p.tb { (kk, mm) } else { (mm, kk) };
    let second = if p.ta { (nn, kk) } else { (kk, nn) };
    // SAFETY: out-pointers to this frame's fields; attribute buffers are
    // locals of the sizes passed.
    unsafe {
        ok("cublasLtCreate", lt::cublasLtCreate(&mut o.handle))?;
        ok(
            "cublasLtMatmulDescCreate",
            lt::cublasLtMatmulDescCreate(&mut o.desc, compute, lt::cudaDataType_t::CUDA_R_32F),
        )?;
        for (attr, v) in [
            (
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                ta,
            ),
            (
                lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                tb,
            ),
        ] {
            ok(
                "cublasLtMatmulDescSetAttribute",
                lt::cublasLtMatmulDescSetAttribute(
                    o.desc,
                    attr,
                    &v as *const i32 as *const c_void,
                    4,
                ),
            )?;
        }
        for (i, (ty, (rows, cols), ld)) in [
            (ab, first, p.ldb as i64),
            (ab, second, p.lda as i64),
            (lt::cudaDataType_t::CUDA_R_32F, (mm, nn), p.ldc as i64),
        ]
        .into_iter()
        .enumerate()
        {
            ok(
                "cublasLtMatrixLayoutCreate",
                lt::cublasLtMatrixLayoutCreate(&mut o.layouts[i], ty, rows, cols, ld),
            )?;
        }
        ok(
            "cublasLtMatmulPreferenceCreate",
            lt::cublasLtMatmulPreferenceCreate(&mut o.pref),
        )?;
        let wsb = ws_bytes as u64;
        ok(
            "cublasLtMatmulPreferenceSetAttribute",
            lt::cublasLtMatmulPreferenceSetAttribute(
                o.pref,
                lt::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                &wsb as *const u64 as *const c_void,
                8,
            ),
        )?;
        let mut results: Vec<lt::cublasLtMatmulHeuristicResult_t> =
            vec![std::mem::zeroed(); max.max(1)];
        let mut count = 0i32;
        ok(
            "cublasLtMatmulAlgoGetHeuristic",
            lt::cublasLtMatmulAlgoGetHeuristic(
                o.handle,
                o.desc,
                o.layouts[0],
                o.layouts[1],
                o.layouts[2],
                o.layouts[2],
                o.pref,
                results.len() as i32,
                results.as_mut_ptr(),
                &mut count,
            ),
        )?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        let cu_stream = stream.cu_stream() as lt::cudaStream_t;
        let mut out = Vec::new();
        for r in results.iter().take(count.max(0) as usize) {
            if r.state != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                continue;
            }
            let cfg = |attr: lt::cublasLtMatmulAlgoConfigAttributes_t| -> u32 {
                let mut v = 0u32;
                let mut written = 0usize;
                lt::cublasLtMatmulAlgoConfigGetAttribute(
                    &r.algo,
                    attr,
                    &mut v as *mut u32 as *mut c_void,
                    4,
                    &mut written,
                );
                v
            };
            use lt::cublasLtMatmulAlgoConfigAttributes_t as A;
            let mut run = || {
                ok(
                    "cublasLtMatmul",
                    lt::cublasLtMatmul(
                        o.handle,
                        o.desc,
                        &alpha as *const f32 as *const c_void,
                        b as *const c_void,
                        o.layouts[0],
                        a as *const c_void,
                        o.layouts[1],
                        &beta as *const f32 as *const c_void,
                        c as *const c_void,
                        o.layouts[2],
                        c as *mut c_void,
                        o.layouts[2],
                        &r.algo,
                        ws as *mut c_void,
                        ws_bytes,
                        cu_stream,
                    ),
                )
            };
            let ms = time(&mut run)?;
            out.push(Candidate {
                algo_id: cfg(A::CUBLASLT_ALGO_CONFIG_ID) as i32,
                tile: cfg(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
                stages: cfg(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
                split_k: cfg(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM) as i32,
                reduction: cfg(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                waves: r.wavesCount,
                workspace: r.workspaceSize,
                ms,
            });
        }
        Ok(out)
    }
}
