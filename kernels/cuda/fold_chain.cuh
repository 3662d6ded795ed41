// The per-element fixed-order chain shared by the fold kernels (fold.cu)
// and the peer fold (peer.cu): one thread owns an element (or a float4 group)
// and adds the addends serially, first addend first, each addition one IEEE
// f32 add rounded to nearest (__fadd_rn, never contracted or reordered), the
// optional mean one __fmul_rn of the finished sum. Both kernel files include
// this so the two paths cannot drift apart by a bit.
#pragma once

#include <cstddef>
#include <cstdint>

namespace {

__device__ __forceinline__ size_t global_thread() {
    return static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}

__device__ __forceinline__ size_t grid_threads() {
    return static_cast<size_t>(gridDim.x) * blockDim.x;
}

__device__ __forceinline__ float4 add4(float4 a, float4 b) {
    return make_float4(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y),
                       __fadd_rn(a.z, b.z), __fadd_rn(a.w, b.w));
}

__device__ __forceinline__ float4 mul4(float4 a, float f) {
    return make_float4(__fmul_rn(a.x, f), __fmul_rn(a.y, f), __fmul_rn(a.z, f),
                       __fmul_rn(a.w, f));
}

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

// ------------------------------------------------------------ pointer chain

// Addends one det_chain launch takes; the host splits longer chains into
// launches that continue from dst (its stored f32 is exactly the register
// value the next addition would have used, so splitting changes no bit).
constexpr unsigned kMaxAddends = 32;
// Addends loaded before their additions, for memory-level parallelism.
constexpr unsigned kBatch = 8;

// Passed by value in the kernel's parameter space (256 bytes).
struct ChainTerms {
    const float* p[kMaxAddends];
};

// No __restrict__ and no __ldg here: an addend may be dst itself. That is
// race-free because element i (or float4 group v) is read, from every
// addend, and then written by one thread only; ordinary loads keep the
// read-before-write of that thread. Partial overlaps of dst with an addend
// are refused by the host wrappers.
template <bool SCALE>
__device__ __forceinline__ float chain_at(const ChainTerms& a, unsigned n, size_t i, float factor) {
    float acc = 0.0f;
    for (unsigned k0 = 0; k0 < n; k0 += kBatch) {
        float r[kBatch];
#pragma unroll
        for (unsigned u = 0; u < kBatch; ++u)
            if (k0 + u < n) r[u] = a.p[k0 + u][i];
#pragma unroll
        for (unsigned u = 0; u < kBatch; ++u)
            if (k0 + u < n) acc = (k0 + u == 0) ? r[u] : __fadd_rn(acc, r[u]);
    }
    return SCALE ? __fmul_rn(acc, factor) : acc;
}

template <bool SCALE>
__device__ __forceinline__ float4 chain4_at(const ChainTerms& a, unsigned n, size_t v, float factor) {
    float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    for (unsigned k0 = 0; k0 < n; k0 += kBatch) {
        float4 r[kBatch];
#pragma unroll
        for (unsigned u = 0; u < kBatch; ++u)
            if (k0 + u < n) r[u] = reinterpret_cast<const float4*>(a.p[k0 + u])[v];
#pragma unroll
        for (unsigned u = 0; u < kBatch; ++u)
            if (k0 + u < n) acc = (k0 + u == 0) ? r[u] : add4(acc, r[u]);
    }
    return SCALE ? mul4(acc, factor) : acc;
}

}  // namespace
