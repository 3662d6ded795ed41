// Shared device helpers of the Mamba kernels (mamba_ops.cu, mamba_scan.cu,
// mamba_optim.cu). Each .cu file is its own module, so everything here is
// `static __device__ __forceinline__` (internal linkage, no symbol clashes).
//
// Determinism rules every Mamba kernel follows (SPEC.md, issue 7):
//   - no float atomics anywhere; every sum has a fixed association that
//     depends only on the problem shape (never on the grid the hardware
//     picks, the SM count or the scheduling);
//   - block reductions are trees over a fixed block size in shared memory, or
//     xor-butterflies over a fixed lane group (every lane ends with the same
//     bits because IEEE addition is commutative);
//   - --fmad follows the file's bit contract (kernels/README.md): false for
//     mamba_optim.cu (bit-equal to the CPU optimizer), so `a * b + c` is two
//     roundings exactly where the source says so, and there the operations
//     are also spelled out with __fmul_rn/__fadd_rn; true for the model's
//     files (mamba_ops, mamba_scan, mamba_decode), whose contract is a
//     tolerance against the CPU model: contraction is a compile-time choice,
//     so their bits are still the same run to run.
#pragma once

#include <cstddef>
#include <cstdint>

namespace mamba {

// Threads of every block-reduction kernel. Fixed: reduction trees depend on it.
constexpr int kReduceThreads = 256;

// Rows summed by one block of the two-stage column reductions: the partial
// count is ceil(rows / kColSlab), a function of the shape alone.
constexpr int kColSlab = 256;

static __device__ __forceinline__ float sigmoidf_(float x) {
    return 1.0f / (1.0f + expf(-x));
}

// x * sigmoid(x), as torch's SiLU.
static __device__ __forceinline__ float siluf_(float x) { return x * sigmoidf_(x); }

// The gated output y * SiLU(z), as the scan's forward writes it and the
// gate's backward recomputes it (mamba_gate_bwd: the backward reads this
// value again instead of a stored copy, so the two must agree bit for bit):
// y as it is kept (f32, or its bf16 rounding read back) and z as it is
// kept. The product is __fmul_rn so no caller's context can contract it.
static __device__ __forceinline__ float gate_out(float y, float z) {
    return __fmul_rn(y, siluf_(z));
}

// d/dx SiLU(x) = s (1 + x (1 - s)), s = sigmoid(x).
static __device__ __forceinline__ float dsiluf_(float x) {
    float s = sigmoidf_(x);
    return s * (1.0f + x * (1.0f - s));
}

// torch.nn.functional.softplus(x) with beta 1 and threshold 20.
static __device__ __forceinline__ float softplusf_(float x) {
    return x > 20.0f ? x : log1pf(expf(x));
}

// Tree sum of one value per thread over a block of exactly kReduceThreads
// threads; every thread gets the result. `sh` holds kReduceThreads floats.
// The association is fixed by kReduceThreads alone.
static __device__ __forceinline__ float block_sum(float v, float* sh) {
    const int tid = threadIdx.x;
    sh[tid] = v;
    __syncthreads();
#pragma unroll
    for (int s = kReduceThreads / 2; s > 0; s >>= 1) {
        if (tid < s) sh[tid] = sh[tid] + sh[tid + s];
        __syncthreads();
    }
    float r = sh[0];
    __syncthreads();
    return r;
}

// Xor-butterfly sum over aligned groups of `width` lanes (a power of two,
// <= 32). All 32 lanes of the warp must call it; each lane of a group ends
// with the same bits.
static __device__ __forceinline__ float group_sum(float v, int width) {
    for (int off = width >> 1; off > 0; off >>= 1) {
        v = v + __shfl_xor_sync(0xffffffffu, v, off);
    }
    return v;
}

// bf16(x) rounded to nearest even, as its bits (mamba_cast_bf16, and every
// kernel that stores an activation's bf16 copy itself: the same function,
// so a fused store and a cast afterwards agree bit for bit): integer arithmetic only
// (no flush to zero, no hardware conversion), so subnormals round like any
// other value and the result is the host twin's (kernels/src/mamba/cast.rs,
// f32_to_bf16_rne) bit for bit: a NaN keeps its sign and top payload bits
// and is made quiet; +-inf stays inf; a finite value past bf16's largest
// rounds to inf.
static __device__ __forceinline__ unsigned bf16_rne(float v) {
    const unsigned x = __float_as_uint(v);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (x >> 16) | 0x0040u;
    return (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
}

// Store v at i of the f32 output (when given) and its bf16 rounding at i of
// the bf16 output (when given): how a kernel writes an activation that a
// bf16 GEMM reads, without a cast pass over it afterwards.
static __device__ __forceinline__ void store_f32_bf16(float* __restrict__ f, unsigned short* __restrict__ h,
                                                      long long i, float v) {
    if (f) f[i] = v;
    if (h) h[i] = (unsigned short)bf16_rne(v);
}

// The f32 value of a bf16 (its bits): exact, as every bf16 is an f32.
static __device__ __forceinline__ float bf16_to_f32(unsigned short h) {
    return __uint_as_float((unsigned)h << 16);
}

// store_f32_bf16, returning v as it is kept: v itself when the f32 output is
// given, else its bf16 rounding. A kernel that also derives a value from v
// (the gate's y SiLU(z)) derives it from what the backward will read back.
static __device__ __forceinline__ float store_kept(float* __restrict__ f,
                                                   unsigned short* __restrict__ h, long long i,
                                                   float v) {
    store_f32_bf16(f, h, i, v);
    return f ? v : bf16_to_f32((unsigned short)bf16_rne(v));
}

// Element i of an activation stored as f32 (`f` not null) or as bf16 only
// (`h`, when `f` is null): how a kernel reads an activation a bf16 run keeps
// in bf16 (the other precisions in f32). Exactly one of the two is given
// (the host launcher's `Stored`), the same for every thread, so the branch
// is uniform.
static __device__ __forceinline__ float load_f32_bf16(const float* __restrict__ f,
                                                      const unsigned short* __restrict__ h,
                                                      long long i) {
    return f ? f[i] : bf16_to_f32(h[i]);
}

// Runs of 8 consecutive elements i .. i + n - 1 (n <= 8) of an activation,
// for kernels whose threads each own 8 consecutive outputs of a row: the
// values and roundings of load_f32_bf16 / store_f32_bf16 element by
// element, moved as 16-byte accesses (one for 8 bf16, two for 8 f32) when
// `vec`: n == 8 and every pointer given 16-byte aligned at i (the caller's
// check, kept_vec8). A warp's fragment-wise 2-byte accesses fill each
// 32-byte sector a quarter; these fill whole sectors.
static __device__ __forceinline__ bool vec8_at(const void* p, long long i, int elem) {
    return !p || ((reinterpret_cast<unsigned long long>(p) + (unsigned long long)i * elem) & 15) == 0;
}
static __device__ __forceinline__ bool kept_vec8(const float* f, const unsigned short* h,
                                                 long long i, int n) {
    return n == 8 && vec8_at(f, i, 4) && vec8_at(h, i, 2);
}
static __device__ __forceinline__ void load8_f32_bf16(const float* __restrict__ f,
                                                      const unsigned short* __restrict__ h,
                                                      long long i, int n, bool vec,
                                                      float (&v)[8]) {
    if (vec && f) {
        const float4 a = *reinterpret_cast<const float4*>(f + i);
        const float4 b = *reinterpret_cast<const float4*>(f + i + 4);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
        v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else if (vec) {
        const uint4 q = *reinterpret_cast<const uint4*>(h + i);
        const unsigned w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            v[2 * k] = __uint_as_float(w[k] << 16);
            v[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = k < n ? load_f32_bf16(f, h, i + k) : 0.0f;
    }
}
static __device__ __forceinline__ void store8_f32_bf16(float* __restrict__ f,
                                                       unsigned short* __restrict__ h,
                                                       long long i, int n, bool vec,
                                                       const float (&v)[8]) {
    if (vec) {
        if (f) {
            *reinterpret_cast<float4*>(f + i) = float4{v[0], v[1], v[2], v[3]};
            *reinterpret_cast<float4*>(f + i + 4) = float4{v[4], v[5], v[6], v[7]};
        }
        if (h) {
            unsigned w[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) w[k] = bf16_rne(v[2 * k]) | (bf16_rne(v[2 * k + 1]) << 16);
            *reinterpret_cast<uint4*>(h + i) = uint4{w[0], w[1], w[2], w[3]};
        }
    } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            if (k < n) store_f32_bf16(f, h, i + k, v[k]);
        }
    }
}
// store8_f32_bf16, turning v into the values as kept (store_kept's).
static __device__ __forceinline__ void store8_kept(float* __restrict__ f,
                                                   unsigned short* __restrict__ h, long long i,
                                                   int n, bool vec, float (&v)[8]) {
    store8_f32_bf16(f, h, i, n, vec, v);
    if (!f) {
#pragma unroll
        for (int k = 0; k < 8; ++k) v[k] = bf16_to_f32((unsigned short)bf16_rne(v[k]));
    }
}

}  // namespace mamba
