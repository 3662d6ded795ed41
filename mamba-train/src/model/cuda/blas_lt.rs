//! cuBLASLt for the tf32 and bf16 GEMMs of [`super::blas::Blas`]: one
//! algorithm per problem, chosen once and kept.
//!
//! A problem is the column-major call `Blas` makes (shape, transposes,
//! leading dimensions, types) plus the alignment class of its three
//! pointers (1, 2, 4, 8 or 16 bytes; 16 for anything aligned further).
//! Its algorithm is cuBLASLt's heuristic's first candidate for it with the
//! handle's fixed workspace: a function of the problem, the GPU model and
//! the library version only. It is chosen at the problem's first call,
//! recorded ([`LtGemms::chosen`]), and never chosen again for the life of
//! the handle, so a problem runs the same kernel on every call and in every
//! run (the bits then depend on nothing else: cuBLASLt's kernels have no
//! run-time split or atomics of their own beyond the algorithm's
//! configuration, whose reduction schemes are deterministic).
//!
//! Why not `cublasGemmEx`'s default: on an H200 with CUDA 13.0 its tf32
//! picks ran the 130m step's GEMMs in 30.6 ms where cuBLASLt's first
//! candidates took 28.9 ms (`bench_cuda_step --gemm-detail --lt-candidates`,
//! docs/PERFORMANCE.md); in bf16 the two agree within 1 %. A problem for
//! which the heuristic offers nothing is recorded as such and runs through
//! `cublasGemmEx` (every call of it, so again one kernel).
//!
//! The unsafe boundary: the handle, descriptors and layouts are owned here
//! (destroyed in `Drop`, plans before the handle); [`LtGemms::matmul`] is
//! `unsafe` because the pointers' extents are the caller's to prove.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublaslt::sys as lt;
use cudarc::driver::sys::{CUdeviceptr, CUstream};

/// One column-major GEMM `C = alpha op(A) op(B) + beta C` (`alpha` = 1) as
/// `Blas` issues it: `op(A)` `[m, k]`, `op(B)` `[k, n]`, C `[m, n]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) struct Problem {
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub trans_a: bool,
    pub trans_b: bool,
    pub lda: i32,
    pub ldb: i32,
    pub ldc: i32,
    /// A and B bf16 (f32 accumulation); otherwise f32 run as TF32.
    pub ab_bf16: bool,
    /// C bf16 (only with `beta` = 0, which `Blas` enforces); else f32.
    pub c_bf16: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Key {
    problem: Problem,
    align: [u8; 3],
}

/// The chosen algorithm of one problem, with its descriptors (`algo` None:
/// the heuristic had no candidate; the caller runs `cublasGemmEx`).
struct Plan {
    desc: lt::cublasLtMatmulDesc_t,
    layouts: [lt::cublasLtMatrixLayout_t; 3],
    algo: Option<lt::cublasLtMatmulAlgo_t>,
}

struct State {
    handle: lt::cublasLtHandle_t,
    plans: HashMap<Key, Plan>,
    /// One line per problem, in the order they were first called.
    chosen: Vec<String>,
}

// SAFETY: the handle and descriptors are plain cuBLASLt objects with no
// thread affinity; every use goes through the Mutex in LtGemms, so they
// are never used from two threads at once.
unsafe impl Send for State {}

/// The cuBLASLt side of one `Blas` handle.
pub(super) struct LtGemms {
    state: Mutex<State>,
}

impl std::fmt::Debug for LtGemms {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LtGemms").finish_non_exhaustive()
    }
}

fn ok(what: &str, s: lt::cublasStatus_t) -> Result<(), String> {
    if s == lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what}: {s:?}"))
    }
}

/// The alignment class of a device address: its largest power-of-two
/// divisor, capped at 16 bytes.
fn align_of(p: CUdeviceptr) -> u8 {
    if p == 0 {
        16
    } else {
        (1u64 << p.trailing_zeros().min(4)) as u8
    }
}

impl LtGemms {
    pub fn new() -> Result<Self, String> {
        let mut handle = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local.
        ok("cublasLtCreate", unsafe { lt::cublasLtCreate(&mut handle) })?;
        Ok(LtGemms {
            state: Mutex::new(State {
                handle,
                plans: HashMap::new(),
                chosen: Vec::new(),
            }),
        })
    }

    /// Every problem run so far and the algorithm it was given, one line
    /// each, in first-call order.
    pub fn chosen(&self) -> Vec<String> {
        self.lock().chosen.clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Run `p` on `(a, b, c)` (C read with `beta` and written in place)
    /// with its recorded algorithm, choosing it first if this is the
    /// problem's first call. `Ok(false)`: cuBLASLt has no algorithm for it
    /// (recorded; nothing was run).
    ///
    /// # Safety
    /// `a`, `b` and `c` are device pointers of `stream`'s context holding
    /// the extents `p` implies in its types, C not aliasing A or B; `ws` is
    /// a device buffer of `ws_bytes` bytes used by nothing else meanwhile.
    pub unsafe fn matmul(
        &self,
        p: &Problem,
        (a, b, c): (CUdeviceptr, CUdeviceptr, CUdeviceptr),
        beta: f32,
        (ws, ws_bytes): (CUdeviceptr, usize),
        stream: CUstream,
    ) -> Result<bool, String> {
        let key = Key {
            problem: *p,
            align: [align_of(a), align_of(b), align_of(c)],
        };
        let mut st = self.lock();
        if !st.plans.contains_key(&key) {
            let handle = st.handle;
            // SAFETY: `handle` is live (owned by `st`).
            let plan = unsafe { choose(handle, &key, ws_bytes) }?;
            let line = match &plan.algo {
                Some(algo) => format!("{p:?} align {:?}: {}", key.align, describe(algo)),
                None => format!(
                    "{p:?} align {:?}: no cuBLASLt algorithm, cublasGemmEx",
                    key.align
                ),
            };
            st.chosen.push(line);
            st.plans.insert(key, plan);
        }
        let handle = st.handle;
        let Some(plan) = st.plans.get(&key) else {
            return Err("the plan just recorded is missing".into());
        };
        let Some(algo) = plan.algo.as_ref() else {
            return Ok(false);
        };
        let alpha = 1.0f32;
        // SAFETY: the descriptors belong to `handle` and describe `p`; the
        // pointers' extents are the caller's contract; C and D are the same
        // buffer with the same layout, which cuBLASLt allows.
        ok("cublasLtMatmul", unsafe {
            lt::cublasLtMatmul(
                handle,
                plan.desc,
                &alpha as *const f32 as *const c_void,
                a as *const c_void,
                plan.layouts[0],
                b as *const c_void,
                plan.layouts[1],
                &beta as *const f32 as *const c_void,
                c as *const c_void,
                plan.layouts[2],
                c as *mut c_void,
                plan.layouts[2],
                algo,
                ws as *mut c_void,
                ws_bytes,
                stream as lt::cudaStream_t,
            )
        })?;
        Ok(true)
    }
}

/// The descriptors of `key` and the heuristic's first candidate for them.
///
/// # Safety
/// `handle` must be a live cuBLASLt handle.
unsafe fn choose(handle: lt::cublasLtHandle_t, key: &Key, ws_bytes: usize) -> Result<Plan, String> {
    let p = &key.problem;
    let (ab, compute) = if p.ab_bf16 {
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
    let c_type = if p.c_bf16 {
        lt::cudaDataType_t::CUDA_R_16BF
    } else {
        lt::cudaDataType_t::CUDA_R_32F
    };
    let (m, n, k) = (p.m as u64, p.n as u64, p.k as u64);
    let a_dims = if p.trans_a { (k, m) } else { (m, k) };
    let b_dims = if p.trans_b { (n, k) } else { (k, n) };
    let mut plan = Plan {
        desc: std::ptr::null_mut(),
        layouts: [std::ptr::null_mut(); 3],
        algo: None,
    };
    let mut pref: lt::cublasLtMatmulPreference_t = std::ptr::null_mut();
    // SAFETY: out-pointers to locals and `plan`'s fields; attribute buffers
    // are locals of the sizes passed. On an error `plan` (and `pref`) are
    // dropped / destroyed with whatever was created.
    let chosen = unsafe {
        (|| -> Result<Option<lt::cublasLtMatmulAlgo_t>, String> {
            ok(
                "cublasLtMatmulDescCreate",
                lt::cublasLtMatmulDescCreate(
                    &mut plan.desc,
                    compute,
                    lt::cudaDataType_t::CUDA_R_32F,
                ),
            )?;
            for (attr, t) in [
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                    p.trans_a,
                ),
                (
                    lt::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                    p.trans_b,
                ),
            ] {
                let v = t as i32; // CUBLAS_OP_N = 0, CUBLAS_OP_T = 1
                ok(
                    "cublasLtMatmulDescSetAttribute",
                    lt::cublasLtMatmulDescSetAttribute(
                        plan.desc,
                        attr,
                        &v as *const i32 as *const c_void,
                        4,
                    ),
                )?;
            }
            for (i, (ty, (rows, cols), ld)) in [
                (ab, a_dims, p.lda),
                (ab, b_dims, p.ldb),
                (c_type, (m, n), p.ldc),
            ]
            .into_iter()
            .enumerate()
            {
                ok(
                    "cublasLtMatrixLayoutCreate",
                    lt::cublasLtMatrixLayoutCreate(&mut plan.layouts[i], ty, rows, cols, ld as i64),
                )?;
            }
            ok(
                "cublasLtMatmulPreferenceCreate",
                lt::cublasLtMatmulPreferenceCreate(&mut pref),
            )?;
            use lt::cublasLtMatmulPreferenceAttributes_t as P;
            let wsb = ws_bytes as u64;
            ok(
                "cublasLtMatmulPreferenceSetAttribute",
                lt::cublasLtMatmulPreferenceSetAttribute(
                    pref,
                    P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                    &wsb as *const u64 as *const c_void,
                    8,
                ),
            )?;
            for (attr, al) in [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align[0]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align[1]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align[2]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align[2]),
            ] {
                let v = al as u32;
                ok(
                    "cublasLtMatmulPreferenceSetAttribute",
                    lt::cublasLtMatmulPreferenceSetAttribute(
                        pref,
                        attr,
                        &v as *const u32 as *const c_void,
                        4,
                    ),
                )?;
            }
            let mut result: lt::cublasLtMatmulHeuristicResult_t = std::mem::zeroed();
            let mut count = 0i32;
            let s = lt::cublasLtMatmulAlgoGetHeuristic(
                handle,
                plan.desc,
                plan.layouts[0],
                plan.layouts[1],
                plan.layouts[2],
                plan.layouts[2],
                pref,
                1,
                &mut result,
                &mut count,
            );
            if s == lt::cublasStatus_t::CUBLAS_STATUS_NOT_SUPPORTED
                || count < 1
                || result.state != lt::cublasStatus_t::CUBLAS_STATUS_SUCCESS
            {
                return Ok(None);
            }
            ok("cublasLtMatmulAlgoGetHeuristic", s)?;
            if result.workspaceSize > ws_bytes {
                return Ok(None);
            }
            Ok(Some(result.algo))
        })()
    };
    if !pref.is_null() {
        // SAFETY: created above, destroyed once.
        unsafe { lt::cublasLtMatmulPreferenceDestroy(pref) };
    }
    plan.algo = chosen?;
    Ok(plan)
}

/// The algorithm's configuration, for the record.
fn describe(algo: &lt::cublasLtMatmulAlgo_t) -> String {
    use lt::cublasLtMatmulAlgoConfigAttributes_t as A;
    let get = |attr| {
        let (mut v, mut written) = (0u32, 0usize);
        // SAFETY: reads one u32 attribute of a valid algorithm into a local.
        unsafe {
            lt::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                &mut v as *mut u32 as *mut c_void,
                4,
                &mut written,
            )
        };
        v
    };
    format!(
        "algo {} tile {} stages {} split-k {} reduction {}",
        get(A::CUBLASLT_ALGO_CONFIG_ID),
        get(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
        get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        get(A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
        get(A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
    )
}

impl Drop for Plan {
    fn drop(&mut self) {
        // SAFETY: each object was created for this plan (or is null and
        // skipped) and is destroyed once; errors are ignored (no panic in
        // Drop).
        unsafe {
            for l in self.layouts {
                if !l.is_null() {
                    lt::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.desc.is_null() {
                lt::cublasLtMatmulDescDestroy(self.desc);
            }
        }
    }
}

impl Drop for State {
    fn drop(&mut self) {
        // Plans before the handle they were made with.
        self.plans.clear();
        if !self.handle.is_null() {
            // SAFETY: created in LtGemms::new, destroyed once.
            unsafe { lt::cublasLtDestroy(self.handle) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::align_of;

    #[test]
    fn alignment_classes_cap_at_sixteen_bytes() {
        assert_eq!(align_of(0x1000), 16);
        assert_eq!(align_of(0x1010), 16);
        assert_eq!(align_of(0x1008), 8);
        assert_eq!(align_of(0x1004), 4);
        assert_eq!(align_of(0x1002), 2);
        assert_eq!(align_of(0x1001), 1);
    }
}
